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

from vlmrl.config import Config, ConfigError, OptimConfig


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


def make_optimizer(model, o: OptimConfig, num_steps: int, learning_rate: float | None = None):
    """AdamW over the trainable parameters and its schedule over `num_steps` optimizer steps (`o`: cfg.optim)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("no trainable parameters: check model.freeze_vision_tower / train_projector_only / use_lora")
    optimizer = InPlaceAdamW(
        params,
        lr=o.learning_rate if learning_rate is None else learning_rate,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_epsilon,
        weight_decay=o.weight_decay,
    )
    schedule = WarmupSchedule(o.lr_scheduler_type, math.ceil(o.warmup_ratio * num_steps), num_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


class InPlaceAdamW(torch.optim.AdamW):
    """torch's AdamW whose CPU step is torch's CPU default (the per-parameter loop) bit for bit, minus that loop's two
    temporaries the size of each parameter: the denominator sqrt(v) / sqrt(1 - beta2^t) + eps goes into one reused
    buffer of at most `SCRATCH_ELEMENTS`, a slice of the parameter at a time (every op is elementwise: the same values whatever
    the slicing). For a 151,936 x 128 LM head the loop's temporaries were 150 MiB of a step's peak (the planner counts
    no step temporary on the CPU). torch's fused CPU kernel has no temporaries either but rounds differently, so a
    seeded run trained to other bits than with the default (the demo's trajectory moved). Groups this does not cover
    (not on the CPU, DTensor shards, amsgrad, maximize, capturable, differentiable, foreach or fused asked for, complex,
    sparse or non-contiguous) take torch's own step; state and state_dict are torch's."""

    # 16 MiB of float32: few, large slices (each op is a parallel region; 1 MiB slices were far slower under load:
    # benchmarks/results/demo_trajectory_attribution_2026-11-27.md).
    SCRATCH_ELEMENTS = 1 << 22

    def step(self, closure=None):
        if not all(_in_place_covers(group) for group in self.param_groups):
            torch_step = torch.optim.AdamW.step
            while getattr(torch_step, "hooked", False):  # this call is already inside the step hooks: not twice
                torch_step = torch_step.__wrapped__
            return torch_step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        """torch.optim.adam._single_tensor_adam's arithmetic (decoupled weight decay, no amsgrad), op for op."""
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            grad, state = param.grad, self.state[param]
            if not state:
                state.update(new_adamw_state(group, param))
            exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
            step_t += 1
            if weight_decay != 0:
                param.mul_(1 - lr * weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = step_t.item()
            step_size = lr / (1 - beta1**step)
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            flat_param, flat_avg, flat_sq = param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
            scratch = self._scratch(param)
            for start in range(0, flat_param.numel(), scratch.numel()):
                sl = slice(start, min(start + scratch.numel(), flat_param.numel()))
                denom = torch.sqrt(flat_sq[sl], out=scratch[: sl.stop - sl.start]).div_(bias_correction2_sqrt).add_(eps)
                flat_param[sl].addcdiv_(flat_avg[sl], denom, value=-step_size)

    def _scratch(self, param: torch.Tensor) -> torch.Tensor:
        """The reused denominator buffer in param's dtype: SCRATCH_ELEMENTS, or the largest parameter's size when that is
        smaller (one per dtype; not optimizer state)."""
        need = min(self.SCRATCH_ELEMENTS, param.numel())
        buffers = self.__dict__.setdefault("_scratch_buffers", {})
        if param.dtype not in buffers or buffers[param.dtype].numel() < need:
            buffers[param.dtype] = torch.empty(need, dtype=param.dtype)
        return buffers[param.dtype]


def _in_place_covers(group: dict) -> bool:
    """InPlaceAdamW's own step for this group: plain contiguous real floating-point CPU tensors and dense gradients,
    with torch's CPU default being the per-parameter loop (no amsgrad, maximize, capturable, differentiable, foreach,
    fused, tensor lr)."""
    if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"] or group["foreach"] or group["fused"]:
        return False
    if isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"]):
        return False
    return all(
        p.device.type == "cpu"
        and type(p.data) is torch.Tensor
        and p.dtype.is_floating_point
        and p.is_contiguous()
        and (p.grad is None or (p.grad.layout == torch.strided and p.grad.is_contiguous()))
        for p in group["params"]
    )


def new_adamw_state(group: dict, p: torch.Tensor) -> dict:
    """AdamW's state for p as torch's first step creates it (step counter, zero moments; same dtypes and devices)."""
    on_device = group["capturable"] or group["fused"]
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 and not group["fused"] else torch.float32
    state = {
        "step": torch.zeros((), dtype=scalar, device=p.device) if on_device else torch.tensor(0.0, dtype=scalar),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def allocate_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Create AdamW's moment buffers now, as its first step would (same dtypes, devices, zeros), for every parameter
    that has none yet. An out-of-memory then happens here, before training, not half-way through optimizer.step
    where it cannot be undone. Returns the bytes allocated."""
    if not isinstance(optimizer, torch.optim.AdamW):
        return 0
    allocated = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) or not p.requires_grad:
                continue
            state.update(new_adamw_state(group, p))
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
