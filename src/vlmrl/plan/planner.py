"""Memory planner: the per-device GPU peak of a GRPO or SFT step and the host RAM per node, term by term, before launch.

This module is the planner's public face: it re-exports the names of the modules of vlmrl.plan that do the work, one concern each.

  spec               inputs: ModelSpec (an architecture as numbers), Workload (what one step does), constants, checks
  geometry           vision-token geometry: patches / tokens of an image, tiles, videos, one micro-batch's shape
  coefficients       per-token activation bytes of a decoder layer / vision block, eager attention's scores
  terms              one pure function per device term (weights, gradients, optimizer states, activations, ...)
  host               host RAM terms per node and the host verdict
  estimate           plan(): the terms summed into the rollout / scoring / update peaks, the verdict
  steptime           the step-time model (ranking only)
  hf                 a ModelSpec from a Hugging Face config (meta-device parameter counts), presets
  config             the Workload / ModelSpec / Plan of a vlmrl Config, device memory sizes
  search             search and auto_fit
  runlog             at run time: auto_fit applied, the prediction logged and compared with what was measured

Pure arithmetic on two plain dataclasses; nothing here imports torch, transformers, accelerate, deepspeed or vllm
at module level; `spec_from_hf_config` imports torch/transformers lazily to count parameters on the meta device.

Where the coefficients come from: the per-token activation bytes of a decoder layer / vision block were
read off the exact trace (`vlmrl.plan.trace`, a real forward + backward of the real modules on the meta
device) by varying one dimension at a time, and written as functions of the dimensions (see docs/planner.md).
Two global constants describe the CUDA device and were fit to the H100 measurements in benchmarks/results
(`ALLOCATOR_RESERVE`, the caching allocator's reserved-over-allocated ratio) or taken as a typical value
(`CUDA_CONTEXT_BYTES`, not measured here). Nothing is fit per configuration.

Main entry points:
  plan(spec, workload) -> Plan                 terms (bytes), peaks per phase, host terms, verdict (device and host)
  sft_workload(base, stage) -> Workload        what one `vlmrl sft` step of stage 1 / 2 does
  TERMS / model_states / host_terms / eager_attention_bytes   the pieces, each documented with its formula
  plan_for_config(cfg, world_size, gpu_memory_bytes) -> Plan
  search(spec, workload, allow=...) -> ranked feasible candidates (step-time model)
  auto_fit(cfg, gpu_memory_bytes, world_size) -> (new_cfg, changes)
"""

from __future__ import annotations

from vlmrl.plan.coefficients import (
    LINEAR_ATTN_CHUNK,
    DecoderBytes,
    eager_attention_bytes,
    first_linear_layer_bytes,
    linear_layer_bytes,
    linear_state_bytes,
    text_layer_bytes,
    vision_block_bytes,
)
from vlmrl.plan.config import (
    GPU_MEMORY_GIB,
    device_memory_bytes,
    parse_memory,
    plan_for_config,
    sft_plans_for_config,
    spec_for_config,
    workload_from_config,
)
from vlmrl.plan.estimate import Plan, phase_peaks, plan, update_peaks
from vlmrl.plan.geometry import (
    FAST_PATH_FAMILIES,
    TIMESTAMP_TEXT_TOKENS,
    TIMESTAMPED_VIDEO_FAMILIES,
    VIDEO_FAMILIES,
    MicroBatch,
    anyres_image,
    best_pinpoint,
    dynamic_tiles,
    image_patches,
    image_tokens,
    micro_batch,
    naive_fallback,
    prompt_vision,
    square_image,
    tiled_image,
    unique_prompts,
    video_grid,
    video_text_tokens,
    vision_encodes,
)
from vlmrl.plan.hf import model_spec, spec_from_hf_config
from vlmrl.plan.host import (
    CPU_ALLOCATOR_RESERVE,
    GLIBC_MMAP_MAX_BYTES,
    HOST_DATA_BYTES,
    HOST_RUNTIME_CPU_BYTES,
    HOST_RUNTIME_CUDA_BYTES,
    host_terms,
    host_verdict,
    parks,
)
from vlmrl.plan.runlog import (
    PREDICTION_WARN_FRACTION,
    _run_context,
    apply_auto_fit,
    data_shape_of,
    describe_data_shape,
    measured_vs_predicted,
    predict_for_run,
    predict_for_sft,
    prediction_vs_measured,
    runs_on_cpu,
)
from vlmrl.plan.search import Candidate, auto_fit, search
from vlmrl.plan.spec import (
    ALLOCATOR_RESERVE,
    ATTENTIONS,
    COMM_BUCKET_BYTES,
    CUDA_CONTEXT_BYTES,
    DTYPE_BYTES,
    FIT_FRACTION,
    MASTER_WEIGHTS,
    OFFLOADS,
    SHARDINGS,
    GiB,
    ModelSpec,
    PlanError,
    Workload,
    check_workload,
    sft_workload,
)
from vlmrl.plan.steptime import CPU_ADAM_PARAMS_PER_S, HBM_BYTES_PER_S, INTERCONNECT_BYTES_PER_S, PCIE_BYTES_PER_S, PEAK_FLOPS, step_time
from vlmrl.plan.terms import TERMS, generation_rows, master_weights_scheme, model_states

