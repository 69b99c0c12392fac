"""`vlmrl convert --from trl|easyr1|ms-swift|vlm-r1 FILE_OR_ARGS`: another trainer's config as a vlmrl YAML.

Reads a YAML config (TRL's flat keys, EasyR1's nested sections), a launch script (the ``--key value`` arguments
of its ``torchrun`` / ``accelerate launch`` / ``swift rlhf`` line, or EasyR1's OmegaConf ``config=x.yaml a.b=c``
line; shell variables set in the script filled in), or those arguments themselves. Every key either becomes a
vlmrl setting or is listed with why it has none (vLLM settings: vlmrl generates in-process; ZeRO / FSDP settings:
the accelerate config to launch with). A loss choice becomes vlmrl's settings of the same math or is refused, and a
source of which nothing can be read is refused: never an empty config.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from typing import Any, Callable

import yaml

from vlmrl.config import ConfigError
from vlmrl.config import TRACKERS, _merge_key, build_config

PEERS = ("trl", "easyr1", "ms-swift", "vlm-r1")
VLLM = "vLLM: the source does not turn vLLM on, so vlmrl generates in-process (rollout.backend=inprocess)"
VLLM_SERVER = "vLLM server mode: vlmrl's rollout.vllm_mode=server is not in this version; the run generates in-process"
VLLM_LORA = "vLLM with LoRA: vlmrl's vLLM backend trains full weights only (yet), so the run generates in-process (the vLLM fields are written)"
VLLM_GPU_ONLY = "vLLM on GPU only"
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
    "scale_rewards": "algorithm.scale_rewards",
    "mask_truncated_completions": "algorithm.mask_truncated_completions",
    "reward_weights": "algorithm.reward_weights",
    "use_bias_correction_kl": "algorithm.use_bias_correction_kl",
    "delta": "algorithm.delta",
    "sapo_temperature_pos": "algorithm.sapo_temperature_pos",
    "sapo_temperature_neg": "algorithm.sapo_temperature_neg",
    "top_entropy_quantile": "algorithm.top_entropy_quantile",
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
    "use_vllm": VLLM,  # false; true is convert_vllm's
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

# The peers' vLLM settings (TRL's GRPOConfig, ms-swift's rlhf arguments) -> vlmrl's rollout fields of the same meaning.
VLLM_KEYS = {
    "vllm_gpu_memory_utilization": "rollout.vllm_gpu_memory_utilization",
    "vllm_tensor_parallel_size": "rollout.vllm_tensor_parallel_size",
    "vllm_max_model_length": "rollout.vllm_max_model_length",  # TRL
    "vllm_max_model_len": "rollout.vllm_max_model_length",  # ms-swift
}
# What each peer runs when the source leaves a vLLM setting out: TRL's GRPOConfig (vllm_mode server, a 0.3 cap) and
# ms-swift's rlhf arguments (colocate unless a server host is given, a 0.9 cap).
VLLM_DEFAULTS = {"trl": {"vllm_mode": "server", "cap": 0.3}, "ms-swift": {"vllm_mode": "colocate", "cap": 0.9}}


def convert_vllm(source: dict[str, Any], out: Conversion, peer: str, lora: bool) -> set[str]:
    """use_vllm true: rollout.backend=vllm colocated, with the source's cap (or its trainer's default), sleep level
    (TRL's vllm_enable_sleep_mode sleeps at level 2, ms-swift's sleep_level as given), tensor-parallel size and
    max model length. Server mode is not converted (listed); with LoRA the fields are written but the backend stays
    in-process (vlmrl's vLLM backend trains full weights only). Returns the keys handled; use_vllm false or unset:
    none (they are listed as the source not using vLLM)."""
    if source.get("use_vllm") is not True:
        sleep = {"sleep_level", "vllm_enable_sleep_mode"} & set(source)
        for key in sleep:
            out.skip(key, VLLM)
        return sleep
    defaults = VLLM_DEFAULTS.get(peer, VLLM_DEFAULTS["trl"])
    mode = source.get("vllm_mode") or ("server" if source.get("vllm_server_host") else defaults["vllm_mode"])
    if mode != "colocate":
        keys = {"use_vllm", *(k for k in source if k.startswith("vllm_"))}
        for key in sorted(keys):
            out.skip(key, VLLM_SERVER + (" (TRL's default vllm_mode is server)" if "vllm_mode" not in source else ""))
        return keys
    handled = {"use_vllm", "vllm_mode", *VLLM_KEYS, "vllm_enable_sleep_mode", "sleep_level"}
    if peer == "trl":
        handled |= _trl_importance_sampling(source, out)
    for key in sorted(k for k in source if k.startswith("vllm_") and k not in handled):  # vllm_enable_lora, vllm_enforce_eager, ...
        out.skip(key, "a vLLM engine setting vlmrl does not expose (vlmrl's engine: docs/vllm.md)")
        handled.add(key)
    if lora:
        out.skip("use_vllm", VLLM_LORA)
    else:
        out.set("rollout.backend", "vllm")
        out.set("rollout.vllm_mode", "colocate")
    for key, target in VLLM_KEYS.items():
        if source.get(key) is not None:
            out.set(target, source[key])
    if "vllm_gpu_memory_utilization" not in source:
        out.fill("rollout.vllm_gpu_memory_utilization", defaults["cap"])
        out.notes.append(f"{peer}'s vLLM cap for what the source leaves unset: rollout.vllm_gpu_memory_utilization={defaults['cap']}")
    level = 2 if source.get("vllm_enable_sleep_mode") is True else source.get("sleep_level")
    if level:
        out.set("rollout.vllm_sleep_level", int(level))
    return handled


# TRL's correction of the vLLM / trainer mismatch when it generates with vLLM: on by default, sequence_mask, ratios
# above 3.0 masked (GRPOConfig's vllm_importance_sampling_*; cap is the earlier name of clip_max).
TRL_IS_DEFAULTS = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask"}
TRL_IS_BOUNDS = {
    "vllm_importance_sampling_cap": "algorithm.rollout_correction_max",
    "vllm_importance_sampling_clip_max": "algorithm.rollout_correction_max",
    "vllm_importance_sampling_clip_min": "algorithm.rollout_correction_min",
}


def _trl_importance_sampling(source: dict[str, Any], out: Conversion) -> set[str]:
    """TRL weights each token's loss by its trainer / vLLM probability ratio when it generates with vLLM (on by
    default): vlmrl's algorithm.rollout_correction of the same mode names and bounds (algo/mismatch.py), TRL's
    defaults written when the source leaves them out; vllm_importance_sampling_correction false is none."""
    keys = {*TRL_IS_DEFAULTS, *TRL_IS_BOUNDS}
    on = source.get("vllm_importance_sampling_correction", True)
    if on is False:
        out.set("algorithm.rollout_correction", "none")
        return keys
    mode = source.get("vllm_importance_sampling_mode")
    (out.set if mode else out.fill)("algorithm.rollout_correction", mode or TRL_IS_DEFAULTS["vllm_importance_sampling_mode"])
    for key, target in TRL_IS_BOUNDS.items():
        if key in source:
            out.set(target, source[key])
    if not {"vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max"} & set(source):
        out.fill("algorithm.rollout_correction_max", 3.0)
    if not mode:
        out.notes.append(
            "TRL corrects the vLLM / trainer mismatch by default: algorithm.rollout_correction=sequence_mask, rollout_correction_max=3.0"
        )
    return keys


def _vllm_gpu_notes(out: Conversion) -> None:
    """Settings that only act on a GPU: stored (the planner counts them), and `vlmrl check` says they are not applied on CPU."""
    defaults = {"rollout.vllm_sleep_level": 0, "rollout.vllm_tensor_parallel_size": 1}
    gpu_only = [f"{k}={out.settings[k]}" for k, default in defaults.items() if out.settings.get(k, default) != default]
    if gpu_only:
        out.notes.append(
            f"{', '.join(gpu_only)}: {VLLM_GPU_ONLY}; stored, counted by `vlmrl plan`, and `vlmrl check` says they are not applied on CPU"
        )


class Conversion:
    """What a conversion produced: the vlmrl settings and the keys left out with why."""

    def __init__(self) -> None:
        self.settings: dict[str, Any] = {}
        self.unmapped: dict[str, str] = {}
        self.notes: list[str] = []  # lines `vlmrl convert` prints besides the unmapped keys (defaults filled, batch scaling)
        self.filled: set[str] = set()  # settings that are the peer's defaults, not read from the source

    def set(self, key: str, value: Any) -> None:
        self.settings[key] = value
        self.filled.discard(key)

    def fill(self, key: str, value: Any) -> None:
        """A setting the source leaves to its trainer's default (that default, written out)."""
        self.settings[key] = value
        self.filled.add(key)

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
    A script's ``VAR=value cmd`` environment prefixes come back as UPPERCASE keys (no option is spelled so). A script
    or arguments in OmegaConf's ``key=value`` form (EasyR1's ``python3 -m verl.trainer.main config=x.yaml a.b=c``)
    come back as the YAML that ``config=`` names with the dotted overrides merged in (easyr1_source)."""
    if not args:
        raise ConfigError("vlmrl convert: give a config file, a launch script or --key value arguments")
    first = Path(args[0])
    if len(args) == 1 and first.suffix in (".yaml", ".yml", ".json") and first.is_file():
        data = yaml.safe_load(first.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ConfigError(f"{first}: expected a mapping of settings")
        return data
    if len(args) == 1 and first.is_file():
        text = first.read_text(encoding="utf-8")
        environment, words = launch_command(text)
        if not words:
            overrides = dotlist_command(text)
            if overrides:
                return easyr1_source(overrides, first)
        return {**{k: _scalar(v) for k, v in environment.items()}, **parse_arguments(words)}
    if not any(a.startswith("--") for a in args) and all(DOTLIST.fullmatch(a) for a in args):
        return easyr1_source(args, None)
    return parse_arguments(args)


def script_arguments(text: str) -> list[str]:
    """The ``--key value`` words of a launch script's command (see launch_command)."""
    return launch_command(text)[1]


