"""`vlmrl convert --from trl|easyr1|ms-swift|vlm-r1 FILE_OR_ARGS`: another trainer's config as a vlmrl YAML.

Reads a YAML config (TRL's flat keys, EasyR1's nested sections), a launch script (the ``--key value`` arguments
of its ``torchrun`` / ``accelerate launch`` / ``swift rlhf`` line, shell variables set in the script filled in),
or the ``--key value`` arguments themselves. Every key either becomes a vlmrl setting or is listed with why it
has none (vLLM settings: vlmrl generates in-process; ZeRO / FSDP settings: the accelerate config to launch with).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Callable

import yaml

from vlmrl.config import ConfigError
from vlmrl.config import TRACKERS, _merge_key, build_config

PEERS = ("trl", "easyr1", "ms-swift", "vlm-r1")
VLLM = "vLLM: vlmrl generates in-process (rollout.engine, memory.shared_prefix); no separate inference engine"
ZERO = "ZeRO / FSDP: launch with accelerate and a config from configs/accelerate (docs/scaling_out.md)"
LAUNCH = "processes and nodes: the launcher's (accelerate launch --num_processes / torchrun), not a config key"
TRACKER_NAME = "run / project names: the trackers' own environment variables (WANDB_PROJECT, WANDB_NAME, MLFLOW_EXPERIMENT_NAME)"
NO_HUB = "vlmrl reads local files and folders: download the dataset / model first and give its path"

# TRL's GRPOConfig / ModelConfig names (VLM-R1 and ms-swift take them too) -> vlmrl key, or None with a reason.
TRL_KEYS: dict[str, str] = {
    "model_name_or_path": "model.name_or_path",
    "output_dir": "training.output_dir",
    "learning_rate": "optim.learning_rate",
    "weight_decay": "optim.weight_decay",
    "warmup_ratio": "optim.warmup_ratio",
    "lr_scheduler_type": "optim.lr_scheduler_type",
    "max_grad_norm": "optim.max_grad_norm",
    "adam_beta1": "optim.adam_beta1",
    "adam_beta2": "optim.adam_beta2",
    "per_device_train_batch_size": "training.per_device_train_batch_size",
    "per_device_eval_batch_size": "training.eval_batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "max_steps": "training.max_steps",
    "num_train_epochs": "training.num_train_epochs",
    "seed": "training.seed",
    "bf16": "training.bf16",
    "save_steps": "training.save_steps",
    "save_total_limit": "training.save_total_limit",
    "save_only_model": "training.save_only_model",
    "eval_steps": "training.eval_steps",
    "logging_steps": "logging.logging_steps",
    "report_to": "logging.report_to",
    "log_completions": "logging.log_completions",
    "num_generations": "rollout.num_generations",
    "generation_batch_size": "rollout.generation_batch_size",
    "steps_per_generation": "rollout.steps_per_generation",
    "max_completion_length": "rollout.max_completion_length",
    "max_prompt_length": "data.max_prompt_length",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "beta": "algorithm.beta",
    "epsilon": "algorithm.epsilon",
    "epsilon_high": "algorithm.epsilon_high",
    "num_iterations": "algorithm.num_iterations",
    "loss_type": "algorithm.loss_type",
    "scale_rewards": "algorithm.scale_rewards",
    "mask_truncated_completions": "algorithm.mask_truncated_completions",
    "reward_weights": "algorithm.reward_weights",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "attn_implementation": "model.attn_implementation",
    "torch_dtype": "model.dtype",
    "dtype": "model.dtype",
    "use_peft": "model.use_lora",
    "lora_r": "model.lora_r",
    "lora_alpha": "model.lora_alpha",
    "lora_dropout": "model.lora_dropout",
    "lora_target_modules": "model.lora_target_modules",
    "trust_remote_code": "model.trust_remote_code",
    "freeze_vision_modules": "model.freeze_vision_tower",
    "max_pixels": "data.max_pixels",
    "min_pixels": "data.min_pixels",
    "system_prompt": "data.system_prompt",
    "eval_strategy": "training.eval_steps",
    "save_strategy": "training.save_steps",
}
TRL_REASONS: dict[str, str] = {
    "use_vllm": VLLM,
    "deepspeed": ZERO,
    "fsdp": ZERO,
    "run_name": TRACKER_NAME,
    "logging_dir": "logs go to output_dir (metrics.jsonl, tb/)",
    "push_to_hub": "vlmrl writes output_dir/final; upload it yourself",
    "resume_from_checkpoint": "vlmrl resumes from output_dir's newest checkpoint by default (training.resume)",
    "dataloader_num_workers": "images are decoded in threads and cached (data.image_cache_mb)",
    "data_seed": "one seed (training.seed) orders the data and the sampling",
    "dataset_name": NO_HUB,
    "ddp_timeout": LAUNCH,
    "remove_unused_columns": "every column is kept for the rewards",
    "sync_ref_model": "vlmrl's reference is the initial policy (algorithm.beta)",
    "repetition_penalty": "vlmrl samples with temperature / top_p / top_k only",
    "config_file": "accelerate's own option: keep it on the accelerate launch line (docs/scaling_out.md)",
    "nproc_per_node": LAUNCH,
    "nnodes": LAUNCH,
    "node_rank": LAUNCH,
    "master_addr": LAUNCH,
    "master_port": LAUNCH,
    "num_processes": LAUNCH,
}
TRL_REASON_PREFIXES = {"vllm_": VLLM, "hub_": "vlmrl writes output_dir/final; upload it yourself", "wandb_": TRACKER_NAME}


class Conversion:
    """What a conversion produced: the vlmrl settings and the keys left out with why."""

    def __init__(self) -> None:
        self.settings: dict[str, Any] = {}
        self.unmapped: dict[str, str] = {}
        self.notes: list[str] = []  # lines `vlmrl convert` prints besides the unmapped keys (defaults filled, batch scaling)

    def set(self, key: str, value: Any) -> None:
        self.settings[key] = value

    def skip(self, key: str, why: str) -> None:
        self.unmapped[key] = why

    def tree(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for dotted, value in self.settings.items():
            section, _, name = dotted.partition(".")
            if "." in name:  # data.columns.problem
                name, _, key = name.partition(".")
                out.setdefault(section, {}).setdefault(name, {})[key] = value
            else:
                out.setdefault(section, {})[name] = value
        return out


# ---------------------------------------------------------------------------------------------------
# Reading the input


def read_source(args: list[str]) -> dict[str, Any]:
    """The settings of a YAML file, a launch script, or ``--key value`` arguments, as {key: value} (nested for YAML).
    A script's ``VAR=value cmd`` environment prefixes come back as UPPERCASE keys (no option is spelled so)."""
    if not args:
        raise ConfigError("vlmrl convert: give a config file, a launch script or --key value arguments")
    first = Path(args[0])
    if len(args) == 1 and first.suffix in (".yaml", ".yml", ".json") and first.is_file():
        data = yaml.safe_load(first.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ConfigError(f"{first}: expected a mapping of settings")
        return data
    if len(args) == 1 and first.is_file():
        environment, words = launch_command(first.read_text(encoding="utf-8"))
        return {**{k: _scalar(v) for k, v in environment.items()}, **parse_arguments(words)}
    return parse_arguments(args)


def script_arguments(text: str) -> list[str]:
    """The ``--key value`` words of a launch script's command (see launch_command)."""
    return launch_command(text)[1]


def launch_command(text: str) -> tuple[dict[str, str], list[str]]:
    """(environment prefixes, arguments) of a launch script's command: lines joined at a trailing backslash (one
    newline: an empty line after it ends the command, as in bash), ``VAR=value`` lines of the script substituted into
    ``$VAR`` / ``${VAR}``, and of the longest command line its ``VAR=value`` prefixes and everything from its first
    ``--`` option on."""
    joined = re.sub(r"\\[ \t]*\n", " ", text)
    variables: dict[str, str] = {}
    best: tuple[dict[str, str], list[str]] = ({}, [])
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        assignment = re.fullmatch(r"(?:export\s+)?([A-Za-z_]\w*)=(.*)", line)
        if assignment:
            try:
                words = shlex.split(assignment[2])
            except ValueError:
                words = []
            if len(words) <= 1:  # `VAR=value` alone; `VAR=value cmd --args` is a command with an environment prefix
                variables[assignment[1]] = _substitute(words[0], variables) if words else ""
                continue
        try:
            words = shlex.split(_substitute(line, variables))
        except ValueError:
            continue
        options = [i for i, w in enumerate(words) if w.startswith("--")]
        if options and len(words) - options[0] > len(best[1]):
            prefix = dict(re.fullmatch(r"([A-Za-z_]\w*)=(.*)", w, re.DOTALL).groups() for w in _env_prefix(words))
            best = (prefix, words[options[0] :])
    return best


def _substitute(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m[1] or m[2], m[0]), text)


