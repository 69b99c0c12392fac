"""ms-swift's ``swift rlhf`` arguments as a vlmrl config: its defaults, LoRA, reward plugins, datasets and batch sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


from vlmrl.config import ConfigError
from vlmrl.run.convert.common import Conversion, VLLM, convert_environment, process_count
from vlmrl.run.convert.trl import convert_trl_algorithm, convert_trl_keys
from vlmrl.run.convert.vllm import vllm_gpu_notes, convert_vllm


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
SWIFT_LORA_DEFAULTS = {"model.use_lora": True, "model.lora_r": 8, "model.lora_alpha": 32, "model.lora_dropout": 0.05}


def from_ms_swift(source: dict[str, Any]) -> Conversion:
    out = Conversion()
    _swift_rewards(source, out)
    if "model" in source:
        out.set("model.name_or_path", source["model"])
    _swift_data(source, out)
    _swift_tuner(source, out)
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
    handled |= convert_vllm(source, out, "ms-swift")
    convert_trl_keys(source, out, handled | {"offload_optimizer"})
    vllm_gpu_notes(out)
    defaults = {**SWIFT_DEFAULTS, **(SWIFT_LORA_DEFAULTS if out.settings.get("model.use_lora") else {})}
    filled = [f"{k}={v}" for k, v in defaults.items() if k not in out.settings or k in out.filled]
    for key, value in defaults.items():
        if key not in out.settings:
            out.fill(key, value)
    if filled:
        out.notes.append(f"ms-swift's defaults for what the source leaves unset: {', '.join(filled)}")
    return out


def _swift_tuner(source: dict[str, Any], out: Conversion) -> None:
    """--train_type (ms-swift 4: --tuner_type) lora or full; a line that names neither trains LoRA, ms-swift's
    TunerArguments default, so it converts to LoRA too (with ms-swift's rank, alpha and dropout, filled below)."""
    given = [source[key] for key in ("train_type", "tuner_type") if key in source]
    if given:
        out.set("model.use_lora", given[-1] == "lora")
    else:
        out.fill("model.use_lora", True)


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
