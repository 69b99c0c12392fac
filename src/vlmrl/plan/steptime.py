"""The memory planner's step-time model: seconds per GRPO step, rough (compute at PEAK_FLOPS, decode bound by HBM
bandwidth, offload by PCIe). Only the ranking of search candidates uses it. Pure arithmetic."""

from __future__ import annotations

import math

from vlmrl.plan.geometry import prompt_vision, video_text_tokens
from vlmrl.plan.spec import DTYPE_BYTES, ModelSpec, Workload

# Step-time model constants (H100-class; only the ranking of candidates uses them).
PEAK_FLOPS = 989e12 * 0.40  # bf16 dense x an assumed 40% utilisation
HBM_BYTES_PER_S = 3.35e12
PCIE_BYTES_PER_S = 25e9
INTERCONNECT_BYTES_PER_S = 300e9
CPU_ADAM_PARAMS_PER_S = 1.0e9


def step_time(spec: ModelSpec, w: Workload, trainable: int | None = None) -> float:
    """Seconds per GRPO step, rough: compute at PEAK_FLOPS, decode bound by HBM bandwidth, offload by PCIe."""
    b = DTYPE_BYTES[w.dtype]
    params = spec.total_params
    flops_params = spec.active_params  # MoE: a token's FLOPs follow the experts it is routed to, its weights the total
    patches, vtok = prompt_vision(spec, w)
    P = w.prompt_text_tokens + video_text_tokens(spec, w) + vtok
    C = w.completion_tokens
    rows = w.rows_per_step
    ppc = w.prompts_per_call or w.prompts_per_step
    calls = math.ceil(w.prompts_per_step / ppc)
    kv_token = 2 * (spec.layers - spec.linear_attn_layers) * spec.kv_heads * spec.head_dim * 2
    prefill_rows = w.prompts_per_step if w.shared_prefix else rows
    t_gen = (2 * flops_params * prefill_rows * P + 2 * spec.vision_params * prefill_rows * patches) / PEAK_FLOPS
    t_gen += calls * C * (params * b / HBM_BYTES_PER_S) + C * rows * (P + C / 2) * kv_token / HBM_BYTES_PER_S
    tokens = rows * (P + C)
    fwd = 2 * flops_params * tokens / PEAK_FLOPS
    # a teacher: the student's old log-probs and one teacher forward (scaled by its size)
    t_score = fwd * ((w.beta > 0) + (w.num_iterations > 1 or w.teacher_params > 0) + w.teacher_params / max(1, params))
    mult = 2.0 if w.use_lora else 3.0  # forward + backward(activations) [+ backward(weights)]
    if w.gradient_checkpointing:
        mult += 1.0  # recompute the forward: +33% of 6 x params x tokens
    t_update = w.num_iterations * mult * fwd
    micro_batches = math.ceil(rows / w.micro_batch) * w.num_iterations
    t_update += micro_batches * 2 * params * b / HBM_BYTES_PER_S * 0.05  # per-call overhead of small micro-batches
    trainable = trainable if trainable is not None else params
    opt_steps = max(1, rows // max(1, w.micro_batch * w.grad_accum)) * w.num_iterations
    t_comm = 0.0
    if w.world_size > 1:
        if w.sharding in ("zero3", "fsdp"):
            t_comm = micro_batches * 3 * params * b / INTERCONNECT_BYTES_PER_S
        else:
            t_comm = opt_steps * 2 * trainable * b / INTERCONNECT_BYTES_PER_S
    t_off = 0.0
    if w.offload != "none":
        t_off = opt_steps * (2 * trainable * 4 / PCIE_BYTES_PER_S + trainable / w.world_size / CPU_ADAM_PARAMS_PER_S)
    if w.offload == "optimizer+params":
        t_off += micro_batches * 2 * params * b / w.world_size / PCIE_BYTES_PER_S
    ref_move = 2 * params * b / PCIE_BYTES_PER_S if (w.beta > 0 and not w.use_lora and w.ref_placement == "cpu") else 0.0
    return t_gen + t_score + t_update + t_comm + t_off + ref_move