def command_lines(text: str) -> list[list[str]]:
    """A shell script's command lines as words: lines joined at a trailing backslash (one newline: an empty line after
    it ends the command, as in bash; a ``# comment`` after the backslash is dropped and the line still joined, as the
    script's author meant it), comments dropped, and ``VAR=value`` lines of the script substituted into ``$VAR`` /
    ``${VAR}``. A line that is only ``VAR=value`` is an assignment, not a command."""
    joined = re.sub(r"\\[ \t]*(?:#[^\n]*)?\n", " ", text)
    variables: dict[str, str] = {}
    commands = []
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
            commands.append(shlex.split(_substitute(line, variables)))
        except ValueError:
            continue
    return commands


def launch_command(text: str) -> tuple[dict[str, str], list[str]]:
    """(environment prefixes, arguments) of a launch script's command: of the command line (command_lines) with the
    most words from its first ``--`` option on, its ``VAR=value`` prefixes and those words."""
    best: tuple[dict[str, str], list[str]] = ({}, [])
    for words in command_lines(text):
        options = [i for i, w in enumerate(words) if w.startswith("--")]
        if options and len(words) - options[0] > len(best[1]):
            prefix = dict(re.fullmatch(r"([A-Za-z_]\w*)=(.*)", w, re.DOTALL).groups() for w in _env_prefix(words))
            best = (prefix, words[options[0] :])
    return best


