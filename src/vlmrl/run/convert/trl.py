"""TRL's GRPOConfig / ModelConfig keys (VLM-R1 and ms-swift take them too) as vlmrl settings, its loss types as vlmrl's
algorithm settings of the same math, and the defaults a TRL command ran with.
"""

from __future__ import annotations

from typing import Any


from vlmrl.config import ConfigError
from vlmrl.config import TRACKERS
from vlmrl.run.convert.common import Conversion, LAUNCH, NO_HUB, TRACKER_NAME, VLLM, ZERO, convert_environment
from vlmrl.run.convert.vllm import vllm_gpu_notes, convert_vllm


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
    handled |= convert_vllm(source, out, "trl")
    convert_trl_keys(source, out, {"reward_funcs", *handled})
    vllm_gpu_notes(out)
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
