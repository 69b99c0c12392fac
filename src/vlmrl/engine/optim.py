"""AdamW, the learning-rate schedule and the optimizer step, shared by GRPO and SFT.

The schedule is a torch LambdaLR with the usual warmup shapes written out here: importing
transformers' get_scheduler pulls the Trainer utilities (peft and ~1,370 modules, ~100 MiB of RSS)
into the training process for three formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from vlmrl.config import Config, ConfigError


class WarmupSchedule:
    """LR multiplier per optimizer step: linear warmup to 1, then constant, linear decay to 0, or a half cosine to 0.
    A callable object (not a closure) so LambdaLR's state_dict records its settings."""

    def __init__(self, kind: str, num_warmup_steps: int, num_training_steps: int):
        if kind not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr_scheduler_type {kind!r}; use constant, linear or cosine")
        self.kind, self.num_warmup_steps, self.num_training_steps = kind, num_warmup_steps, num_training_steps

    def __call__(self, step: int) -> float:
        warmup, total = self.num_warmup_steps, self.num_training_steps
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if self.kind == "constant":
            return 1.0
        if self.kind == "linear":
            return max(0.0, float(total - step) / float(max(1, total - warmup)))
        progress = float(step - warmup) / float(max(1, total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model, cfg: Config, num_steps: int, learning_rate: float | None = None):
    """AdamW over the trainable parameters and its schedule over `num_steps` optimizer steps."""
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("no trainable parameters: check model.freeze_vision_tower / train_projector_only / use_lora")
    optimizer = torch.optim.AdamW(
        params,
        lr=o.learning_rate if learning_rate is None else learning_rate,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_epsilon,
        weight_decay=o.weight_decay,
        fused=fused_adamw_applies(params) or None,
    )
    schedule = WarmupSchedule(o.lr_scheduler_type, math.ceil(o.warmup_ratio * num_steps), num_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def fused_adamw_applies(params: list) -> bool:
    """torch's fused AdamW (one kernel per parameter: no temporaries) for plain float32 / bfloat16 / float16 tensors on
    the CPU. The CPU default is the per-parameter loop, whose sqrt and division make two temporaries the size of the
    largest parameter at every step: for a 151,936 x 128 LM head, 150 MiB of a step's peak (the planner counts no
    step temporary on the CPU). On CUDA torch's default (foreach, whose temporary the planner counts) is kept, and
    sharded parameters (DTensor) keep the default everywhere."""
    return all(
        p.device.type == "cpu" and type(p.data) is torch.Tensor and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params
    ) and bool(params)


def allocate_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Create AdamW's moment buffers now, as its first step would (same dtypes, devices, zeros), for every parameter
    that has none yet. An out-of-memory then happens here, before training, not half-way through optimizer.step
    where it cannot be undone. Returns the bytes allocated."""
    for group in getattr(optimizer, "optimizer", optimizer).param_groups:  # accelerate's wrapper holds torch's AdamW
        # An engine may have pointed the groups at other parameters since make_optimizer (FSDP2: DTensors): the fused
        # kernel only where it still applies, torch's default elsewhere.
        if group.get("fused") and group["params"] and not fused_adamw_applies(group["params"]):
            group["fused"] = None
    if not isinstance(optimizer, torch.optim.AdamW):
        return 0
    allocated = 0
    for group in optimizer.param_groups:
        on_device = group["capturable"] or group["fused"]
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) or not p.requires_grad:
                continue
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 and not group["fused"] else torch.float32
            state["step"] = torch.zeros((), dtype=scalar, device=p.device) if on_device else torch.tensor(0.0, dtype=scalar)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            allocated += sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")
    return allocated


@dataclass(frozen=True)
class StepResult:
    grad_norm: float  # global L2 norm before clipping
    skipped: bool  # True: the norm was not finite; no parameter, optimizer state or schedule changed


def clip_and_step(
    params: list, optimizer, scheduler, max_grad_norm: float, clip_grad_norm: Callable[[list, float], float] | None = None
) -> StepResult:
    """Clip (or only measure, max_grad_norm=0) the global gradient norm, then step, schedule and zero the gradients.
    A non-finite norm (a NaN/inf loss or gradient anywhere) skips the step: gradients are dropped, nothing else
    changes. `clip_grad_norm(params, max_norm) -> norm`: the engine's (global over processes); default torch's."""
    clip = clip_grad_norm or (lambda ps, m: float(torch.nn.utils.clip_grad_norm_(ps, m)))
    # max_norm=inf measures without changing the gradients (the clip coefficient is clamped to 1).
    norm = float(clip(params, max_grad_norm if max_grad_norm > 0 else float("inf")))
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return StepResult(norm, skipped=True)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(norm, skipped=False)


def total_optimizer_steps(cfg: Config) -> int:
    """Optimizer steps of a whole GRPO run: steps x num_iterations x optimizer steps per rollout."""
    per_rollout = cfg.generation_batch_size // (cfg.training.per_device_train_batch_size * cfg.training.gradient_accumulation_steps)
    return cfg.training.max_steps * cfg.algorithm.num_iterations * per_rollout