# OmegaConf's command-line override: a dotted key (lower case: environment prefixes are UPPERCASE), `=`, a value.
DOTLIST = re.compile(r"[a-z_][\w-]*(\.[\w-]+)*=.*", re.DOTALL)


def dotlist_command(text: str) -> list[str]:
    """The ``key=value`` words of a script's command line in OmegaConf's form (EasyR1's ``python3 -m
    verl.trainer.main config=examples/config.yaml data.train_files=...``): of the command line holding the most such
    words after its environment prefixes, those words; [] when no line holds one."""
    best: list[str] = []
    for words in command_lines(text):
        found = [w for w in words[len(_env_prefix(words)) :] if DOTLIST.fullmatch(w)]
        if len(found) > len(best):
            best = found
    return best


def easyr1_source(overrides: list[str], script: Path | None) -> dict[str, Any]:
    """EasyR1's settings from its command line: the YAML named by ``config=`` (relative to the folder the command runs
    in: here, or the script's folder or one of the two above it, as EasyR1's examples/*.sh are run from the checkout's root),
    then each dotted ``key=value`` set in it (values read as YAML, as OmegaConf reads them)."""
    tree: dict[str, Any] = {}
    rest = []
    for word in overrides:
        key, _, value = word.partition("=")
        if key == "config":
            tree = _easyr1_base(value, script)
        else:
            rest.append((key, value))
    for key, value in rest:
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            if not isinstance(node.get(section), dict):
                node[section] = {}
            node = node[section]
        node[name] = _override_value(value)
    return tree