def _env_prefix(words: list[str]) -> list[str]:
    """The leading ``VAR=value`` words of a command (its environment)."""
    out = []
    for word in words:
        if not re.fullmatch(r"[A-Za-z_]\w*=.*", word, re.DOTALL):
            break
        out.append(word)
    return out


def parse_arguments(words: list[str]) -> dict[str, Any]:
    """``--key value [value ...]`` -> {key: value or list}; a flag without a value is true; values parsed as YAML."""
    out: dict[str, Any] = {}
    key = None
    for word in words:
        if word.startswith("--"):
            key, eq, value = word[2:].replace("-", "_").partition("=")
            out[key] = _scalar(value) if eq else True
        elif key is not None:
            value = _scalar(word.rstrip(","))
            out[key] = value if out[key] is True else (out[key] if isinstance(out[key], list) else [out[key]]) + [value]
    return out


def _scalar(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+", value):
        return float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
    return value if isinstance(value, (str, int, float, bool)) or value is None else text


# ---------------------------------------------------------------------------------------------------
# Mapping


def convert_trl_keys(source: dict[str, Any], out: Conversion, handled: set[str] = frozenset()) -> None:
    """Keys named as TRL names them, each set or listed."""
    for key, value in source.items():
        if key in handled:
            continue
        if key in TRL_KEYS:
            target = TRL_KEYS[key]
            if key in ("eval_strategy", "save_strategy"):
                if value in ("no", False):
                    out.set(target, 0)
                elif value != "steps":
                    out.skip(key, f"vlmrl evaluates / saves every {target} steps (value {value!r})")
                continue
            if key == "lora_target_modules" and isinstance(value, str):
                value = [value] if value != "all-linear" else value
            if key in ("torch_dtype", "dtype") and value in ("bf16", "fp16", "fp32", "auto"):
                value = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "bfloat16"}[value]
            if key == "report_to":
                value = _trackers(value, out, key)
            out.set(target, value)
        elif key in TRL_REASONS:
            out.skip(key, TRL_REASONS[key])
        else:
            prefix = next((p for p in TRL_REASON_PREFIXES if key.startswith(p)), None)
            out.skip(key, TRL_REASON_PREFIXES[prefix] if prefix else "no vlmrl setting of that meaning")


