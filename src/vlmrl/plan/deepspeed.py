"""DeepSpeed ZeRO's own buffers as memory-planner terms (issue 23 part 5, the model side), read from a DeepSpeed config.

`zero_config(ds_json, hidden)` reads the `zero_optimization` section of a DeepSpeed JSON (or accelerate's deepspeed
section) into a `ZeroConfig`: DeepSpeed 0.19's defaults where a key is unset (deepspeed/runtime/zero/config.py),
accelerate's fill for "auto" (reduce_bucket_size = h^2, stage3_prefetch_bucket_size = 0.9 h^2,
stage3_param_persistence_threshold = 10 h; accelerate/accelerator.py). Each term below is a pure function
(spec, w, z) -> bytes on one device; what DeepSpeed allocates, read off its source (stage_1_and_2.py, stage3.py):

  ZeRO-1/2  reduce buckets: with contiguous_gradients (default on) the gradients are copied into a flat buffer of
            reduce_bucket_size elements as backward produces them, two of them with overlap_comm (default off
            below stage 3); allocated whole (torch.empty), so on a GPU the caching allocator holds all of it while
            on the CPU only the pages written (at most the gradients' size) become resident.
            fp32 gradient partition: at the optimizer step the partition's gradients are flattened (gradient dtype)
            and converted to float32 (single_grad_partition): partition x (4 + gradient bytes), transient.
  ZeRO-3    one reduce bucket of reduce_bucket_size elements (contiguous_gradients);
            the float32 gradient buffer of the largest optimizer sub-group (min(sub_group_size, partition)
            elements), allocated at initialisation and kept;
            parameters gathered at once: the module running plus up to stage3_prefetch_bucket_size elements
            prefetched, at most stage3_max_live_parameters;
            persistent parameters: parameters of at most stage3_param_persistence_threshold elements are not
            partitioned (every rank keeps them whole, up to model_persistence_threshold elements in all).

Offloaded optimizers keep these on the host instead (0 here). plan() adds them (with_zero_terms) when the workload
carries the DeepSpeed config's ZeroConfig (Workload.zero: a run's own config, or `vlmrl plan --deepspeed-config`);
without one a zero1/2/3 plan keeps the generic terms. Checked against 2-process CPU runs
(benchmarks/planner_deepspeed.py). Pure arithmetic; nothing here imports deepspeed.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from vlmrl.plan.spec import DTYPE_BYTES, ModelSpec, PlanError, Workload
from vlmrl.plan.terms import lora_params, trainable_params


@dataclass(frozen=True)
class ZeroConfig:
    """The ZeRO settings that size DeepSpeed's buffers (element counts, as DeepSpeed's config takes them)."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default, on for stage 3 only
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000  # stage3_prefetch_bucket_size
    param_persistence_threshold: int = 100_000  # stage3_param_persistence_threshold
    model_persistence_threshold: int = sys.maxsize
    max_live_parameters: int = 1_000_000_000  # stage3_max_live_parameters
    sub_group_size: int = 1_000_000_000
    offload_optimizer: bool = False
    offload_param: bool = False

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


# DeepSpeed config key -> ZeroConfig field (the stage3_ names are DeepSpeed's aliases).
_KEYS = {
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
    "model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "max_live_parameters": "max_live_parameters",
    "sub_group_size": "sub_group_size",
}


