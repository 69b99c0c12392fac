"""The memory planner over a vlmrl Config: the Workload a config runs, its ModelSpec, device memory sizes (GPU names,
'80GiB'), and the plans of a GRPO run and of `vlmrl sft`'s stages."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from vlmrl.plan.estimate import Plan, plan
from vlmrl.plan.hf import model_spec, spec_from_hf_config
from vlmrl.plan.spec import DTYPE_BYTES, GiB, ModelSpec, PlanError, Workload, sft_workload
from vlmrl.plan.deepspeed import zero_config, zero_offload


# What torch.cuda.get_device_properties().total_memory reports (the memory a run can have), by marketing name.
# A card sold as "80GB" is neither 80e9 nor 80 x 2^30 bytes to PyTorch. h100-80gb was measured here (benchmarks/results/
# gpu_memory_*.json: 79.18 GiB; nvidia-smi shows 81559 MiB = 79.6 GiB, part of it the driver's); the others are the
# "total capacity" PyTorch prints in out-of-memory messages on those cards as commonly reported (not measured here).
GPU_MEMORY_GIB = {
    "h100-80gb": 79.18,
    "h100": 79.18,
    "h200": 139.8,
    "a100-80gb": 79.15,
    "a100-40gb": 39.39,
    "l40s": 44.53,
    "a6000": 47.54,
    "rtx4090": 23.65,
    "rtx3090": 23.69,
    "a10g": 22.2,
    "l4": 22.04,
    "v100-32gb": 31.75,
    "v100-16gb": 15.77,
    "t4": 14.75,
}


def parse_memory(text: str | float) -> int:
    """'80GiB', '80GB', '79.2 GiB', '81920MiB', '8e10', or a GPU name ('h100-80gb', GPU_MEMORY_GIB) -> bytes.
    GB = 10^9 (decimal, so '80GB' = 74.5 GiB), GiB = 2^30; a bare number is GiB."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    if str(text).strip().lower() in GPU_MEMORY_GIB:
        return int(GPU_MEMORY_GIB[str(text).strip().lower()] * GiB)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise PlanError(
            f"cannot read GPU memory {text!r}: write a size such as 80GiB, 80GB, 24GiB or 81920MiB, or a GPU name ({', '.join(GPU_MEMORY_GIB)})"
        )
    value, unit = float(m.group(1)), (m.group(2) or "GiB").upper()
    if unit == "B":
        return int(value)
    scale = {"K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    base = 1024 if "I" in unit else 1000
    return int(value * base**scale)


def multiturn_fields(cfg) -> dict:
    """Workload fields of tools.* (multi-turn rollouts): tool turns = max_turns - 1, each model turn max_turn_tokens
    long, one image per tool turn within tools.max_images, the sequence capped at tools.max_total_tokens. {} when the
    run is single-turn (no tools.tools, or a config from before tools existed)."""
    tools = getattr(cfg, "tools", None)
    if tools is None or not tools.tools:
        return {}
    return {
        "tool_turns": max(0, tools.max_turns - 1),
        "completion_tokens": tools.max_turn_tokens or cfg.rollout.max_completion_length,
        "max_images": tools.max_images,
        "max_total_tokens": tools.max_total_tokens,
    }


def workload_from_config(cfg, world_size: int = 1, gpu_memory_bytes: int | None = None, **extra) -> Workload:
    m, t, r, a, d, mem = cfg.model, cfg.training, cfg.rollout, cfg.algorithm, cfg.data, cfg.memory
    kw = dict(
        dtype=m.dtype,
        autocast=t.bf16,
        use_lora=m.use_lora,
        lora_r=m.lora_r,
        lora_targets=tuple(m.lora_target_modules),
        freeze_vision=m.freeze_vision_tower,
        projector_only=m.train_projector_only,
        gradient_checkpointing=m.gradient_checkpointing,
        # The config's batch sizes are global (docs/scaling_out.md): each of W processes rolls out 1/W of the prompts.
        num_generations=r.num_generations,
        prompts_per_step=max(1, cfg.prompts_per_step // max(1, world_size)),
        micro_batch=mem.max_tokens_per_micro_batch and max(1, mem.max_tokens_per_micro_batch // 512) or t.per_device_train_batch_size,
        grad_accum=t.gradient_accumulation_steps,
        prompts_per_call=mem.generation_prompts_per_call,
        rollout_engine=r.engine,
        decode_batch_size=r.decode_batch_size,
        max_pixels=d.max_pixels,
        images_per_prompt=1,
        video_max_pixels=d.video_max_pixels,
        completion_tokens=r.max_completion_length,
        logprob_chunk_tokens=mem.logprob_chunk_tokens,
        group_vision=mem.group_vision,
        shared_prefix=mem.shared_prefix,
        generation_gather=mem.generation_gather,
        attn_implementation=m.attn_implementation,
        beta=a.beta,
        teacher_params=teacher_params(a),
        **judge_fields(cfg),
        num_iterations=a.num_iterations,
        ref_placement=mem.ref_placement,
        offload_during_rollout=mem.offload_optimizer_during_rollout,
        world_size=world_size,
        gpu_memory_bytes=gpu_memory_bytes,
    )
    kw.update(multiturn_fields(cfg))
    kw.update(vllm_fields(cfg))
    host_gib = getattr(t, "auto_fit_host_memory_gib", None)
    if host_gib:
        kw["host_memory_bytes"] = int(host_gib * GiB)
    kw.update(extra)
    return Workload(**kw)


def vllm_fields(cfg) -> dict:
    """Workload fields of a colocated vLLM (rollout.backend=vllm): its cap, sleep level, tensor-parallel size, the
    images per prompt it is profiled for (data.limit_images) and its max_model_len. {} for the in-process decoder."""
    r = cfg.rollout
    if getattr(r, "backend", "inprocess") != "vllm":
        return {}
    return {
        "vllm_gpu_memory_utilization": r.vllm_gpu_memory_utilization,
        "vllm_sleep_level": getattr(r, "vllm_sleep_level", 0),
        "vllm_tensor_parallel_size": getattr(r, "vllm_tensor_parallel_size", 1),
        "vllm_limit_images": cfg.data.limit_images,
        "vllm_max_model_len": getattr(r, "vllm_max_model_length", None) or 0,
    }


def teacher_params(algo) -> int:
    """Parameters of algorithm.teacher_path's model (its config.json), 0 without a teacher."""
    path = getattr(algo, "teacher_path", None)
    return model_spec(path).total_params if path else 0


def judge_fields(cfg) -> dict:
    """Workload's judge_params and judge_generate_bytes for an in-process reward judge (judge.model_path with the
    reward `judge` listed); none for a served judge or none at all."""
    judge = getattr(cfg, "judge", None)
    if judge is None or not judge.model_path or "judge" not in cfg.algorithm.reward_funcs:
        return {}
    spec = model_spec(judge.model_path)
    # the judge's prompt: the row's image tokens, the template, the question and the completion it grades
    image_tokens = (cfg.data.max_pixels or 448 * 448) // (spec.patch_size * max(1, spec.merge_size)) ** 2
    prompt = image_tokens + len(judge.template) // 3 + 64 + cfg.rollout.max_completion_length
    return {
        "judge_params": spec.total_params,
        "judge_generate_bytes": judge_generate_bytes(spec, judge.batch_size, prompt, judge.max_new_tokens, DTYPE_BYTES[cfg.model.dtype]),
    }


def judge_generate_bytes(spec: ModelSpec, batch: int, prompt_tokens: int, new_tokens: int, dtype_bytes: int) -> int:
    """Bytes of one greedy generate of `batch` rows: the KV cache of k and v per full-attention layer over prompt +
    new tokens, plus the larger of a prefill layer's MLP / attention temporaries and the float32 logits (3 per row)."""
    kv = batch * (prompt_tokens + new_tokens) * 2 * (spec.layers - spec.linear_attn_layers) * spec.kv_heads * spec.head_dim * dtype_bytes
    prefill = batch * prompt_tokens * dtype_bytes * (4 * spec.hidden + 3 * spec.intermediate)
    return int(kv + max(prefill, batch * spec.vocab * 4 * 3))


def spec_for_config(cfg) -> ModelSpec:
    name = cfg.model.name_or_path
    if name.startswith("embedded:"):
        from vlmrl.tiny_models.tiny import default_model_path

        path = default_model_path()
        if not (Path(path) / "config.json").is_file():
            raise PlanError(f"{name}: the embedded tiny model is not built yet ({path}); run vlmrl demo once, or plan with --model")
        return spec_from_hf_config(path, name)
    return model_spec(name)


def zero_extra(spec: ModelSpec, deepspeed: dict | None, extra: dict) -> dict:
    """extra + the ZeroConfig of the DeepSpeed config in use (its "auto" sizes from the model's hidden size) and the
    offload it asks for."""
    if deepspeed is None:
        return extra

    z = zero_config(deepspeed, spec.hidden)
    return {"offload": zero_offload(z)} | extra | {"zero": z}


def plan_for_config(cfg, world_size: int = 1, gpu_memory_bytes: int | None = None, deepspeed: dict | None = None, **extra) -> Plan:
    """Plan of a vlmrl Config (training.auto_fit_gpu_memory_gib is used when gpu_memory_bytes is None). deepspeed: the
    DeepSpeed config dict of a ZeRO run (with sharding zero1/2/3): ZeRO's own buffers are planned from it."""
    if gpu_memory_bytes is None:
        gib = getattr(cfg.training, "auto_fit_gpu_memory_gib", None)
        gpu_memory_bytes = int(gib * GiB) if gib else None
    spec = spec_for_config(cfg)
    return plan(spec, workload_from_config(cfg, world_size, gpu_memory_bytes, **zero_extra(spec, deepspeed, extra)))


def sft_plans_for_config(
    cfg, gpu_memory_bytes: int | None = None, target_tokens: int | None = None, world_size: int = 1, deepspeed: dict | None = None, **extra
) -> dict:
    """{stage: Plan} for the stages cfg.sft runs (sft.projector_steps > 0: stage 1, sft.steps > 0: stage 2). The
    target length is `target_tokens` (vlmrl sft measures its data) or rollout.max_completion_length. With several
    processes each runs sft.batch_size / world_size rows (sft.micro_batch_size when smaller); deepspeed as in
    plan_for_config."""
    s = cfg.sft
    spec = spec_for_config(cfg)
    base = workload_from_config(cfg, world_size, gpu_memory_bytes, **zero_extra(spec, deepspeed, extra))
    micro = min(s.micro_batch_size or s.batch_size // world_size, s.batch_size // world_size) if world_size > 1 else s.batch_size
    base = dataclasses.replace(base, micro_batch=max(1, micro))
    stages = [k for k, steps in ((1, s.projector_steps), (2, s.steps)) if steps > 0]
    return {k: plan(spec, sft_workload(base, k, s.train_vision_tower, target_tokens)) for k in stages}


def device_memory_bytes(cfg) -> int:
    """training.auto_fit_gpu_memory_gib, else the capacity of the CUDA device the run will use."""
    gib = getattr(cfg.training, "auto_fit_gpu_memory_gib", None)
    if gib is not None:
        return int(gib * GiB)
    import torch

    dev = cfg.training.device
    if dev != "cpu" and torch.cuda.is_available():
        index = int(dev.split(":", 1)[1]) if dev.startswith("cuda:") else 0
        return int(torch.cuda.get_device_properties(index).total_memory)
    raise PlanError("auto_fit needs the device memory: set training.auto_fit_gpu_memory_gib (required without CUDA)")
