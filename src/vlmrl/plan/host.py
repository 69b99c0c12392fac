"""Host RAM of the memory planner: one node's terms (runtime, model loading, offloaded optimizer / gradients /
parameters, parked states, pinned buffers, a CPU reference, rollout buffers, on a CPU run every device tensor, the
state dict gathered at save) and its peak over loading, training and saving; the host verdict. Pure arithmetic."""

from __future__ import annotations

from vlmrl.plan.profiles import TRAINER_CPU_RUNTIME_BYTES
from vlmrl.plan.spec import COMM_BUCKET_BYTES, DTYPE_BYTES, FIT_FRACTION, GiB, ModelSpec, Workload

# Host RAM constants (per process). CUDA: the CUDA/cuBLAS/NCCL libraries and context mapped into the process (typical,
# not measured here). CPU: python + torch + transformers + vlmrl with one model family, its tokenizer, PIL and a small
# data set loaded: the peak RSS of `vlmrl train` / `vlmrl sft` on the tiny model less its tensors (0.38-0.39 GiB,
# benchmarks/results/planner_accuracy_cpu_runs_*). CPU_ALLOCATOR_RESERVE: peak RSS over the planned tensor peak on the
# CPU (glibc heap fragmentation), from the mid-size GRPO / SFT runs of the same benchmark (12%).
HOST_RUNTIME_CUDA_BYTES = 3 * GiB
HOST_RUNTIME_CPU_BYTES = int(0.38 * GiB)
CPU_ALLOCATOR_RESERVE = 0.12
HOST_DATA_BYTES = 2 * GiB  # dataset, decoded images, tokenizer caches on a real run (typical, not measured)
# glibc malloc serves a block from its heap below a dynamic mmap threshold that grows up to 32 MiB on 64-bit Linux
# (DEFAULT_MMAP_THRESHOLD_MAX); larger blocks are mmapped and unmapped when freed, so they leave no heap slack behind.
GLIBC_MMAP_MAX_BYTES = 32 * 2**20

# Host terms alive while training (beside the runtime and the data).
TRAINING_TERMS = (
    "offloaded_optimizer_states",
    "engine_host_buffers",
    "offloaded_gradients",
    "offloaded_parameters",
    "parked_optimizer_states",
    "pinned_buffers",
    "reference_on_cpu",
    "images_and_rollout_buffers",
    "device_tensors_on_cpu",
    "vllm_sleeping_weights",
)


def parks(w: Workload) -> bool:
    """The optimizer states leave the device for rollout and scoring (they are not already offloaded; no SFT rollout)."""
    return w.offload_during_rollout and w.offload == "none" and w.mode != "sft"


def host_term_values(
    spec: ModelSpec,
    w: Workload,
    states: dict,
    step_buffers: float,
    device_peak: int,
    ref_on_cpu: bool,
    r: int,
    mmapped: int = 0,
    engine_host: int = 0,
    vllm_host: float = 0,
) -> dict:
    """The host terms of `r` processes on one node (bytes; see host_terms)."""
    n = w.world_size
    base_w = states["base_weights"]
    shards = n if w.sharding in ("zero1", "zero2", "zero3", "fsdp") else 1
    offloaded = w.offload != "none"
    cpu = w.device == "cpu"
    cpu_runtime = HOST_RUNTIME_CPU_BYTES if w.profile == "vlmrl" else TRAINER_CPU_RUNTIME_BYTES
    runtime = w.host_runtime_bytes or (cpu_runtime if cpu else HOST_RUNTIME_CUDA_BYTES)
    return {
        "runtime_per_process": runtime * r,
        "model_loading": r * base_w,  # each process's copy (the checkpoint's mapped pages are shared page cache)
        "offloaded_optimizer_states": (states["master"] + states["moments"]) * r if offloaded else 0,
        "engine_host_buffers": engine_host * r,  # an engine's own host buffers per process (DeepSpeed's offload: deepspeed.py)
        "offloaded_gradients": states["trainable"] * 4 / shards * r if offloaded else 0,  # float32 gradient partitions for CPU Adam
        "offloaded_parameters": base_w / n * r if w.offload == "optimizer+params" else 0,
        # memory.offload_optimizer_during_rollout: host buffers the states are parked in (kept from step to step)
        "parked_optimizer_states": (states["master"] + states["moments"]) * r if parks(w) else 0,
        "pinned_buffers": 4 * COMM_BUCKET_BYTES * r if offloaded else 0,
        # memory.ref_placement=cpu: the reference copy and the distillation teacher wait in host RAM
        "reference_on_cpu": (spec.total_params * DTYPE_BYTES[w.dtype] * r if ref_on_cpu else 0)
        + (w.teacher_params * DTYPE_BYTES[w.dtype] * r if w.teacher_params and w.ref_placement == "cpu" else 0),
        "images_and_rollout_buffers": step_buffers * r,
        "data": HOST_DATA_BYTES if not cpu else 0,
        "device_tensors_on_cpu": ((device_peak - mmapped) * (1 + CPU_ALLOCATOR_RESERVE) + mmapped) * r if cpu else 0,
        # save_pretrained copies device tensors to the CPU; CPU tensors of an unsharded run are written as they are
        "gathered_state_dict_at_save": base_w if (not cpu or w.sharding in ("zero3", "fsdp")) else 0,
        # a colocated vLLM asleep at level 1 keeps its weight copy in host RAM (plan.vllm.host_bytes); level 2 none
        "vllm_sleeping_weights": vllm_host * r,
    }