def _trackers(value: Any, out: Conversion, key: str) -> list[str]:
    """report_to's trackers that vlmrl has; the others (swanlab, clearml, ...) listed, "none" when nothing is left."""
    names = [str(v) for v in (value if isinstance(value, list) else [value])]
    known = [n for n in names if n in (*TRACKERS, "all", "none")]
    if len(known) < len(names):
        out.skip(f"{key} ({', '.join(n for n in names if n not in known)})", f"vlmrl reports to {', '.join(TRACKERS)} only")
    return known or ["none"]


# TRL's defaults (GRPOConfig / TrainingArguments) that shape a run and differ from vlmrl's: a TRL command that leaves
# them out ran with these. algorithm.preset=trl gives TRL's loss, KL and optimizer defaults.
TRL_DEFAULTS = {
    "training.per_device_train_batch_size": 8,
    "rollout.num_generations": 8,
    "rollout.max_completion_length": 512,
    "algorithm.preset": "trl",
}


def from_trl(source: dict[str, Any]) -> Conversion:
    out = Conversion()
    funcs = source.get("reward_funcs")
    if funcs is not None:
        out.skip("reward_funcs", "TRL takes reward functions in Python; name yours in algorithm.reward_funcs as path/to/file.py:function")
    handled = convert_environment(source, out)
    convert_trl_keys(source, out, {"reward_funcs", *handled})
    filled = [f"{k}={v}" for k, v in TRL_DEFAULTS.items() if k not in out.settings]
    for key, value in TRL_DEFAULTS.items():
        out.settings.setdefault(key, value)
    if filled:
        out.notes.append(f"TRL's defaults for what the source leaves unset: {', '.join(filled)}")
    if "reward_funcs" not in source:
        out.notes.append(
            "the source names no reward (TRL's scripts pass them in Python): set algorithm.reward_funcs, "
            "e.g. [trl.rewards:accuracy_reward, trl.rewards:think_format_reward] as examples/scripts/grpo_vlm.py uses"
        )
    return out


# Launch-line environment variables that carry a setting; the others are the shell's (listed, left to it).
ENV_KEYS = {"MAX_PIXELS": "data.max_pixels", "MIN_PIXELS": "data.min_pixels"}
ENV_PROCESSES = ("NPROC_PER_NODE", "NNODES")


def convert_environment(source: dict[str, Any], out: Conversion) -> set[str]:
    """The UPPERCASE keys (a launch line's ``VAR=value`` prefixes): ENV_KEYS set, the process counts read by
    process_count, the rest listed. Returns the keys handled."""
    handled = {k for k in source if k.isupper()}
    for key in sorted(handled):
        if key in ENV_KEYS:
            out.set(ENV_KEYS[key], source[key])
        elif key not in ENV_PROCESSES:
            out.skip(key, "an environment variable of the launch: set it in the shell that runs vlmrl if it still applies")
    return handled


