"""The DeepSpeed config a run uses (accelerate's `deepspeed_config` section, or the user's JSON it points to with
`deepspeed_config_file`), checked against vlmrl's config and described in one log line. Pure functions over the
config dict; nothing here imports deepspeed.

vlmrl takes the user's JSON as it is (bf16, offload_optimizer / offload_param, bucket sizes, ...) and fills only what
it owns: the micro-batch size (bookkeeping: there is no dataloader for accelerate to read it from), the gradient
clipping (= optim.max_grad_norm) and the accumulation (vlmrl marks each optimizer step's boundary itself, so
DeepSpeed's own `gradient_accumulation_steps` must stay 1: it would divide the loss a second time).
"""

from __future__ import annotations

from vlmrl.engine.collectives import DistributedError


def _is_auto(value) -> bool:
    return value is None or value == "auto"


def check_config(ds: dict, max_grad_norm: float) -> None:
    """DistributedError (exit 2, one line) for a DeepSpeed setting that contradicts the vlmrl config, or that vlmrl
    does not support (fp16); fills the gradient clipping from optim.max_grad_norm where the DeepSpeed config leaves it
    unset or "auto"."""
    ga = ds.get("gradient_accumulation_steps")
    if not _is_auto(ga) and int(ga) != 1:
        raise DistributedError(
            f"the DeepSpeed config sets gradient_accumulation_steps={ga}; vlmrl accumulates training.gradient_accumulation_steps "
            'micro-batches itself and DeepSpeed would divide the loss again: set it to 1 or "auto" in the DeepSpeed config'
        )
    if (ds.get("fp16") or {}).get("enabled") is True:
        raise DistributedError(
            'the DeepSpeed config sets "fp16": {"enabled": true}; vlmrl does not follow DeepSpeed\'s loss-scaled fp16 steps (an '
            "overflow skips a step while vlmrl's schedule and logs go on) and DeepSpeed's CPU accelerator has no fp16 at all: "
            'use "bf16": {"enabled": true} (or fp32) in the DeepSpeed config'
        )
    clip = ds.get("gradient_clipping")
    if _is_auto(clip):
        ds["gradient_clipping"] = float(max_grad_norm)
    elif float(clip) != float(max_grad_norm):
        raise DistributedError(
            f"the DeepSpeed config sets gradient_clipping={clip} but optim.max_grad_norm={max_grad_norm}: DeepSpeed clips inside its "
            'own step, so make them equal (or set gradient_clipping to "auto" in the DeepSpeed config)'
        )


def fill_config(ds: dict, micro_batch_size: int, hidden_size: int | None) -> None:
    """What accelerate fills from a dataloader or from `model.config` (vlmrl hands it a root module without one): the
    micro-batch size, the accumulation (1), and "auto" bucket sizes from the text model's hidden size (accelerate's
    rule: hidden^2 per bucket, 0.9 hidden^2 prefetch, 10 hidden persistence threshold)."""
    if _is_auto(ds.get("train_micro_batch_size_per_gpu")):
        ds["train_micro_batch_size_per_gpu"] = micro_batch_size
    if _is_auto(ds.get("gradient_accumulation_steps")):
        ds["gradient_accumulation_steps"] = 1
    zero = ds.get("zero_optimization") or {}
    if hidden_size:
        rules = {
            "reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        }
        for key, value in rules.items():
            if zero.get(key) == "auto":
                zero[key] = value


def _device(section) -> str:
    return str((section or {}).get("device", "none")) if isinstance(section, dict) else "none"


def precision(ds: dict) -> str:
    """The dtype DeepSpeed keeps the model's weights in: bf16, fp16 or fp32 (masters are fp32 in every case)."""
    if (ds.get("bf16") or {}).get("enabled") is True:
        return "bf16"
    return "fp16" if (ds.get("fp16") or {}).get("enabled") is True else "fp32"


def describe(ds: dict) -> str:
    """One line naming the ZeRO stage and the settings that change memory: precision, offload, bucket sizes."""
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    parts = [
        f"DeepSpeed ZeRO-{stage}",
        f"{precision(ds)} weights",
        f"offload_optimizer {_device(zero.get('offload_optimizer'))}",
        f"offload_param {_device(zero.get('offload_param'))}",
        f"gradient_clipping {ds.get('gradient_clipping', 'unset')}",
    ]
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters"):
        if key in zero:
            parts.append(f"{key} {zero[key]}")
    return parts[0] + " (" + ", ".join(parts[1:]) + ")"