def host_terms(
    spec: ModelSpec,
    w: Workload,
    states: dict,
    step_buffers: float,
    device_peak: int,
    ref_on_cpu: bool,
    processes: int | None = None,
    mmapped: int = 0,
    engine_host: int = 0,
    vllm_host: float = 0,
) -> dict:
    """Host RAM of one node (min(world size, 8) processes), bytes, term by term, and its peak over three moments:
    loading (each process builds its copy on the CPU before moving it),
    training (runtime per process, CPU-offloaded optimizer / gradients / parameters, pinned transfer buffers, the
    reference model on the CPU, each process's images and rollout buffers, and on a CPU run every tensor the
    device plan counts), and saving (rank 0 gathers the full weights on the CPU for save_pretrained / export).
    mmapped: bytes of the device peak in blocks above GLIBC_MMAP_MAX_BYTES (CPU runs: no heap slack on them).
    engine_host: the engine's own host buffers of one process (DeepSpeed's offload buffers). vllm_host: a colocated
    vLLM engine's weights asleep in host RAM, one process's."""
    r = processes or min(w.world_size, 8)
    terms = host_term_values(spec, w, states, step_buffers, device_peak, ref_on_cpu, r, mmapped, engine_host, vllm_host)
    runtime = terms["runtime_per_process"] + terms["data"]
    training = runtime + sum(terms[k] for k in TRAINING_TERMS)
    phases = {"loading": runtime + terms["model_loading"], "training": training, "saving": training + terms["gathered_state_dict_at_save"]}
    out = {k: int(v) for k, v in terms.items()}
    out.update({f"peak_{k}": int(v) for k, v in phases.items()})
    out["total"] = int(max(phases.values()))
    if processes is None:  # one process's own peak (what its peak RSS measures); rank 0 gathers the state dict
        out["process_peak"] = host_terms(spec, w, states, step_buffers, device_peak, ref_on_cpu, 1, mmapped, engine_host, vllm_host)["total"]
    return out


def host_verdict(host: dict, host_memory_bytes: int | None) -> str:
    """The host RAM line of a verdict (fits / does not fit / no size given)."""
    total = host["total"]
    if not host_memory_bytes:
        return f"needs {total / GiB:.1f} GiB of host RAM per node (no host size given: --host-memory)"
    if total <= FIT_FRACTION * host_memory_bytes:
        return f"host RAM fits: {total / GiB:.1f} of {host_memory_bytes / GiB:.1f} GiB per node"
    return f"host RAM does NOT fit: {total / GiB:.1f} GiB needed of {host_memory_bytes / GiB:.1f} GiB per node"


def mmapped_at_peak(
    phases: dict, unit: float, kept: float, head_bwd: float, fwd_bwd: float, recompute: float, head_no_grad: float, score_transient: float
) -> int:
    """Bytes of the peak phase in the log-prob head's vocabulary-sized tensors when each is above glibc's mmap
    threshold ceiling (CPU runs: mmapped blocks leave no heap slack); 0 when they are smaller or not at the peak."""
    if unit < GLIBC_MMAP_MAX_BYTES:
        return 0
    top = max(phases, key=phases.get)
    if top == "update" and phases["update"] == int(fwd_bwd):
        return int(kept + (head_bwd if head_bwd >= recompute else 0))
    if top == "scoring" and head_no_grad >= score_transient:
        return int(head_no_grad)
    return 0