def from_vlm_r1(source: dict[str, Any]) -> Conversion:
    out = Conversion()
    paths = str(source.get("data_file_paths") or "").split(":")
    folders = str(source.get("image_folders") or "").split(":")
    if paths[0]:
        out.set("data.train_path", paths[0])
        if len(paths) > 1:
            out.skip("data_file_paths", f"vlmrl trains on one file: {paths[0]} kept; concatenate the other {len(paths) - 1} into it")
    if folders[0]:
        out.set("data.image_root", list(dict.fromkeys(folders)) if len(set(folders)) > 1 else folders[0])
    if source.get("reward_funcs") is not None:
        out.skip(
            "reward_funcs",
            f"VLM-R1's {source['reward_funcs']} are functions in its grpo_jsonl.py: put them in a file and name them, e.g. "
            "algorithm.reward_funcs=[my_rewards.py:accuracy_reward, my_rewards.py:format_reward] (vlmrl's own 'accuracy' / 'format' differ)",
        )
    for key, why in {
        "reward_method": "a per-file accu_reward_method: set it as a column of the data (VLM-R1's loader adds 'default')",
        "task_type": "VLM-R1 picks its question template by task: write the question into the data or data.prompt_template",
        "is_reward_customized_from_vlm_module": "VLM-R1's module-specific rewards: name the function in algorithm.reward_funcs",
        "val_split_ratio": "give a held-out file as data.eval_path",
        "max_anyres_num": "InternVL tiling is the processor's own setting",
        "arrow_cache_dir": "rows are read directly; embedded images are cached under $VLMRL_CACHE",
    }.items():
        if key in source:
            out.skip(key, why)
    handled = {"data_file_paths", "image_folders", "reward_funcs", "reward_method", "task_type", "is_reward_customized_from_vlm_module"}
    handled |= convert_environment(source, out)
    convert_trl_keys(source, out, handled | {"val_split_ratio", "max_anyres_num", "arrow_cache_dir"})
    return out


SWIFT_REASONS = {
    "rlhf_type": "vlmrl train is GRPO (and its variants: algorithm.*)",
    "external_plugins": "the plugin file is named in each algorithm.reward_funcs entry",
    "max_length": "prompts: data.max_prompt_length; completions: rollout.max_completion_length",
    "async_generate": VLLM,
    "load_from_cache_file": "rows are read directly",
    "target_modules": "model.lora_target_modules (module names; all-linear is not a name)",
    "sleep_level": VLLM,
    "importance_sampling_level": "vlmrl's ratios are per token (GRPO); no sequence-level (GSPO) ratio",
    "offload_model": "moves the model aside while vLLM generates: " + VLLM,
    "offload_optimizer": "moves the optimizer aside while vLLM generates: " + VLLM,
}
SWIFT_HANDLED = {"external_plugins", "reward_funcs", "model", "dataset", "val_dataset", "system", "train_type", "tuner_type"}
SWIFT_HANDLED |= {"freeze_vit", "overlong_filter", "advantage_estimator", "dynamic_sample", "max_resample_times", "soft_max_length"}
SWIFT_HANDLED |= {"soft_cache_length", *SWIFT_REASONS}


def from_ms_swift(source: dict[str, Any]) -> Conversion:
    out = Conversion()
    _swift_rewards(source, out)
    if "model" in source:
        out.set("model.name_or_path", source["model"])
    _swift_data(source, out)
    for key in ("train_type", "tuner_type"):  # ms-swift 4 renamed train_type to tuner_type
        if key in source:
            out.set("model.use_lora", source[key] == "lora")
    estimator = source.get("advantage_estimator")
    if estimator == "reinforce_plus_plus":
        out.set("algorithm.advantage_estimator", "reinforce_pp")
    elif estimator not in (None, "grpo"):
        out.skip("advantage_estimator", f"{estimator!r}: vlmrl's estimators are grpo, grpo_batch_std, dr_grpo, reinforce_pp")
    if "overlong_filter" in source:
        out.set("algorithm.mask_truncated_completions", bool(source["overlong_filter"]))
    if "dynamic_sample" in source:
        out.set("algorithm.dynamic_sampling", bool(source["dynamic_sample"]))
    if "max_resample_times" in source:  # ms-swift scores this many batches per step at most, as vlmrl's count
        out.set("algorithm.dynamic_sampling_max_batches", source["max_resample_times"])
    if "freeze_vit" in source:
        out.set("model.freeze_vision_tower", bool(source["freeze_vit"]))
    for key, why in SWIFT_REASONS.items():
        if key in source:
            out.skip(key, why)
    convert_trl_keys(source, out, SWIFT_HANDLED | convert_environment(source, out))
    return out


