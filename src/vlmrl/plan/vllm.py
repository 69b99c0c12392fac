"""A colocated vLLM engine (rollout.backend=vllm) in the memory plan: what its reservation holds, whether the KV
blocks it leaves hold the rollout, what each sleep level frees on the device and keeps in host RAM, and the smallest
cap that holds the rollout (auto_fit). Pure arithmetic over ModelSpec / Workload.

vLLM's semantics (recent vLLM, V1 engine): `gpu_memory_utilization` is a share of the whole device that this engine
reserves, whatever else runs on it; inside that share live its weight copy (1/tp of it per rank under tensor
parallelism), the peak of its profiling run (activations, the sampler's warm-up logits), its encoder cache (the
embeddings of one prompt's images at limit_mm_per_prompt), and KV-cache blocks, which fill whatever the cap leaves.
Sleep level 1 moves the weights to host RAM and frees the KV cache; level 2 discards both. The trainer no longer
generates itself: its own KV cache and generation temporaries are not planned (terms.kv_cache)."""

from __future__ import annotations

import math

from vlmrl.plan.geometry import MicroBatch, image_patches, image_tokens
from vlmrl.plan.spec import DTYPE_BYTES, GiB, ModelSpec, Workload

PROFILE_SEQS = 256  # vLLM's default max_num_seqs: its sampler warm-up holds float32 logits of this many rows
UNPLANNED_ON_CPU = "vLLM on CPU reserves its share of the first NUMA node's memory (KV cache space), which the host plan does not count"
CAP_STEP = 0.05  # auto_fit tries caps in steps of 5% of the device
MAX_CAP = 0.95


def uses_vllm(w: Workload) -> bool:
    """A GRPO step whose rollout vLLM samples (SFT has no rollout)."""
    return w.vllm_gpu_memory_utilization > 0 and w.mode != "sft"


def reservation(w: Workload) -> int:
    """cap x device memory: what vLLM holds on the device while awake (0 when no device size is given)."""
    return int(w.vllm_gpu_memory_utilization * (w.gpu_memory_bytes or 0))


def vllm_weights(spec: ModelSpec, w: Workload) -> float:
    """vLLM's own copy of the weights in the model's dtype (LoRA merged), 1/tp of it on each tensor-parallel rank."""
    return spec.total_params * DTYPE_BYTES[w.dtype] / w.vllm_tensor_parallel_size


