"""EasyR1's nested config (its YAML and OmegaConf overrides) as a vlmrl config: each dotted key's setting or reason,
its loss and KL defaults, and its vLLM settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


from vlmrl.config import ConfigError
from vlmrl.run.convert.common import Conversion, LAUNCH, TRACKER_NAME, ZERO
from vlmrl.run.convert.vllm import vllm_gpu_notes


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
    vllm_gpu_notes(out)
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

    loss = _easyr1_policy_loss(a["loss_type"])
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
    _easyr1_kl(algorithm, out)


def _easyr1_policy_loss(loss_type: str) -> str:
    """vlmrl's algorithm.policy_loss for EasyR1's worker.actor.loss_type; ConfigError for one vlmrl cannot express."""
    loss = {"default": "ppo_clip", "gspo": "gspo", "gspo_token": "gspo", "sapo": "sapo"}.get(loss_type)
    if loss is None:
        why = (
            "its weight is clamped to [1 - clip_ratio_low, 1 + clip_ratio_high]; vlmrl's cispo has only the upper cap"
            if loss_type == "cispo"
            else "vlmrl has no such loss"
        )
        raise ConfigError(f"worker.actor.loss_type={loss_type}: {why}; converting without it would train another algorithm")
    return loss


def _easyr1_kl(algorithm: dict, out: Conversion) -> None:
    """EasyR1's KL estimator (compute_kl) as algorithm.kl_estimator; a KL in the reward is refused (vlmrl's is a loss)."""
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
        return "evaluation samples greedily with the in-process decoder (vlmrl eval, training.eval_steps)"
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
    actor trains (FSDPVLLMShardingManager.offload_vllm): rollout.backend=vllm with sleep level 1 and its cap (with
    LoRA too: the sync pushes the merged weights)."""
    worker = source.get("worker") or {}
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