def _swift_rewards(source: dict[str, Any], out: Conversion) -> None:
    """--reward_funcs: plugin names as plugin.py:name; accuracy / format stay vlmrl's built-ins (and say so)."""
    plugins = source.get("external_plugins")
    plugin = (plugins[0] if isinstance(plugins, list) else plugins) if plugins else None
    funcs = source.get("reward_funcs")
    if funcs is None:
        return
    names = funcs if isinstance(funcs, list) else [funcs]
    out.set("algorithm.reward_funcs", [_swift_reward_spec(n, plugin, source) for n in names])
    if any(n in ("accuracy", "format") for n in names):
        out.skip("reward_funcs (accuracy, format)", "kept as vlmrl's built-ins of those names (`vlmrl check` says what they compare)")


def _swift_reward_spec(name: str, plugin: str | None, source: dict[str, Any]) -> str:
    """One --reward_funcs name as a vlmrl spec: ms-swift's soft_overlong (DAPO's soft overlong punishment, L_max =
    --soft_max_length or --max_completion_length, L_cache = --soft_cache_length) as vlmrl's function of the same
    formula, in place, so --reward_weights still line up; accuracy / format stay vlmrl's built-ins; the rest the plugin's."""
    if name == "soft_overlong":
        max_len = source.get("soft_max_length") or source.get("max_completion_length", 512)
        cache = source.get("soft_cache_length")
        if cache is None:
            raise ConfigError("ms-swift's soft_overlong needs --soft_cache_length (L_cache); the source gives none")
        return f"vlmrl.rewards.functions:soft_overlong_punishment(max_completion_len={max_len}, soft_punish_cache={cache})"
    return f"{plugin}:{name}" if plugin and name not in ("accuracy", "format") else name


def _swift_data(source: dict[str, Any], out: Conversion) -> None:
    """--dataset / --val_dataset / --system (a prompt file is read when it is here)."""
    if "dataset" in source:
        datasets = source["dataset"] if isinstance(source["dataset"], list) else [source["dataset"]]
        out.set("data.train_path", str(datasets[0]))
        if len(datasets) > 1:
            out.skip("dataset", f"vlmrl trains on one file: {datasets[0]} kept")
    if "val_dataset" in source:
        out.set("data.eval_path", str(source["val_dataset"]))
    if "system" in source:
        system = Path(str(source["system"]))
        if system.is_file():
            out.set("data.system_prompt", system.read_text(encoding="utf-8").strip())
        elif system.suffix in (".txt", ".md"):
            out.skip("system", f"{system} is not here: set data.system_prompt to its text")
        else:
            out.set("data.system_prompt", source["system"])


def from_easyr1(source: dict[str, Any]) -> Conversion:
    """EasyR1's nested YAML (data / algorithm / worker / trainer)."""
    out = Conversion()
    for dotted, value in _flatten(source):
        handler = EASYR1_KEYS.get(dotted)
        if handler is None:
            out.skip(dotted, _easyr1_reason(dotted))
        elif isinstance(handler, str):
            if value is not None:
                out.set(handler, value)
        else:
            handler(value, out, source)
    return out


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in ("worker.reward.reward_function_kwargs",):
            items += _flatten(value, dotted + ".")
        else:
            items.append((dotted, value))
    return items


FILTER_BOUNDS = (
    "vlmrl keeps a group whose values are not all equal (verl's rule); EasyR1's low < group mean < high keeps the same "
    "groups for 0/1 rewards when G < 1/low and G < 1/(1 - high) (G: rollout.num_generations)"
)
EASYR1_REASONS = {
    "worker.actor.optim.strategy": "vlmrl's optimizer is AdamW (optim.*)",
    "worker.actor.model.lora.target_modules": "model.lora_target_modules lists module names (all-linear is not one)",
    "worker.actor.model.lora.exclude_modules": "LoRA goes on the language model unless model.lora_vision",
    "worker.rollout.limit_images": "data.limit_images (EasyR1's 0 = no limit; vlmrl's default is 4)",
    "data.val_batch_size": "training.eval_batch_size (prompts per greedy batch)",
    "data.mini_rollout_batch_size": "one generation batch per step (rollout.generation_batch_size)",
    "data.override_chat_template": "vlmrl uses the model folder's chat template (chat_template.jinja)",
    "algorithm.filter_low": FILTER_BOUNDS,
    "algorithm.filter_high": FILTER_BOUNDS,
    "trainer.val_only": "vlmrl eval scores a model without training",
    "trainer.val_generations_to_log": "logging.log_completions (training samples); eval samples follow it too",
    "trainer.load_checkpoint_path": "training.resume=<checkpoint path>",
    "trainer.find_last_checkpoint": "training.resume=auto (the default) resumes from output_dir's newest checkpoint",
}