def _override_value(text: str) -> Any:
    """An OmegaConf override's value: YAML, so `'{"n": 16}'` is a mapping and `[a, b]` a list; scalars as _scalar."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (dict, list)) else _scalar(text)


def _easyr1_base(name: str, script: Path | None) -> dict[str, Any]:
    path = Path(name)
    places = [Path.cwd()] + ([script.resolve().parent, *script.resolve().parent.parents][:3] if script else [])
    found = next((p / path for p in places if (p / path).is_file()), None) if not path.is_absolute() else path if path.is_file() else None
    where = f"{script}: " if script else ""
    if found is None:
        looked = ", ".join(str(p) for p in places)
        raise ConfigError(
            f"{where}config={name} is not here (looked in {looked}): run vlmrl convert in the EasyR1 checkout the script "
            "is run from, or give the YAML's path"
        )
    data = yaml.safe_load(found.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ConfigError(f"{found}: expected a mapping of settings (EasyR1's config=)")
    return data


def _substitute(text: str, variables: dict[str, str]) -> str:
    filled = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m[1] or m[2], m[0]), text)
    return _command_substitutions(filled)


# `$(expr 16 / 4)`, as ms-swift's scripts compute gradient_accumulation_steps (#4311): expr's integer arithmetic.
EXPR = re.compile(r"\$\(\s*expr\s+(-?\d+)\s*(\\?\*|[-+/%])\s*(-?\d+)\s*\)")
EXPR_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: int(a / b), "%": lambda a, b: a % b}


def _command_substitutions(text: str) -> str:
    """`$(expr a op b)` of two integers as its value (expr truncates division towards zero); any other `$(...)` as
    one `${command_output}` word, which drop_unresolved then lists (its value exists only when the script runs)."""

    def value(m: re.Match) -> str:
        a, op, b = int(m[1]), m[2].lstrip("\\"), int(m[3])
        return m[0] if op in "/%" and b == 0 else str(EXPR_OPS[op](a, b))

    return re.sub(r"\$\([^()]*\)", "${command_output}", EXPR.sub(value, text))


def _env_prefix(words: list[str]) -> list[str]:
    """The leading ``VAR=value`` words of a command (its environment)."""
    out = []
    for word in words:
        if not re.fullmatch(r"[A-Za-z_]\w*=.*", word, re.DOTALL):
            break
        out.append(word)
    return out


def parse_arguments(words: list[str]) -> dict[str, Any]:
    """``--key value [value ...]`` -> {key: value or list}; a flag without a value is true; values parsed as YAML.
    ``--key=value`` takes that one value: the words after it are not its (torchrun's ``--nnodes=2 train.py``)."""
    out: dict[str, Any] = {}
    key = None
    for word in words:
        if word.startswith("--"):
            key, eq, value = word[2:].partition("=")
            key = key.replace("-", "_")
            out[key] = _scalar(value) if eq else True
            key = None if eq else key
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


# TRL's loss_type -> vlmrl's algorithm settings of the same math (tests/test_convert_oracle.py runs TRL's loss on
# them). dapo's normaliser is the generation batch's token count (token_mean_rollout); sapo averages per sequence.
TRL_LOSS_TYPES: dict[str, dict[str, Any]] = {
    "grpo": {"algorithm.loss_type": "grpo"},
    "bnpo": {"algorithm.loss_type": "bnpo"},
    "dr_grpo": {"algorithm.loss_type": "dr_grpo"},
    "dapo": {"algorithm.loss_aggregation": "token_mean_rollout"},
    "cispo": {"algorithm.policy_loss": "cispo", "algorithm.loss_aggregation": "token_mean_rollout"},
    "sapo": {"algorithm.policy_loss": "sapo", "algorithm.loss_type": "grpo"},
}
TRL_ALGORITHM_KEYS = {"loss_type", "importance_sampling_level", "epsilon", "epsilon_high", "tau_pos", "tau_neg"}


def convert_trl_algorithm(source: dict[str, Any], out: Conversion, levels: tuple[str, ...] = ("token", "sequence")) -> set[str]:
    """TRL's (and ms-swift's) loss choice as vlmrl's: loss_type, importance_sampling_level (sequence = GSPO), the
    clip ranges (cispo: TRL's epsilon_high is the weight's cap itself, vlmrl's cap is 1 + epsilon_high), ms-swift's
    SAPO temperatures. A loss vlmrl does not have is refused rather than replaced. Returns the keys handled."""
    loss_type = source.get("loss_type")
    if isinstance(loss_type, list) and len(loss_type) == 1:  # ms-swift's --loss_type takes a list
        loss_type = loss_type[0]
    if loss_type is not None and loss_type not in TRL_LOSS_TYPES:
        raise ConfigError(
            f"--loss_type {loss_type}: vlmrl has no such loss (its TRL loss types: {', '.join(TRL_LOSS_TYPES)}); "
            "converting without it would train another algorithm"
        )
    for key, value in TRL_LOSS_TYPES.get(loss_type, {}).items():
        out.set(key, value)
    level = source.get("importance_sampling_level", "token")
    if level not in levels:
        raise ConfigError(f"--importance_sampling_level {level}: choose {' or '.join(levels)} (sequence is vlmrl's algorithm.policy_loss=gspo)")
    if level != "token":  # vlmrl's gspo is GSPO-token, whose gradient is GSPO's with one advantage a sequence
        if loss_type in ("cispo", "sapo"):
            raise ConfigError(f"--importance_sampling_level {level} with --loss_type {loss_type}: vlmrl's {loss_type} is per token")
        out.set("algorithm.policy_loss", "gspo")
    for key in ("epsilon", "epsilon_high"):
        if source.get(key) is not None:
            out.set(f"algorithm.{key}", source[key])
    if loss_type == "cispo":
        _cispo_cap(source, out)
    for key, target in (("tau_pos", "sapo_temperature_pos"), ("tau_neg", "sapo_temperature_neg")):
        if key in source:
            out.set(f"algorithm.{target}", source[key])
    return TRL_ALGORITHM_KEYS


def _cispo_cap(source: dict[str, Any], out: Conversion) -> None:
    """TRL clamps CISPO's weight at epsilon_high itself (epsilon when unset; epsilon is otherwise unused), vlmrl at
    1 + epsilon_high: the same cap is vlmrl's epsilon_high = TRL's - 1."""
    cap = float(source["epsilon_high"] if source.get("epsilon_high") is not None else source.get("epsilon", 0.2))
    if cap < 1.0:
        raise ConfigError(
            f"--loss_type cispo caps the importance weight at {cap} (TRL: epsilon_high, else epsilon); vlmrl's "
            "cispo cap is 1 + epsilon_high >= 1: give --epsilon_high (TRL recommends 5.0)"
        )
    out.set("algorithm.epsilon_high", cap - 1.0)
    if cap - 1.0 < float(source.get("epsilon", 0.2)):  # vlmrl asks epsilon <= epsilon_high; cispo reads neither bound's epsilon
        out.set("algorithm.epsilon", cap - 1.0)
    out.notes.append(f"cispo: TRL's weight cap {cap} is vlmrl's 1 + algorithm.epsilon_high ({cap - 1.0:g})")


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
    handled = convert_environment(source, out) | convert_trl_algorithm(source, out)
    handled |= convert_vllm(source, out, "trl", lora=source.get("use_peft") is True)
    convert_trl_keys(source, out, {"reward_funcs", *handled})
    _vllm_gpu_notes(out)
    filled = [f"{k}={v}" for k, v in TRL_DEFAULTS.items() if k not in out.settings]
    for key, value in TRL_DEFAULTS.items():
        if key not in out.settings:
            out.fill(key, value)
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
    paths = [p for p in str(source.get("data_file_paths") or "").split(":") if p]
    folders = [f for f in str(source.get("image_folders") or "").split(":") if f]
    if paths:
        out.set("data.train_path", paths if len(paths) > 1 else paths[0])
    # VLM-R1 joins each data file's image paths with the folder at the same position (grpo_jsonl.py): a list in the
    # same order keeps that pairing; one folder for all files stays one folder.
    if folders and (len(folders) == len(paths) or len(set(folders)) == 1):
        out.set("data.image_root", folders if len(set(folders)) > 1 else folders[0])
    elif folders:
        out.skip(
            "image_folders",
            f"{len(folders)} folders for {len(paths)} data files (VLM-R1 refuses this too): give one per data file in data.image_root",
        )
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
    handled |= convert_environment(source, out) | convert_trl_algorithm(source, out)
    handled |= convert_vllm(source, out, "trl", lora=source.get("use_peft") is True)
    convert_trl_keys(source, out, handled | {"val_split_ratio", "max_anyres_num", "arrow_cache_dir"})
    _vllm_gpu_notes(out)
    return out


SWIFT_REASONS = {
    "rlhf_type": "vlmrl train is GRPO (and its variants: algorithm.*)",
    "external_plugins": "the plugin file is named in each algorithm.reward_funcs entry",
    "max_length": "prompts: data.max_prompt_length; completions: rollout.max_completion_length",
    "async_generate": VLLM,
    "load_from_cache_file": "rows are read directly",
    "target_modules": "model.lora_target_modules (module names; all-linear is not a name)",
    "offload_model": "moves the trained model to host RAM while vLLM generates: vlmrl keeps it on the device (no such offload); "
    "`vlmrl plan` counts it there",
    "use_bias_correction_kl": "ms-swift's GRPO loss does not read it: its KL is low_var_kl (algorithm.kl_estimator)",
}
SWIFT_HANDLED = {"external_plugins", "reward_funcs", "model", "dataset", "val_dataset", "system", "train_type", "tuner_type"}
SWIFT_HANDLED |= {"freeze_vit", "overlong_filter", "advantage_estimator", "kl_in_reward", "lora_rank", "vllm_limit_mm_per_prompt", *SWIFT_REASONS}
SWIFT_HANDLED |= {"dynamic_sample", "max_resample_times", "soft_max_length", "soft_cache_length"}
# ms-swift's defaults (RLHFArguments, TunerArguments, its GRPO init) that differ from vlmrl's: a `swift rlhf` line that
# leaves them out ran with these. gradient_accumulation_steps: ceil(16 / per-device batch / GPUs) (swift_batch_defaults).
# Its KL term is k3 clamped as verl's low_var_kl, never times the importance ratio.
SWIFT_DEFAULTS = {"training.per_device_train_batch_size": 1, "rollout.num_generations": 8, "algorithm.beta": 0.04}
SWIFT_DEFAULTS |= {"algorithm.kl_estimator": "low_var_kl"}
SWIFT_LORA_DEFAULTS = {"model.lora_r": 8, "model.lora_alpha": 32, "model.lora_dropout": 0.05}


def from_ms_swift(source: dict[str, Any]) -> Conversion:
    out = Conversion()
    _swift_rewards(source, out)
    if "model" in source:
        out.set("model.name_or_path", source["model"])
    _swift_data(source, out)
    for key in ("train_type", "tuner_type"):  # ms-swift 4 renamed train_type to tuner_type
        if key in source:
            out.set("model.use_lora", source[key] == "lora")
    _swift_estimator(source)
    if "overlong_filter" in source:
        out.set("algorithm.mask_truncated_completions", bool(source["overlong_filter"]))
    if "dynamic_sample" in source:
        out.set("algorithm.dynamic_sampling", bool(source["dynamic_sample"]))
    if "max_resample_times" in source:  # ms-swift scores this many batches per step at most, as vlmrl's count
        out.set("algorithm.dynamic_sampling_max_batches", source["max_resample_times"])
    if "freeze_vit" in source:
        out.set("model.freeze_vision_tower", bool(source["freeze_vit"]))
    if "lora_rank" in source:
        out.set("model.lora_r", source["lora_rank"])
    _swift_image_limit(source, out)
    for key, why in SWIFT_REASONS.items():
        if key in source:
            out.skip(key, why)
    if "offload_optimizer" in source:  # the optimizer states wait in host RAM while vLLM generates (and scores, in vlmrl)
        out.set("memory.offload_optimizer_during_rollout", bool(source["offload_optimizer"]))
    levels = ("token", "sequence", "sequence_token")
    handled = SWIFT_HANDLED | convert_environment(source, out) | convert_trl_algorithm(source, out, levels)
    handled |= convert_vllm(source, out, "ms-swift", lora=bool(out.settings.get("model.use_lora")))
    convert_trl_keys(source, out, handled | {"offload_optimizer"})
    _vllm_gpu_notes(out)
    defaults = {**SWIFT_DEFAULTS, **(SWIFT_LORA_DEFAULTS if out.settings.get("model.use_lora") else {})}
    filled = [f"{k}={v}" for k, v in defaults.items() if k not in out.settings]
    for key, value in defaults.items():
        if key not in out.settings:
            out.fill(key, value)
    if filled:
        out.notes.append(f"ms-swift's defaults for what the source leaves unset: {', '.join(filled)}")
    return out


def _swift_estimator(source: dict[str, Any]) -> None:
    """ms-swift's rloo / reinforce_plus_plus (swift/rl_core/advantage.py) centre each group and, by default, put the KL
    in the reward (kl_in_reward); vlmrl's reinforce_pp centres on the batch and its KL is a loss term: refused rather
    than trained as another algorithm. grpo's scale_rewards maps as TRL's."""
    estimator = source.get("advantage_estimator", "grpo")
    if estimator != "grpo":
        raise ConfigError(
            f"--advantage_estimator {estimator}: ms-swift's centres each group's rewards and puts the KL in the reward; vlmrl's "
            "estimators (grpo, grpo_batch_std, dr_grpo, reinforce_pp: batch-centred) differ, so converting would train another algorithm"
        )
    if source.get("kl_in_reward") is True:
        raise ConfigError("--kl_in_reward true: vlmrl's KL is a loss term (algorithm.beta), never subtracted from the reward")


def _swift_image_limit(source: dict[str, Any], out: Conversion) -> None:
    """--vllm_limit_mm_per_prompt '{"image": N}': vLLM refuses prompts with more than N images; vlmrl keeps the
    first data.limit_images images of a row."""
    limit = source.get("vllm_limit_mm_per_prompt")
    if limit is None:
        return
    try:
        limits = limit if isinstance(limit, dict) else json.loads(str(limit))
    except json.JSONDecodeError:
        limits = None
    if isinstance(limits, dict) and isinstance(limits.get("image"), int) and limits["image"] >= 1:
        out.set("data.limit_images", limits["image"])
        if set(limits) - {"image"}:
            out.skip("vllm_limit_mm_per_prompt (video)", "vlmrl's videos are not counted against an image limit")
    else:
        out.skip("vllm_limit_mm_per_prompt", f"{limit!r}: expected a JSON object such as '{{\"image\": 2}}'")


def swift_batch_defaults(result: Conversion, source: dict[str, Any], processes: int | None) -> None:
    """ms-swift's gradient_accumulation_steps when the source gives none: ceil(16 / per-device batch / GPUs), as its
    TrainArguments computes it (the GPUs from --processes or NPROC_PER_NODE x NNODES; 1 when neither says)."""
    if "gradient_accumulation_steps" in source:
        return
    world = processes if processes is not None else process_count(source)[0]
    per_device = int(result.settings.get("training.per_device_train_batch_size", 1))
    result.fill("training.gradient_accumulation_steps", max(1, math.ceil(16 / per_device / (world or 1))))
    result.notes.append(
        f"ms-swift's gradient_accumulation_steps for what the source leaves unset: ceil(16 / {per_device} / {world or 1} GPUs) = "
        f"{result.settings['training.gradient_accumulation_steps']} per GPU"
    )


def _swift_rewards(source: dict[str, Any], out: Conversion) -> None:
    """--reward_funcs: plugin names as plugin.py:name; accuracy / format stay vlmrl's built-ins (and say so)."""
    plugins = source.get("external_plugins")
    plugin = (plugins[0] if isinstance(plugins, list) else plugins) if plugins else None
    funcs = source.get("reward_funcs")
    if funcs is None:
        return
    names = funcs if isinstance(funcs, list) else [funcs]
    out.set("algorithm.reward_funcs", [_swift_reward_spec(n, plugin, source) for n in names])
    builtins = [n for n in names if n in ("accuracy", "format")]
    if builtins:
        out.skip(f"reward_funcs ({', '.join(builtins)})", "kept as vlmrl's built-ins of those names (`vlmrl check` says what they compare)")


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
    _easyr1_loss(source, out)
    _easyr1_vllm(source, out)
    _vllm_gpu_notes(out)
    return out


# EasyR1's actor defaults (verl/workers/actor/config.py) that shape the loss and differ from vlmrl's, as vlmrl keys.
EASYR1_LOSS_DEFAULTS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_dual": 3.0, "loss_type": "default", "loss_avg_mode": "token"}
EASYR1_KL = {"low_var_kl": "low_var_kl", "kl": "k1", "mse": "k2"}


def _easyr1_loss(source: dict[str, Any], out: Conversion) -> None:
    """EasyR1's policy loss and KL term as vlmrl's (core_algos.compute_policy_loss / compute_kl): clip ranges, its
    dual clip (vlmrl's delta: the unclipped ratio capped, which bounds only negative advantages' loss), loss_type,
    the token mean over each optimizer step's tokens, the KL estimator. Its defaults are written for what the source
    leaves unset; a loss vlmrl cannot express is refused."""
    actor = ((source.get("worker") or {}).get("actor")) or {}
    algorithm = source.get("algorithm") or {}
    given = {k: actor[k] for k in EASYR1_LOSS_DEFAULTS if k in actor}
    a = {**EASYR1_LOSS_DEFAULTS, **given}

    def setting(key: str, value: Any, name: str) -> None:
        (out.set if name in given else out.fill)(key, value)

    loss = {"default": "ppo_clip", "gspo": "gspo", "gspo_token": "gspo", "sapo": "sapo"}.get(a["loss_type"])
    if loss is None:
        why = (
            "its weight is clamped to [1 - clip_ratio_low, 1 + clip_ratio_high]; vlmrl's cispo has only the upper cap"
            if a["loss_type"] == "cispo"
            else "vlmrl has no such loss"
        )
        raise ConfigError(f"worker.actor.loss_type={a['loss_type']}: {why}; converting without it would train another algorithm")
    if loss != "ppo_clip":
        setting("algorithm.policy_loss", loss, "loss_type")
    if loss != "sapo":  # EasyR1's sapo gate has no clip range
        setting("algorithm.epsilon", a["clip_ratio_low"], "clip_ratio_low")
        setting("algorithm.epsilon_high", a["clip_ratio_high"], "clip_ratio_high")
    if loss == "ppo_clip":
        setting("algorithm.delta", a["clip_ratio_dual"], "clip_ratio_dual")
    for key, target in (("tau_positive", "sapo_temperature_pos"), ("tau_negative", "sapo_temperature_neg"), ("ppo_epochs", "num_iterations")):
        if key in actor:
            out.set(f"algorithm.{target}", actor[key])
    setting("algorithm.loss_aggregation", "token_mean", "loss_avg_mode")  # each micro-batch x its share of the step's tokens
    micro = int(actor.get("micro_batch_size_per_device_for_update") or 1)
    if a["loss_avg_mode"] == "seq" and micro > 1:
        out.skip(
            "worker.actor.loss_avg_mode",
            "seq: EasyR1 weights each micro-batch's sequence mean by its token share; token_mean written (the same at micro-batch 1)",
        )
    (out.set if "kl_penalty" in algorithm else out.fill)(
        "algorithm.kl_estimator", EASYR1_KL.get(algorithm.get("kl_penalty", "low_var_kl"), "low_var_kl")
    )
    if algorithm.get("kl_penalty") not in (None, *EASYR1_KL):
        out.skip("algorithm.kl_penalty", f"{algorithm['kl_penalty']}: vlmrl's estimators are {', '.join(EASYR1_KL)} (low_var_kl written)")
    if algorithm.get("use_kl_loss") is False and not algorithm.get("disable_kl") and algorithm.get("kl_coef", 1e-2):
        raise ConfigError("algorithm.use_kl_loss=false: EasyR1 subtracts the KL from the reward; vlmrl's KL is a loss term only (algorithm.beta)")


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
    if dotted == "worker.rollout.enforce_eager":
        return "vlmrl runs vLLM eagerly (no CUDA graphs)"
    if dotted.startswith("worker.rollout.val_override_config."):
        return "evaluation samples greedily with the in-process engine (vlmrl eval, training.eval_steps)"
    if dotted.startswith("worker.rollout."):
        return "a setting of EasyR1's vLLM workers vlmrl does not expose"
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
    """EasyR1's grpo is vlmrl's; its reinforce_plus_plus whitens returns over the batch's tokens (a token-weighted
    baseline, the KL in the reward), rloo / remax have no vlmrl estimator: refused rather than replaced."""
    if value != "grpo":
        raise ConfigError(
            f"algorithm.adv_estimator={value}: EasyR1's is not one of vlmrl's estimators (grpo, grpo_batch_std, dr_grpo, "
            "reinforce_pp: sequence-weighted batch baseline); converting would train another algorithm"
        )


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


EASYR1_VLLM_CAP = 0.6  # worker.rollout.gpu_memory_utilization in EasyR1's examples/config.yaml


def _easyr1_vllm(source: dict, out: Conversion) -> None:
    """EasyR1 always rolls out with vLLM colocated on the actor's GPUs (its hybrid engine), asleep at level 1 while the
    actor trains (FSDPVLLMShardingManager.offload_vllm): rollout.backend=vllm with sleep level 1 and its cap; with LoRA
    the fields are written and the run generates in-process (vlmrl's vLLM backend trains full weights only)."""
    worker = source.get("worker") or {}
    lora = ((worker.get("actor") or {}).get("model") or {}).get("lora") or {}
    if lora.get("rank"):
        out.skip("worker.rollout", VLLM_LORA)
    else:
        out.fill("rollout.backend", "vllm")
        out.fill("rollout.vllm_mode", "colocate")
    out.fill("rollout.vllm_sleep_level", 1)
    cap = (worker.get("rollout") or {}).get("gpu_memory_utilization")
    (out.set if cap is not None else out.fill)("rollout.vllm_gpu_memory_utilization", cap if cap is not None else EASYR1_VLLM_CAP)


def _chunked_prefill(value, out: Conversion, _source) -> None:
    if value:
        out.skip(
            "worker.rollout.enable_chunked_prefill",
            "true: vlmrl prefills whole prompts (a chunked prefill rewinds a seeded request's generator, which fails on CPU)",
        )


def _limit_images(value, out: Conversion, _source) -> None:
    if value:
        out.set("data.limit_images", value)
    else:
        out.skip("worker.rollout.limit_images", "0 (EasyR1: no limit): vlmrl keeps data.limit_images images a row (default 4)")


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
    "algorithm.use_kl_loss": _ignore,  # read by _easyr1_loss
    "algorithm.kl_penalty": _ignore,  # read by _easyr1_loss
    **{f"worker.actor.{k}": _ignore for k in (*EASYR1_LOSS_DEFAULTS, "tau_positive", "tau_negative", "ppo_epochs")},
    "worker.rollout.limit_images": _limit_images,
    "worker.rollout.gpu_memory_utilization": _ignore,  # read by _easyr1_vllm
    "worker.rollout.tensor_parallel_size": "rollout.vllm_tensor_parallel_size",
    "worker.rollout.max_model_len": "rollout.vllm_max_model_length",
    "worker.rollout.enable_chunked_prefill": _chunked_prefill,
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
            except (TypeError, ValueError):  # name the one that is not (DLC scripts: --nnodes=${WORLD_SIZE}, set when it runs)
                bad = per_node if not str(source[per_node]).isdigit() else nodes
                return None, f"{bad}={source[bad]!r} is not a number"
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
PLACEHOLDER = re.compile(r"<[^<>]+>")  # R1-V's `--output_dir <OUTPUT_DIR>`: for the user to fill in


def refuse_empty(peer: str, args: list[str], source: dict[str, Any], result: Conversion) -> None:
    """Never an empty config with exit 0: a source of which no setting was read (only the peer's defaults are left)
    is refused in one line saying what was read."""
    if any(key not in result.filled for key in result.settings):
        return
    what = args[0] if len(args) == 1 else " ".join(args)
    if not source:
        found = "no --key value arguments, no key=value (OmegaConf) arguments and no settings"
    else:
        keys = [str(k) for k in source]
        found = f"{len(keys)} keys ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}) but no value vlmrl can write"
    nested = any(isinstance(v, dict) for v in source.values())
    other = ""
    if peer != "easyr1" and nested:
        other = " (nested sections: EasyR1's layout? --from easyr1)"
    elif peer == "easyr1" and source and not nested:
        other = " (flat --key value arguments: --from trl, ms-swift or vlm-r1?)"
    raise ConfigError(f"--from {peer} {what}: found {found}{other}; nothing written")


def _comment_after_continuation(args: list[str]) -> list[str]:
    """R1-V's run_grpo_clevr.sh has `--dataset_name X \\  #https://...`: bash ends the command at that comment, so the
    options after it never reached the trainer. command_lines reads the command on, as its author meant; say so."""
    if len(args) != 1 or not Path(args[0]).is_file() or Path(args[0]).suffix in (".yaml", ".yml", ".json"):
        return []
    lines = Path(args[0]).read_text(encoding="utf-8").splitlines()
    found = [i + 1 for i, line in enumerate(lines) if not line.lstrip().startswith("#") and re.search(r"\\[ \t]*#[^\n]*$", line)]
    return [
        f"line {n}: a # comment after a continuation backslash ends the command in bash (the options after it were not "
        "passed); read as one command, as written"
        for n in found
    ]


BATCH_KEYS = ("training.gradient_accumulation_steps", "training.per_device_train_batch_size", "rollout.num_generations")


def drop_unresolved(result: Conversion) -> None:
    """Settings whose value still holds a shell variable the script computes when it runs (``${REPO_HOME}``):
    left out and listed, rather than written as a path with ``$`` in it."""
    for key, value in list(result.settings.items()):
        texts = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
        found = [m for m in map(UNRESOLVED.search, texts) if m]
        if key in BATCH_KEYS and (found or isinstance(value, bool) or not isinstance(value, int)):
            # left out, the batch would be scaled and planned from a wrong size
            why = f"uses ${found[0][1]}, which the script computes when it runs" if found else "is not a whole number (a command the script runs?)"
            raise ConfigError(f"{key} = {value!r} {why}: give its value in the arguments")
        if found:
            del result.settings[key]
            result.skip(key, f"{value!r} uses ${found[0][1]}, which the script sets when it runs: give {key} yourself")
        elif any(PLACEHOLDER.fullmatch(t) for t in texts):
            del result.settings[key]
            result.skip(key, f"{value!r} is a placeholder of the script: give {key} yourself")


def convert(peer: str, args: list[str], processes: int | None = None) -> Conversion:
    """The conversion of `args` (a file or --key value arguments) from `peer`'s names; the result is validated as a
    vlmrl config (ConfigError names the key) before it is returned. `processes`: the GPUs the source ran on when it
    does not say (per-GPU batch sizes become vlmrl's global ones)."""

    if peer not in CONVERTERS:
        raise ConfigError(f"vlmrl convert --from {peer}: choose one of {', '.join(PEERS)}")
    source = read_source(args)
    result = CONVERTERS[peer](source)
    drop_unresolved(result)
    refuse_empty(peer, args, source, result)
    result.notes += _comment_after_continuation(args)
    if peer == "ms-swift":
        swift_batch_defaults(result, source, processes)
    if peer in PER_DEVICE_PEERS:
        scale_batches(result, source, processes)
    if result.settings.get("rollout.backend") == "vllm" and (processes or process_count(source)[0] or 1) > 1:
        result.notes.append("rollout.backend=vllm runs in one training process in this version: launched on several, it is refused")
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