__all__ = [
    "ALLOCATOR_RESERVE",
    "ATTENTIONS",
    "COMM_BUCKET_BYTES",
    "CPU_ADAM_PARAMS_PER_S",
    "CPU_ALLOCATOR_RESERVE",
    "CUDA_CONTEXT_BYTES",
    "DTYPE_BYTES",
    "FAST_PATH_FAMILIES",
    "FIT_FRACTION",
    "GLIBC_MMAP_MAX_BYTES",
    "GPU_MEMORY_GIB",
    "HBM_BYTES_PER_S",
    "HOST_DATA_BYTES",
    "HOST_RUNTIME_CPU_BYTES",
    "HOST_RUNTIME_CUDA_BYTES",
    "INTERCONNECT_BYTES_PER_S",
    "LINEAR_ATTN_CHUNK",
    "MASTER_WEIGHTS",
    "OFFLOADS",
    "PCIE_BYTES_PER_S",
    "PEAK_FLOPS",
    "PREDICTION_WARN_FRACTION",
    "SHARDINGS",
    "TERMS",
    "TIMESTAMPED_VIDEO_FAMILIES",
    "TIMESTAMP_TEXT_TOKENS",
    "VIDEO_FAMILIES",
    "Candidate",
    "DecoderBytes",
    "GiB",
    "MicroBatch",
    "ModelSpec",
    "Plan",
    "PlanError",
    "Workload",
    "_run_context",
    "anyres_image",
    "apply_auto_fit",
    "auto_fit",
    "best_pinpoint",
    "check_workload",
    "data_shape_of",
    "describe_data_shape",
    "device_memory_bytes",
    "dynamic_tiles",
    "eager_attention_bytes",
    "first_linear_layer_bytes",
    "generation_rows",
    "host_terms",
    "host_verdict",
    "image_patches",
    "image_tokens",
    "linear_layer_bytes",
    "linear_state_bytes",
    "master_weights_scheme",
    "measured_vs_predicted",
    "micro_batch",
    "model_spec",
    "model_states",
    "naive_fallback",
    "parks",
    "parse_memory",
    "phase_peaks",
    "plan",
    "plan_for_config",
    "predict_for_run",
    "predict_for_sft",
    "prediction_vs_measured",
    "prompt_vision",
    "runs_on_cpu",
    "search",
    "sft_plans_for_config",
    "sft_workload",
    "spec_for_config",
    "spec_from_hf_config",
    "square_image",
    "step_time",
    "text_layer_bytes",
    "tiled_image",
    "unique_prompts",
    "update_peaks",
    "video_grid",
    "video_text_tokens",
    "vision_block_bytes",
    "vision_encodes",
    "workload_from_config",
]