def _easyr1_reason(dotted: str) -> str:
    if dotted in EASYR1_REASONS:
        return EASYR1_REASONS[dotted]
    if dotted.startswith("worker.rollout."):
        return VLLM
    if ".fsdp." in dotted or ".offload." in dotted or dotted.endswith(("padding_free", "dynamic_batching", "ulysses_size")):
        return ZERO
    if dotted.startswith("worker.ref."):
        return "vlmrl's reference is the initial policy; where it lives: memory.ref_placement"
    if dotted in ("trainer.nnodes", "trainer.n_gpus_per_node"):
        return LAUNCH + "; EasyR1's batch sizes are global, as vlmrl's"
    if dotted in ("trainer.project_name", "trainer.experiment_name"):
        return TRACKER_NAME
    return "no vlmrl setting of that meaning"


def _files(key: str) -> Callable[[Any, Conversion, dict], None]:
    def convert(value, out: Conversion, _source) -> None:
        path, _, split = str(value).partition("@")
        out.set(key, path if not split or Path(path).suffix else f"{path}::{split}")

    return convert


def _column(field_name: str, default: str) -> Callable[[Any, Conversion, dict], None]:
    def convert(value, out: Conversion, _source) -> None:
        if value and value != default:
            out.set(f"data.columns.{field_name}", value)

    return convert


def _reward(value, out: Conversion, source: dict) -> None:
    kwargs = ((source.get("worker") or {}).get("reward") or {}).get("reward_function_kwargs") or {}
    spec = str(value)
    if kwargs:
        spec += "(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
    out.set("algorithm.reward_funcs", [spec])


def _kl(value, out: Conversion, source: dict) -> None:
    algorithm = source.get("algorithm") or {}
    out.set("algorithm.beta", 0.0 if algorithm.get("disable_kl") else value)


def _lora_rank(value, out: Conversion, _source) -> None:
    if value:
        out.set("model.use_lora", True)
        out.set("model.lora_r", value)


def _every(key: str) -> Callable[[Any, Conversion, dict], None]:
    def convert(value, out: Conversion, _source) -> None:
        out.set(key, 0 if value is None or value < 0 else value)

    return convert


def _save_limit(value, out: Conversion, _source) -> None:
    out.set("training.save_total_limit", None if value is None or value < 0 else value)


def _rollout_batch(value, out: Conversion, source: dict) -> None:
    n = ((source.get("worker") or {}).get("rollout") or {}).get("n") or 1
    out.set("rollout.generation_batch_size", int(value) * int(n))  # prompts per step x completions per prompt