def _auto(key: str, hidden: int) -> int:
    """accelerate's value for an "auto" size (from the model's hidden size)."""
    fill = {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    if key not in fill:
        raise PlanError(f"zero_optimization.{key}: 'auto' is filled by accelerate only for {', '.join(fill)}; give a number")
    return fill[key]


def _size(key: str, value, hidden: int) -> int:
    if value == "auto":
        return _auto(key, hidden)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
        raise PlanError(f"zero_optimization.{key}: {value!r} is not an element count; give a number such as 5e8 (or 'auto')")
    return int(value)


def zero_config(ds: dict, hidden: int) -> ZeroConfig:
    """The ZeroConfig of a DeepSpeed config dict (its zero_optimization section); unset keys take DeepSpeed's defaults."""
    z = ds.get("zero_optimization") or {}
    if not isinstance(z, dict):
        raise PlanError("zero_optimization: expected a section of key: value settings")
    stage = z.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise PlanError(f"zero_optimization.stage: {stage!r}; use 0, 1, 2 or 3")
    kw: dict = {"stage": stage}
    for key, name in _KEYS.items():
        if key in z:
            kw[name] = _size(key, z[key], hidden)
    for key in ("overlap_comm", "contiguous_gradients"):
        if key in z and z[key] is not None:
            kw[key] = bool(z[key])
    kw["offload_optimizer"] = (z.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    kw["offload_param"] = (z.get("offload_param") or {}).get("device", "none") not in ("none", None)
    return ZeroConfig(**kw)


def zero_offload(z: ZeroConfig) -> str:
    """The planner's offload (Workload.offload) of a DeepSpeed config: offload_param (ZeRO-3 only) moves the weights'
    partitions too, offload_optimizer the float32 partitions, moments and gradient partitions."""
    if z.offload_param and z.stage == 3:
        return "optimizer+params"
    return "optimizer" if z.offload_optimizer else "none"


def _partition(spec: ModelSpec, w: Workload) -> int:
    """Trainable elements of one rank's partition (DeepSpeed pads the flat group to a multiple of the world size)."""
    return math.ceil(trainable_params(spec, w)[0] / w.world_size)


def _resident(elements: int, spec: ModelSpec, w: Workload) -> int:
    """Elements of a buffer allocated whole (torch.empty) that hold memory: all of them on a GPU (the caching allocator
    keeps the block); on the CPU only the pages written, and a gradient bucket is written at most up to the trainable
    elements (it is filled from its start after each flush)."""
    return min(elements, trainable_params(spec, w)[0]) if w.device == "cpu" else elements


def zero_reduce_buckets(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """Flat gradient buckets of reduce_bucket_size elements in the gradients' dtype: stage 1/2 two with overlap_comm
    (one without), stage 3 one; none without contiguous_gradients (an offloaded optimizer forces them on at 1/2).
    Each gradient is copied into the bucket as backward produces it and its own tensor freed."""
    contiguous = z.contiguous_gradients or (z.offload_optimizer and z.stage in (1, 2))
    if z.stage == 0 or not contiguous:
        return 0
    buffers = 1 if z.stage == 3 else (2 if z.overlap else 1)
    return buffers * _resident(z.reduce_bucket_size, spec, w) * trainable_params(spec, w)[1]


def zero3_reduces_once(spec: ModelSpec, w: Workload, z: ZeroConfig) -> bool:
    """ZeRO-3 flushes its gradient bucket when the next gradient would overflow it; a bucket that holds every
    trainable gradient is reduced once, at the end of backward (after the activations are freed), so its
    reduce-scatter copies do not meet the activations."""
    return z.stage == 3 and z.contiguous_gradients and z.reduce_bucket_size >= trainable_params(spec, w)[0]


def zero3_reduce_scatter_copies(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """ZeRO-3 backward, as a full bucket is reduce-scattered: its gradients concatenated into one padded flat tensor
    (reduce_scatter_coalesced's torch.cat), plus on the CPU gloo's staging copy of it (NCCL reduces in place)."""
    if z.stage != 3 or not z.contiguous_gradients:
        return 0
    return _resident(z.reduce_bucket_size, spec, w) * trainable_params(spec, w)[1] * (2 if w.device == "cpu" else 1)


def zero_master_copy(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """ZeRO-1/2/3 clone the partition of float32 trainables as their float32 master (the planner's optimizer states
    count float32 trainables as their own master). ZeRO-3 means to reuse a float32 partition already on the device,
    but DeepSpeed 0.19 compares the partition's torch.device with the accelerator's device name (a string), which
    never matches, so it clones too (measured: +1 partition of live tensors from deepspeed.initialize on in the
    ZeRO-3 CPU runs). Offloaded: on the host (zero_offload_host_buffers)."""
    if z.stage == 0 or z.offload_optimizer or trainable_params(spec, w)[1] != 4:
        return 0
    return _partition(spec, w) * 4


def zero_checkpoint_pages(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """CPU, ZeRO-1/2, full-parameter training with some weights frozen (e.g. SFT stage 2's vision tower): the weights
    load as views of the memory-mapped checkpoint; ZeRO copies the trainable ones into its flat buffer, but the frozen
    ones keep the mapping alive, so the checkpoint pages of the trainable weights, read while flattening, stay
    resident beside their copy (measured as RssFile). Everything trainable (the mapping is released), LoRA (the
    checkpoint pages are the weights) and ZeRO-3 (every weight partitioned): none."""
    trainable, tb = trainable_params(spec, w)
    if w.device != "cpu" or z.stage not in (1, 2) or w.use_lora or trainable >= spec.total_params:
        return 0
    return trainable * tb


def zero_fp32_grad_partition(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """The optimizer step: the partition's gradients flattened (their dtype) and converted to float32 (no copy when
    they are float32 already); ZeRO-3 one sub-group (at most sub_group_size elements) at a time."""
    if z.stage == 0 or z.offload_optimizer:
        return 0
    tb = trainable_params(spec, w)[1]
    elements = min(z.sub_group_size, _partition(spec, w)) if z.stage == 3 else _partition(spec, w)
    return elements * (tb + (4 if tb < 4 else 0))


def zero_allgather_staging(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """ZeRO-1/2 on the CPU, after the optimizer step: every rank's updated partition all-gathered into the flat
    weights (all_gather_into_tensor), which gloo stages whole: the trainables in their dtype (measured by
    benchmarks/gloo_allgather_staging.py: 2 ranks' 95 MiB partitions peaked 192 MiB above the call's start,
    results/gloo_allgather_staging_cpu_2026-11-27.txt). The float32 gradient partition is released before it.
    NCCL gathers in place: 0 on a GPU; ZeRO-3 gathers per module (gathered_parameters)."""
    if w.device != "cpu" or z.stage not in (1, 2):
        return 0
    return _partition(spec, w) * w.world_size * trainable_params(spec, w)[1]


def zero3_fp32_grad_buffer(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """ZeRO-3 initialisation: the float32 gradient buffer of the largest optimizer sub-group (min(sub_group_size,
    partition) elements, zeroed) while it creates AdamW's states; released before training."""
    if z.stage != 3 or z.offload_optimizer:
        return 0
    return min(z.sub_group_size, _partition(spec, w)) * 4


def zero_step_temporary(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """AdamW's step over one flat float32 partition (ZeRO-3: one sub-group of at most sub_group_size elements): the
    foreach step on a GPU holds one temporary (4 bytes per element); on the CPU vlmrl's AdamW is torch's fused kernel
    (engine/optim.py; DeepSpeed steps it on its flat partitions), which holds none (measured: no rise in the ZeRO-3
    CPU runs' optimizer step); none when the optimizer is offloaded."""
    if z.stage == 0 or z.offload_optimizer or w.device == "cpu":
        return 0
    elements = min(z.sub_group_size, _partition(spec, w)) if z.stage == 3 else _partition(spec, w)
    return elements * 4


def zero_offload_host_buffers(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """ZeRO-Offload's host buffers beyond the moments and the float32 gradient partition (host.py's offloaded terms):
    the float32 master partition, a clone of the weights' partition even when they are float32 (host.py counts a
    master only for 16-bit trainables), and ZeRO-1/2's buffer the updated partition is copied back through (the
    partition in the weights' dtype). 0 without offload_optimizer."""
    if not z.offload_optimizer or z.stage == 0:
        return 0
    tb = trainable_params(spec, w)[1]
    part = _partition(spec, w)
    return part * (4 if tb == 4 else 0) + (part * tb if z.stage in (1, 2) else 0)


def zero3_gathered_parameters(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """ZeRO-3: parameters gathered at once, in the weights' dtype: the largest module running (a layer's share of the
    non-embedding parameters, or the embedding / LM head) plus up to prefetch_bucket_size elements fetched ahead,
    at most max_live_parameters and at most the whole model."""
    if z.stage != 3:
        return 0
    per_layer = (spec.total_params - spec.embed_params - spec.lm_head_params) // max(spec.layers + spec.v_layers, 1)
    running = max(per_layer, spec.embed_params, spec.lm_head_params)
    live = min(running + z.prefetch_bucket_size, max(z.max_live_parameters, running), spec.total_params)
    return live * DTYPE_BYTES[w.dtype]


def zero3_prefix_gathered(spec: ModelSpec, w: Workload, z: ZeroConfig) -> int:
    """ZeRO-3 under vlmrl's shared prefix (every decoder layer runs twice: prompt pass, completion pass): the decoder's
    weights gathered at once in backward, in their dtype (LoRA adapters float32), in place of the held gradients and
    the gather window other engines have there (estimate.update_peaks). Measured, not derived from DeepSpeed's code:
    in the 2-process CPU runs up to 92.5 M of the 93 M trainable parameters were gathered at once in backward (GRPO
    and SFT alike), and GRPO's backward peaked a decoder's worth (0.34 GiB) above what SFT's did beside the same
    reduce-scatter copies (plausibly DeepSpeed releasing a module's parameters only after its last backward use,
    ds_grads_remaining, which the shared prefix delays; not isolated)."""
    if z.stage != 3:
        return 0
    decoder = spec.total_params - spec.vision_params - spec.embed_params - spec.lm_head_params
    return decoder * DTYPE_BYTES[w.dtype] + lora_params(spec, w) * 4


def zero3_persistent_parameters(spec: ModelSpec, w: Workload, z: ZeroConfig, param_sizes: tuple) -> float:
    """ZeRO-3: parameters of at most param_persistence_threshold elements stay whole on every rank (in the weights'
    dtype), up to model_persistence_threshold elements in all, taken in the order given; beyond the 1/n share the
    sharded weights already count. param_sizes: ((elements, count), ...) of the model's parameters."""
    if z.stage != 3:
        return 0
    kept = 0
    for numel, count in param_sizes:
        if numel <= z.param_persistence_threshold:
            kept += min(count, max(0, z.model_persistence_threshold - kept) // max(numel, 1)) * numel
    return kept * DTYPE_BYTES[w.dtype] * (1 - 1 / w.world_size)


# The device terms of a DeepSpeed ZeRO run beyond the engine-agnostic ones (zero3_persistent_parameters needs the
# model's parameter sizes: zero_terms).
ZERO_TERMS = {
    "zero_reduce_buckets": zero_reduce_buckets,
    "zero3_reduce_scatter_copies": zero3_reduce_scatter_copies,
    "zero_master_copy": zero_master_copy,
    "zero_checkpoint_pages": zero_checkpoint_pages,
    "zero_fp32_grad_partition": zero_fp32_grad_partition,
    "zero_allgather_staging": zero_allgather_staging,
    "zero_step_temporary": zero_step_temporary,
    "zero3_fp32_grad_buffer": zero3_fp32_grad_buffer,
    "zero3_gathered_parameters": zero3_gathered_parameters,
}


def zero_terms(spec: ModelSpec, w: Workload, ds: dict, param_sizes: tuple = ()) -> dict:
    """{term: bytes} of DeepSpeed's own buffers for `w` under the DeepSpeed config dict `ds` (param_sizes:
    plan.hf.parameter_sizes of the model, for the persistent parameters; () counts none)."""
    z = zero_config(ds, spec.hidden)
    out = {name: int(term(spec, w, z)) for name, term in ZERO_TERMS.items()}
    out["zero3_persistent_parameters"] = int(zero3_persistent_parameters(spec, w, z, param_sizes))
    return out


def plans_zero(w: Workload) -> bool:
    """plan() adds ZeRO's buffers: the workload carries the DeepSpeed config's ZeroConfig of a ZeRO-1/2/3 sharding."""
    return w.zero is not None and w.sharding in ("zero1", "zero2", "zero3")


def with_zero_terms(spec: ModelSpec, w: Workload, raw: dict) -> dict:
    """The device terms of `w` (terms.TERMS, unrounded) under its DeepSpeed config (plans_zero): ZeRO's buckets replace
    the generic gradient buckets (comm_buffers), its gather window the generic two layers (gathered_parameters),
    AdamW's step over the flat partition the per-parameter step temporary; ZeRO's own terms are added."""
    z = w.zero
    out = dict(raw, comm_buffers=0)
    out["optimizer_step_temporary"] = zero_step_temporary(spec, w, z)
    if z.offload_optimizer:  # the gradient partition is the host's (host.py offloaded_gradients); ZeRO's buckets carry them there
        out["gradients"] = 0
    if z.stage == 3:
        out["gathered_parameters"] = zero3_gathered_parameters(spec, w, z)
    names = ("zero_reduce_buckets", "zero3_reduce_scatter_copies", "zero_master_copy", "zero_checkpoint_pages", "zero_fp32_grad_partition")
    for name in (*names, "zero_allgather_staging"):
        out[name] = ZERO_TERMS[name](spec, w, z)
    return out


def zero_flat_at_peak(spec: ModelSpec, w: Workload, t: dict, phases: dict, fwd_bwd: float) -> int:
    """Bytes of the device peak in DeepSpeed's flat buffers, each one allocation (on the CPU above glibc's mmap
    ceiling they are mmapped and leave no heap slack): the weights (the trainable ones flattened, ZeRO-3 every weight's
    partition; frozen weights stay the checkpoint's file-backed pages: no heap either), the master clone, each AdamW
    moment, the gradient partition, the buckets, and at an optimizer-step peak its float32 gradient partition and each
    of its two step temporaries; those under the ceiling count as heap."""
    from vlmrl.plan.host import GLIBC_MMAP_MAX_BYTES

    def big(b: float) -> float:
        return b if b >= GLIBC_MMAP_MAX_BYTES else 0

    z = w.zero
    flat = (
        t["zero_checkpoint_pages"]
        + big(t["weights"])
        + big(t["master_weights"])
        + 2 * big(t["optimizer_states"] / 2)
        + big(t["zero_master_copy"])
        + big(t["gradients"])
    )
    top = max(phases, key=phases.get)
    if z.stage == 3:
        flat += big(t["zero_reduce_buckets"])
    elif top == "update" and phases["update"] == int(fwd_bwd):
        flat += big(t["zero_reduce_buckets"])
    if top == "update" and phases["update"] != int(fwd_bwd):  # the optimizer step (or the end of backward)
        steps = 2 if w.device == "cpu" else 1
        stepping = steps * big(t["optimizer_step_temporary"] / steps) + big(t["zero_fp32_grad_partition"])
        staging = t.get("zero_allgather_staging", 0)  # after the step (zero_allgather_staging): the larger of the two
        flat += big(staging) if staging > t["optimizer_step_temporary"] + t["zero_fp32_grad_partition"] else stepping
    return int(flat)
