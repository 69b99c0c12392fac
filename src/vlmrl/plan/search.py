"""Search and auto-fit of the memory planner: every configuration over the knobs vlmrl's config has (micro-batch,
prompts per generate call, checkpointing, engine and offload, reference placement, and when allowed G, pixels and the
effective batch), planned and ranked by the step-time model; auto_fit turns the fastest that fits into config changes."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from vlmrl.plan import vllm
from vlmrl.plan.config import device_memory_bytes, spec_for_config, workload_from_config, zero_extra
from vlmrl.plan.estimate import Plan, plan
from vlmrl.plan.geometry import micro_batch
from vlmrl.plan.spec import OFFLOADS, GiB, ModelSpec, PlanError, Workload


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class Candidate:
    workload: Workload
    plan: Plan
    changes: list

    def to_dict(self) -> dict:
        return {
            "changes": self.changes,
            "total_gib": round(self.plan.total / GiB, 2),
            "step_time_s": round(self.plan.step_time_s, 3),
            "fits": self.plan.fits,
            "verdict": self.plan.verdict,
        }


_WHY = {
    "micro_batch": "rows per forward/backward (effective batch kept through gradient accumulation): bounds activations",
    "prompts_per_call": "prompts per generate() call: bounds the KV cache",
    "gradient_checkpointing": "keep only layer inputs, recompute in backward: activations / ~L, +33% update compute",
    "sharding": "split optimizer states / gradients / weights over the GPUs",
    "offload": "optimizer states (and parameters) in host RAM: frees device memory, costs PCIe traffic",
    "ref_placement": "reference copy in host RAM, moved in only for scoring",
    "num_generations": "fewer completions per prompt (changes the algorithm's group size)",
    "max_pixels": "smaller images (fewer image tokens; changes what the model sees)",
    "prompts_per_step": "fewer prompts per step (changes the effective batch)",
}


def _describe(base: Workload, w: Workload) -> list[str]:
    """What a candidate changes relative to the given config, each with why it matters."""
    out = []
    for f in (
        "micro_batch",
        "grad_accum",
        "prompts_per_call",
        "gradient_checkpointing",
        "sharding",
        "offload",
        "ref_placement",
        "num_generations",
        "max_pixels",
        "prompts_per_step",
    ):
        a, b = getattr(base, f), getattr(w, f)
        if f == "prompts_per_call":
            a, b = a or base.prompts_per_step, b or w.prompts_per_step
        if a == b or f == "grad_accum":
            continue
        why = _WHY.get(f, "")
        if f == "micro_batch":
            why = ("smaller: " if b < a else "larger: ") + why + f"; gradient_accumulation_steps {base.grad_accum} -> {w.grad_accum}"
        out.append(f"{f}: {a} -> {b}" + (f" ({why})" if why else ""))
    return out


def search(
    spec: ModelSpec, base: Workload, allow: tuple | list = (), top: int = 5, shardings: tuple | None = None, include_infeasible: bool = False
) -> list[Candidate]:
    """Feasible configurations ranked by the step-time model (fastest first). `allow` may hold
    num_generations, max_pixels, effective_batch; the effective batch, G and pixel caps never change otherwise."""
    if base.device == "cpu" and not base.host_memory_bytes:
        raise PlanError("search on a CPU run needs the host memory (--host-memory / training.auto_fit_host_memory_gib)")
    if base.gpu_memory_bytes is None and base.device != "cpu":
        raise PlanError("search needs the device memory (--gpu-memory / training.auto_fit_gpu_memory_gib)")
    out: list[Candidate] = []
    for w in candidate_workloads(base, set(allow), shardings):
        p = plan(spec, w)
        if p.fits or include_infeasible:
            out.append(Candidate(w, p, _describe(base, w)))
    out.sort(key=lambda c: (not c.plan.fits, c.plan.step_time_s, c.plan.total))
    return out[:top] if top else out


def _group_values(base: Workload, allow: set) -> tuple[list, list, list]:
    """(group sizes G, prompts per step, pixel caps) to try: the given ones, and halves / quarters when allowed."""
    Gs = [base.num_generations]
    if "num_generations" in allow:
        Gs += [g for g in (base.num_generations // 2, base.num_generations // 4) if g >= 2 and g not in Gs]
    prompt_counts = [base.prompts_per_step]
    if "effective_batch" in allow:
        prompt_counts += [p for p in (base.prompts_per_step // 2, base.prompts_per_step // 4) if p >= 1 and p not in prompt_counts]
    pixels = [base.max_pixels]
    if "max_pixels" in allow:
        pixels += [base.max_pixels // 2, base.max_pixels // 4]
    return Gs, prompt_counts, pixels


# Offloads each engine can do.
OFFLOADS_FOR = {
    "none": ("none",),
    "ddp": ("none",),
    "zero1": ("none", "optimizer"),
    "zero2": ("none", "optimizer"),
    "zero3": ("none", "optimizer", "optimizer+params"),
    "fsdp": ("none", "optimizer", "optimizer+params"),
}


def _engines(base: Workload, shardings: tuple | None) -> list[tuple[str, str]]:
    """(sharding, offload) pairs to try: the given sharding (and on several GPUs DDP / ZeRO-1/2/3), each with the
    offloads it can do that offload at least as much as the given config (a memory saver it has stays on). A
    workload planned under a DeepSpeed config (base.zero) keeps its stage and offload: the config's, not the search's."""
    if base.zero is not None:
        return [(base.sharding, base.offload)]
    if shardings is None:
        shardings = ("none",) if base.world_size == 1 else ("ddp", "zero1", "zero2", "zero3")
        if base.sharding not in shardings:
            shardings = (base.sharding, *shardings)
    rank = {o: i for i, o in enumerate(OFFLOADS)}
    return [(sh, off) for sh in shardings for off in OFFLOADS_FOR.get(sh, ("none",)) if rank[off] >= rank[base.offload]]


def candidate_workloads(base: Workload, allow: set, shardings: tuple | None = None):
    """Every workload search plans, in a fixed order. Rows per optimizer step are kept when G and the prompts are;
    otherwise their ratio to the rollout is. Memory savers the given config has stay on: a candidate that turns one
    off to go faster would trade the user's margin for speed (and "fixing" an OOM by switching checkpointing off is
    never right)."""
    Gs, prompt_counts, pixels = _group_values(base, allow)
    engines = _engines(base, shardings)
    gcs = (True,) if base.gradient_checkpointing else (False, True)
    frozen_copies = (base.beta > 0 and not base.use_lora) or base.teacher_params > 0  # memory.ref_placement moves them
    refs = ("device", "cpu") if (frozen_copies and base.ref_placement == "device") else (base.ref_placement,)
    step_rows = base.micro_batch * base.grad_accum
    for G, prompts in itertools.product(Gs, prompt_counts):
        kept = G == base.num_generations and prompts == base.prompts_per_step
        per_opt = step_rows if kept else max(1, step_rows * prompts * G // max(1, base.rows_per_step))
        for mb, ppc, gc, (sh, off), ref, px in itertools.product(_divisors(per_opt), _divisors(prompts), gcs, engines, refs, pixels):
            yield dataclasses.replace(
                base,
                num_generations=G,
                prompts_per_step=prompts,
                micro_batch=mb,
                grad_accum=per_opt // mb,
                prompts_per_call=None if ppc == prompts else ppc,
                gradient_checkpointing=gc,
                sharding=sh,
                offload=off,
                ref_placement=ref,
                max_pixels=px,
            )


def auto_fit(cfg, gpu_memory_bytes: int | None = None, world_size: int = 1, sharding: str | None = None, deepspeed: dict | None = None):
    """(new_cfg, changes): the fastest configuration predicted to fit, over knobs vlmrl's config has (micro-batch
    with the effective batch kept, generation prompts per call, gradient checkpointing, reference placement; and
    num_generations / max_pixels / effective batch only when listed in training.auto_fit_allow). deepspeed: the
    DeepSpeed config of a ZeRO run (every candidate planned with its buffers). Raises PlanError naming the knobs
    when nothing fits."""
    from vlmrl.config import replace

    if gpu_memory_bytes is None:
        gpu_memory_bytes = device_memory_bytes(cfg)
    allow = tuple(getattr(cfg.training, "auto_fit_allow", ()) or ())
    spec = spec_for_config(cfg)
    extra = {"sharding": sharding} if sharding and world_size > 1 else {}
    base = workload_from_config(cfg, world_size, gpu_memory_bytes, **zero_extra(spec, deepspeed if world_size > 1 else None, extra))
    shardings = (base.sharding,)  # the engine is the launcher's choice: auto_fit keeps it
    base = _vllm_cap(spec, base)
    found = search(spec, base, allow=allow, top=1, shardings=shardings)
    if not found:
        raise _nothing_fits(plan(spec, base), base, allow, gpu_memory_bytes)
    best = found[0].workload
    changes = _config_changes(cfg, base, best, allow)
    if not changes:
        return cfg, []
    lines = [f"{k.replace('__', '.')}: {_get(cfg, k)} -> {v}" for k, v in changes.items()]
    new = replace(cfg, **changes)
    p = plan(spec, best)
    lines.append(f"predicted peak {p.total / GiB:.1f} GiB of {gpu_memory_bytes / GiB:.1f} GiB; step-time model {p.step_time_s:.2f} s")
    return new, lines


def _vllm_cap(spec: ModelSpec, base: Workload) -> Workload:
    """A run whose rollout a colocated vLLM samples: the smallest cap whose KV blocks hold the whole rollout
    (plan.vllm.smallest_cap), so the micro-batch search that follows gets the rest of the device. PlanError when even
    the largest cap does not hold it."""
    if not (vllm.uses_vllm(base) and base.gpu_memory_bytes and base.device != "cpu"):
        return base
    cap = vllm.smallest_cap(spec, base, micro_batch(spec, base))
    if cap is None:
        raise PlanError(
            f"auto_fit: vLLM's KV blocks cannot hold the rollout's {base.rows_per_step} rows even at a cap of {vllm.MAX_CAP} of "
            f"{base.gpu_memory_bytes / GiB:.1f} GiB: lower rollout.generation_batch_size or rollout.max_completion_length"
        )
    return dataclasses.replace(base, vllm_gpu_memory_utilization=cap)


def _nothing_fits(now: Plan, base: Workload, allow: tuple, gpu_memory_bytes: int) -> PlanError:
    """The error naming what was searched, what is still locked and what else would help."""
    knobs = (
        "training.per_device_train_batch_size (with gradient_accumulation_steps), memory.generation_prompts_per_call, "
        "model.gradient_checkpointing" + (", memory.ref_placement" if (base.beta > 0 and not base.use_lora) or base.teacher_params > 0 else "")
    )
    locked = [k for k in ("num_generations", "max_pixels", "effective_batch") if k not in allow]
    host = (
        f" and {base.host_memory_bytes / GiB:.0f} GiB of host RAM (the current one needs {now.host['total'] / GiB:.1f})"
        if base.host_memory_bytes
        else ""
    )
    return PlanError(
        f"auto_fit: no configuration fits in {gpu_memory_bytes / GiB:.1f} GiB{host} (the current one needs {now.total / GiB:.1f} GiB). "
        f"Searched {knobs}. Still locked: {', '.join(locked) or 'nothing'} (allow them in training.auto_fit_allow), or use "
        "LoRA (model.use_lora), bf16 weights, more GPUs with ZeRO/FSDP (vlmrl plan --search --gpus N), or a bigger device."
    )


def _config_changes(cfg, base: Workload, best: Workload, allow: tuple) -> dict[str, Any]:
    """{section__field: new value} that turn cfg into the `best` workload (config.replace's keys)."""
    changes: dict[str, Any] = {}
    t = cfg.training
    if best.micro_batch != t.per_device_train_batch_size or best.grad_accum != t.gradient_accumulation_steps:
        changes["training__per_device_train_batch_size"] = best.micro_batch
        changes["training__gradient_accumulation_steps"] = best.grad_accum
    if (best.prompts_per_call or base.prompts_per_step) != (cfg.memory.generation_prompts_per_call or base.prompts_per_step):
        changes["memory__generation_prompts_per_call"] = best.prompts_per_call
    if best.gradient_checkpointing != cfg.model.gradient_checkpointing:
        changes["model__gradient_checkpointing"] = best.gradient_checkpointing
    if best.vllm_gpu_memory_utilization and best.vllm_gpu_memory_utilization != cfg.rollout.vllm_gpu_memory_utilization:
        changes["rollout__vllm_gpu_memory_utilization"] = best.vllm_gpu_memory_utilization
    if best.ref_placement != cfg.memory.ref_placement:
        changes["memory__ref_placement"] = best.ref_placement
    if best.num_generations != cfg.rollout.num_generations and "num_generations" in allow:
        changes["rollout__num_generations"] = best.num_generations
    if best.max_pixels != cfg.data.max_pixels and "max_pixels" in allow:
        changes["data__max_pixels"] = best.max_pixels
        if cfg.data.min_pixels > best.max_pixels:
            changes["data__min_pixels"] = best.max_pixels
    if best.rows_per_step != base.rows_per_step or "rollout__num_generations" in changes:
        if best.prompts_per_step != base.prompts_per_step and "effective_batch" not in allow:
            raise PlanError("auto_fit internal error: the effective batch would change without auto_fit_allow")
        changes["rollout__generation_batch_size"] = best.rows_per_step
    return changes


def _get(cfg, dotted: str):
    section, name = dotted.split("__", 1)
    return getattr(getattr(cfg, section), name)