def kv_bytes_per_token(spec: ModelSpec, w: Workload) -> float:
    """k and v of every full-attention layer for one token on one rank: the KV heads split over tp ranks (each rank
    keeps at least one head: heads are replicated when tp > KV heads)."""
    heads = max(1, spec.kv_heads // w.vllm_tensor_parallel_size)
    return 2 * (spec.layers - spec.linear_attn_layers) * heads * spec.head_dim * DTYPE_BYTES[w.dtype]


def max_model_len(w: Workload, mb: MicroBatch) -> int:
    return w.vllm_max_model_len or (mb.P + mb.C)


def encoder_cache(spec: ModelSpec, w: Workload) -> float:
    """The embeddings of one prompt's images at the pixel cap, limit_mm_per_prompt of them (vLLM profiles its encoder
    cache with that many items at the largest size)."""
    images = w.vllm_limit_images or w.images_per_prompt
    return images * image_tokens(spec, w.max_pixels) * spec.hidden * DTYPE_BYTES[w.dtype] if spec.v_layers else 0


def profile_peak(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """The transient peak of vLLM's profiling run: one layer's MLP / attention temporaries over max_model_len tokens
    (whole prompts: chunked prefill off), the vision tower's over limit_mm_per_prompt images, or the sampler's
    float32 logits of PROFILE_SEQS rows, whichever is largest (1/tp of the text and vision ones per rank)."""
    b, tp = DTYPE_BYTES[w.dtype], w.vllm_tensor_parallel_size
    text = max_model_len(w, mb) * b * (4 * spec.hidden + 3 * spec.intermediate) / tp
    images = w.vllm_limit_images or w.images_per_prompt
    vision = images * image_patches(spec, w.max_pixels) * b * (6 * spec.v_hidden + 3 * spec.v_intermediate) / tp if spec.v_layers else 0
    return max(text, vision, PROFILE_SEQS * spec.vocab * 4)


def kv_needed(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """KV blocks for the whole rollout at once: every row of the step (prompts_per_step x G on this device; a tensor-
    parallel group samples its tp ranks' rows together, each rank holding its heads) at prompt + completion tokens."""
    return w.rows_per_step * w.vllm_tensor_parallel_size * (mb.P + mb.C) * kv_bytes_per_token(spec, w)


def fixed_bytes(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """What the cap holds before any KV block: weights, encoder cache, profiling peak."""
    return vllm_weights(spec, w) + encoder_cache(spec, w) + profile_peak(spec, w, mb)


def vllm_terms(spec: ModelSpec, w: Workload, mb: MicroBatch) -> dict:
    """The reservation and what it holds (bytes on one device), and what sleep frees. kv_cache: the blocks the cap
    leaves (0 when it leaves none); kv_needed: what the rollout's rows take at once."""
    res = reservation(w)
    free_for_kv = res - fixed_bytes(spec, w, mb)
    return {
        "reservation": res,
        "weights": int(vllm_weights(spec, w)),
        "encoder_cache": int(encoder_cache(spec, w)),
        "profile_peak": int(profile_peak(spec, w, mb)),
        "kv_cache": int(max(0, free_for_kv)),
        "kv_needed": int(kv_needed(spec, w, mb)),
        "kv_one_sequence": int(max_model_len(w, mb) * kv_bytes_per_token(spec, w)),
        "freed_by_sleep": res if w.vllm_sleep_level else 0,
        "sleep_level": w.vllm_sleep_level,
        "tensor_parallel_size": w.vllm_tensor_parallel_size,
        "cap": w.vllm_gpu_memory_utilization,
    }


def resident(w: Workload, phase: str) -> int:
    """vLLM's bytes on the device in a phase: the whole reservation while it samples (rollout); during scoring and
    the update the whole reservation again without sleep, nothing asleep (level 1 and 2 give back weights and KV)."""
    if phase == "rollout" or w.vllm_sleep_level == 0:
        return reservation(w)
    return 0


def host_bytes(spec: ModelSpec, w: Workload) -> float:
    """Host RAM of one process's engine asleep: level 1 keeps its weight copy there (1/tp of it); level 2 discards it."""
    return vllm_weights(spec, w) if (uses_vllm(w) and w.vllm_sleep_level == 1) else 0


def problems(v: dict) -> list[str]:
    """Verdict phrases: vLLM cannot start (the cap leaves no room for one sequence's KV blocks), or it holds fewer
    rows than the rollout at once (it then preempts and recomputes: slower, not an OOM)."""
    if v["kv_cache"] < max(1, v["kv_one_sequence"]):
        return [
            f"vLLM cannot start: its cap ({v['cap']:.2f} x the device = {v['reservation'] / GiB:.1f} GiB) leaves "
            f"{v['kv_cache'] / GiB:.2f} GiB for KV blocks after its weights, encoder cache and profiling peak; one sequence "
            f"needs {v['kv_one_sequence'] / GiB:.2f} GiB"
        ]
    return []


def notes(v: dict) -> list[str]:
    if v["kv_cache"] < v["kv_needed"]:
        share = v["kv_cache"] / max(1, v["kv_needed"])
        held = f"vLLM's KV blocks ({v['kv_cache'] / GiB:.2f} GiB) hold {share:.0%} of the rollout's rows at once"
        return [held + ": it preempts the rest (slower, not an OOM)"]
    return []


def smallest_cap(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float | None:
    """The smallest cap (a multiple of CAP_STEP, at most MAX_CAP) whose KV blocks hold the whole rollout; None when
    even MAX_CAP does not (or no device size is given)."""
    if not w.gpu_memory_bytes:
        return None
    need = (fixed_bytes(spec, w, mb) + kv_needed(spec, w, mb)) / w.gpu_memory_bytes
    cap = round(math.ceil(need / CAP_STEP - 1e-9) * CAP_STEP, 2)
    return cap if cap <= MAX_CAP else None