def _update_batch(value, out: Conversion, source: dict) -> None:
    """EasyR1's global_batch_size (prompts per optimizer step, all GPUs; x rollout.n completions) as vlmrl's optimizer
    batch, per_device_train_batch_size x gradient_accumulation_steps completions (global too)."""
    worker = source.get("worker") or {}
    n = int((worker.get("rollout") or {}).get("n") or 1)
    micro = int((worker.get("actor") or {}).get("micro_batch_size_per_device_for_update") or 1)
    completions = int(value) * n
    if completions % micro:
        out.skip("worker.actor.global_batch_size", f"{value} x rollout.n={n} completions is not a multiple of the micro-batch {micro}")
    else:
        out.set("training.gradient_accumulation_steps", completions // micro)


def _logger(value, out: Conversion, _source) -> None:
    trackers = [t for t in (value if isinstance(value, list) else [value]) if t in ("wandb", "mlflow", "tensorboard")]
    out.set("logging.report_to", trackers or ["none"])


def _estimator(value, out: Conversion, _source) -> None:
    names = {"grpo": None, "reinforce_plus_plus": "reinforce_pp", "remax": None, "rloo": None}
    if value in ("grpo",):
        return
    if names.get(value):
        out.set("algorithm.advantage_estimator", names[value])
    else:
        out.skip("algorithm.adv_estimator", f"{value!r}: vlmrl's estimators are grpo, grpo_batch_std, dr_grpo, reinforce_pp")


def _filter_key(value, out: Conversion, _source) -> None:
    """EasyR1's filter_key: overall is the weighted reward; another key is one entry of a reward's score dict, which
    vlmrl logs but does not filter on."""
    if value in (None, "overall"):
        out.set("algorithm.dynamic_sampling_metric", "reward")
    else:
        out.skip(
            "algorithm.filter_key",
            f"{value!r} is a key of the reward's score dict: vlmrl filters on the weighted reward or one reward function's "
            "values (algorithm.dynamic_sampling_metric)",
        )


def _max_batches(value, out: Conversion, _source) -> None:
    if isinstance(value, int) and value > 0:
        out.set("algorithm.dynamic_sampling_max_batches", value)
    else:
        out.skip("trainer.max_try_make_batch", f"{value!r} means no limit: vlmrl bounds it (algorithm.dynamic_sampling_max_batches, default 10)")


def _ignore(_value, _out: Conversion, _source) -> None:
    return None


EASYR1_KEYS: dict[str, Any] = {
    "data.train_files": _files("data.train_path"),
    "data.val_files": _files("data.eval_path"),
    "data.prompt_key": _column("problem", "problem"),
    "data.answer_key": _column("solution", "answer"),
    "data.image_key": _column("images", "images"),
    "data.video_key": _column("videos", "videos"),
    "data.image_dir": "data.image_root",
    "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "rollout.max_completion_length",
    "data.rollout_batch_size": _rollout_batch,
    "data.format_prompt": "data.prompt_template",
    "data.shuffle": "data.shuffle",
    "data.seed": "training.seed",
    "data.min_pixels": "data.min_pixels",
    "data.max_pixels": "data.max_pixels",
    "data.video_fps": "data.fps",
    "data.filter_overlong_prompts": _ignore,  # data.max_prompt_length refuses them instead
    "algorithm.adv_estimator": _estimator,
    "algorithm.kl_coef": _kl,
    "algorithm.disable_kl": _ignore,  # read by _kl
    "algorithm.use_kl_loss": _ignore,  # vlmrl's KL is a loss term (k3), as use_kl_loss=true with low_var_kl
    "algorithm.kl_penalty": _ignore,
    "algorithm.online_filtering": "algorithm.dynamic_sampling",
    "algorithm.filter_key": _filter_key,
    "trainer.max_try_make_batch": _max_batches,
    "worker.actor.global_batch_size": _update_batch,
    "worker.actor.micro_batch_size_per_device_for_update": "training.per_device_train_batch_size",
    "worker.actor.micro_batch_size_per_device_for_experience": "memory.scoring_micro_batch_size",
    "worker.actor.max_grad_norm": "optim.max_grad_norm",
    "worker.actor.model.model_path": "model.name_or_path",
    "worker.actor.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "worker.actor.model.trust_remote_code": "model.trust_remote_code",
    "worker.actor.model.freeze_vision_tower": "model.freeze_vision_tower",
    "worker.actor.model.lora.rank": _lora_rank,
    "worker.actor.model.lora.alpha": "model.lora_alpha",
    "worker.actor.optim.lr": "optim.learning_rate",
    "worker.actor.optim.weight_decay": "optim.weight_decay",
    "worker.actor.optim.lr_warmup_ratio": "optim.warmup_ratio",
    "worker.rollout.n": "rollout.num_generations",
    "worker.rollout.temperature": "rollout.temperature",
    "worker.rollout.top_p": "rollout.top_p",
    "worker.reward.reward_function": _reward,
    "worker.reward.reward_function_kwargs": _ignore,  # bound in _reward
    "trainer.total_epochs": "training.num_train_epochs",
    "trainer.max_steps": "training.max_steps",
    "trainer.logger": _logger,
    "trainer.val_freq": _every("training.eval_steps"),
    "trainer.val_before_train": "training.val_before_train",
    "trainer.save_freq": _every("training.save_steps"),
    "trainer.save_limit": _save_limit,
    "trainer.save_model_only": "training.save_only_model",
    "trainer.save_checkpoint_path": "training.output_dir",
}

CONVERTERS: dict[str, Callable[[dict], Conversion]] = {"trl": from_trl, "easyr1": from_easyr1, "ms-swift": from_ms_swift, "vlm-r1": from_vlm_r1}


PER_DEVICE_PEERS = ("trl", "ms-swift", "vlm-r1")  # their batch sizes are per GPU; vlmrl's and EasyR1's are global


def process_count(source: dict[str, Any]) -> tuple[int | None, str]:
    """(processes the source's run used, where that was read), or (None, why not): torchrun's --nproc_per_node x
    --nnodes, accelerate's --num_processes (or the num_processes of its --config_file when that file is here),
    ms-swift's NPROC_PER_NODE x NNODES."""
    for per_node, nodes, where in (("nproc_per_node", "nnodes", "torchrun"), ("NPROC_PER_NODE", "NNODES", "ms-swift")):
        if per_node in source:
            try:
                return int(source[per_node]) * int(source.get(nodes, 1) or 1), f"{where}'s {per_node} x {nodes}"
            except (TypeError, ValueError):
                return None, f"{per_node}={source[per_node]!r} is not a number"
    if "num_processes" in source:
        return int(source["num_processes"]), "--num_processes"
    accelerate = source.get("config_file")
    if isinstance(accelerate, list):  # `--config_file x.yaml script.py`: the launched script follows accelerate's options
        accelerate = next((a for a in accelerate if isinstance(a, str) and a.endswith((".yaml", ".yml", ".json"))), None)
    if isinstance(accelerate, str):
        path = Path(accelerate)
        if path.is_file():
            found = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("num_processes")
            if isinstance(found, int):
                return found, f"num_processes of {path}"
        return None, f"the accelerate config {accelerate} is not here"
    return None, "the source names no process count"


def scale_batches(result: Conversion, source: dict[str, Any], processes: int | None) -> None:
    """A per-GPU trainer's batches as vlmrl's global ones: gradient accumulation (and steps_per_generation, TRL's
    generation batch in per-device batches) x processes, so each optimizer step and each rollout sees the same number
    of completions as the source's run. TRL's generation_batch_size is global already."""
    where = "--processes"
    if processes is None:
        processes, where = process_count(source)
    if processes is None:
        result.notes.append(f"batch sizes: the source's per-GPU sizes as for 1 process ({where}); give --processes N for the GPUs it ran on")
        return
    if processes < 1:
        raise ConfigError(f"vlmrl convert: --processes must be >= 1, got {processes}")
    if processes > 1:
        for key in ("training.gradient_accumulation_steps", "rollout.steps_per_generation"):
            if key in result.settings or key == "training.gradient_accumulation_steps":
                result.set(key, int(result.settings.get(key, 1)) * processes)
    result.notes.append(f"batch sizes: per-GPU sizes x {processes} processes ({where}) in gradient_accumulation_steps, as vlmrl's are global")


UNRESOLVED = re.compile(r"\$\{?(\w+)")


def drop_unresolved(result: Conversion) -> None:
    """Settings whose value still holds a shell variable the script computes when it runs (``${REPO_HOME}``):
    left out and listed, rather than written as a path with ``$`` in it."""
    for key, value in list(result.settings.items()):
        found = [UNRESOLVED.search(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
        found = [m for m in found if m]
        if found:
            del result.settings[key]
            result.skip(key, f"{value!r} uses ${found[0][1]}, which the script sets when it runs: give {key} yourself")


def convert(peer: str, args: list[str], processes: int | None = None) -> Conversion:
    """The conversion of `args` (a file or --key value arguments) from `peer`'s names; the result is validated as a
    vlmrl config (ConfigError names the key) before it is returned. `processes`: the GPUs the source ran on when it
    does not say (per-GPU batch sizes become vlmrl's global ones)."""

    if peer not in CONVERTERS:
        raise ConfigError(f"vlmrl convert --from {peer}: choose one of {', '.join(PEERS)}")
    source = read_source(args)
    result = CONVERTERS[peer](source)
    drop_unresolved(result)
    if peer in PER_DEVICE_PEERS:
        scale_batches(result, source, processes)
    tree: dict[str, dict[str, Any]] = {}
    for key, value in result.settings.items():
        _merge_key(tree, key, value, f"converted {key}")
    try:
        build_config(tree)  # every converted value must be a valid vlmrl value
    except ConfigError as e:
        unsure = next((n for n in result.notes if n.startswith("batch sizes: the source's per-GPU sizes as for 1")), None)
        if unsure and "generation batch" in str(e):  # per-GPU batches read as one process's: the process count is missing
            why = unsure.split("(", 1)[1].split(")")[0]
            raise ConfigError(f"{e}\n  (the source's batch sizes are per GPU and {why}: give vlmrl convert --processes N)") from None
        raise
    return result


def run_convert(peer: str, args: list[str], out_path: str, log=print, processes: int | None = None) -> int:
    """Write the converted YAML to `out_path` (never over an existing file) and list the keys left out."""
    target = Path(out_path)
    if target.exists():
        raise ConfigError(f"vlmrl convert: {target} exists; give another --output (vlmrl overwrites only what it wrote)")
    result = convert(peer, args, processes)
    header = f"# converted by `vlmrl convert --from {peer}` from {' '.join(args)}\n"
    target.write_text(header + yaml.safe_dump(result.tree(), sort_keys=False), encoding="utf-8")
    log(f"wrote {target}: {len(result.settings)} settings")
    for note in result.notes:
        log(f"  {note}")
    if result.unmapped:
        log(f"{len(result.unmapped)} keys have no vlmrl equivalent:")
        for key, why in result.unmapped.items():
            log(f"  {key}: {why}")
    return 0
