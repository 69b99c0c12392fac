"""The memory planner's inputs: `ModelSpec` (an architecture as numbers), `Workload` (what one step does on one
device), the choices they accept, the device constants, and the check of a workload (one line per bad field).
Plain dataclasses; nothing here imports torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vlmrl.plan.profiles import LOGITS_POSITIONS, PROFILES

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHARDINGS = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
ATTENTIONS = ("sdpa", "flash_attention_2", "eager")
MASTER_WEIGHTS = ("auto", "none", "fp32")
OFFLOADS = ("none", "optimizer", "optimizer+params")

# Device constants (global, documented in docs/planner.md).
CUDA_CONTEXT_BYTES = int(0.6 * GiB)  # CUDA context + cuBLAS/cuDNN workspaces outside torch's allocator (typical, not measured)
ALLOCATOR_RESERVE = 0.06  # reserved / allocated - 1: mean of the ten Qwen2.5-VL-3B H100 runs in benchmarks/results (0.046 .. 0.089)
COMM_BUCKET_BYTES = 2 * 25 * 2**20  # DDP / ZeRO gradient buckets (2 x 25 MiB)
FIT_FRACTION = 0.95  # a config "fits" when its predicted device total is <= this fraction of the memory


class PlanError(ValueError):
    """Nothing fits / bad planner input; the message names the knobs."""


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ModelSpec:
    """An architecture as numbers. Parameter counts come from meta-device instantiation (spec_from_hf_config)."""

    name: str
    family: str
    total_params: int
    vision_params: int  # vision encoder including the projector / merger
    projector_params: int
    embed_params: int  # input token embedding
    lm_head_params: int  # 0 when tied to the input embedding
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    v_hidden: int = 0
    v_intermediate: int = 0
    v_layers: int = 0
    v_heads: int = 1
    patch_size: int = 14
    merge_size: int = 1  # spatial merge (Qwen-VL 2): image tokens = patches / merge^2
    temporal_patch: int = 1
    image_size: int = 0  # fixed-resolution towers (CLIP/SigLIP): side in pixels; 0 = dynamic resolution
    v_full_attn_blocks: int = -1  # vision blocks attending over the whole image (-1 = all); the others attend within windows
    v_window_patches: int = 0  # patches per attention window of the windowed blocks (Qwen2.5-VL: (112 / 14)^2 = 64)
    lora_linears: tuple = ()  # ((suffix, in_features, out_features, count), ...) of the language model's Linear layers
    tiling: str = ""  # "" (one tile per image), "anyres" (LLaVA-OneVision: base + pinpoint grid, unpadded, a newline per row), "dynamic" (InternVL)
    tile_pinpoints: tuple = ()  # anyres: the (height, width) canvases a grid of tiles may form (config.image_grid_pinpoints)
    anyres_max_tiles: int = 9  # anyres: above this many tiles' worth of features they are pooled down (config.vision_aspect_ratio anyres_max_N)
    max_tiles: int = 12  # dynamic: most tiles per image (the InternVL processor's max_patches; min 1; a thumbnail when more than one)
    v_block_hidden: int = 30  # vision block bytes per patch per hidden unit (c/2 units): 30 with 2-D RoPE (Qwen-VL), 20 without (InternViT, SigLIP)
    v_mlp_gated: bool = True  # vision MLP gated (SwiGLU: gate, up, act, product kept = 8 iv bytes per patch) or fc1 -> act -> fc2 (4 iv; Qwen2-VL)
    norms_per_layer: int = 2  # RMSNorms per decoder layer (Gemma 3: 4, around attention and around the MLP)
    gated_attention: bool = False  # Qwen3.5: (1 + weight) float32 RMSNorms, q/k norms and a sigmoid output gate from q_proj (see text_layer_bytes)
    linear_attn_layers: int = 0  # Qwen3.5: Gated DeltaNet (linear attention) layers among `layers`; the others are full attention
    linear_k_heads: int = 0  # Gated DeltaNet query / key heads
    linear_v_heads: int = 0  # Gated DeltaNet value heads (query / key heads are repeated to these in the chunked rule)
    linear_k_dim: int = 0  # Gated DeltaNet key head dim
    linear_v_dim: int = 0  # Gated DeltaNet value head dim
    linear_conv_kernel: int = 4  # Gated DeltaNet causal conv width (its cache keeps this many columns per channel)
    first_layer_linear: bool = False  # Qwen3.5: layer 0 is a linear-attention layer (see first_linear_layer_bytes)
    routed_expert_params: int = 0  # MoE: parameters of all routed experts (counted in total_params)
    experts_active_fraction: float = 1.0  # MoE: experts routed per token / experts (top_k / E)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: the total less the routed experts it is not sent to (MoE)."""
        return int(self.total_params - self.routed_expert_params * (1 - self.experts_active_fraction))

    @property
    def dynamic_resolution(self) -> bool:
        return self.image_size == 0

    def lora_params(self, r: int, targets: tuple | list, vision_linear_in_out: int = 0) -> int:
        all_linear = "all-linear" in targets
        n = sum(r * (i + o) * c for s, i, o, c in self.lora_linears if all_linear or s in targets)
        return n + r * vision_linear_in_out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Workload:
    """One GRPO step (mode sft: one `vlmrl sft` step, see sft_workload) on one device. Token counts are per prompt;
    rows are completions."""

    dtype: str = "bfloat16"
    autocast: bool = True  # bf16 autocast on the device (training.bf16)
    use_lora: bool = False
    lora_r: int = 16
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    freeze_vision: bool = False
    projector_only: bool = False
    gradient_checkpointing: bool = False
    num_generations: int = 4
    prompts_per_step: int = 2  # prompts per rollout step on this device
    micro_batch: int = 4  # rows per forward/backward
    grad_accum: int = 1
    prompts_per_call: int | None = None
    rollout_engine: str = "loop"  # rollout.engine: continuous holds the KV cache of decode_batch_size rows, not of every row
    decode_batch_size: int = 0  # rollout.decode_batch_size (0 = every row of a generate call)
    prompt_text_tokens: int = 64
    max_pixels: int = 448 * 448
    images_per_prompt: int = 1
    video_frames: int = 0  # frames of one video per prompt (data.max_frames); 0 = image prompts only (Qwen2-VL / Qwen2.5-VL)
    video_max_pixels: int = 128 * 28 * 28  # pixel cap per video frame (data.video_max_pixels)
    completion_tokens: int = 64  # new tokens of one model turn (multi-turn: tools.max_turn_tokens)
    tool_turns: int = 0  # multi-turn rollouts: tool turns per rollout (tools.max_turns - 1); 0 = single-turn
    tool_images_per_turn: int = 1  # images one tool turn returns (the built-in image tools return one)
    tool_text_tokens: int = 32  # text tokens a tool turn appends besides its image tokens (template glue, result text, next prompt)
    max_images: int = 8  # images per rollout, the row's included (tools.max_images)
    max_total_tokens: int = 0  # tokens after the prompt, model and tool turns together (tools.max_total_tokens); 0 = no cap
    logprob_chunk_tokens: int = 128
    group_vision: bool = True
    shared_prefix: bool = True
    beta: float = 0.0
    teacher_params: int = 0  # algorithm.teacher_path: the frozen teacher's parameters (held like a reference copy); 0 = no teacher
    judge_params: int = 0  # judge.model_path: the in-process reward judge's parameters (on the device all run); 0 = none or served
    judge_generate_bytes: int = (
        0  # the judge's greedy generate at judge.batch_size: KV cache and largest temporary (plan.config.judge_generate_bytes)
    )
    num_iterations: int = 1
    ref_placement: str = "device"
    sharding: str = "none"
    master_weights: str = "auto"  # auto | none | fp32: see master_weights_scheme
    attn_implementation: str = "sdpa"  # model.attn_implementation: sdpa / flash_attention_2 (fused) or eager ([B, heads, S, S] kept)
    generation_gather: str = "full"  # zero3/fsdp rollout: full = whole model gathered once, layers = one block at a time
    offload: str = "none"
    # DeepSpeed ZeRO settings of the run (plan.deepspeed.ZeroConfig, from the DeepSpeed config in use): plan() adds
    # ZeRO's own buffers; None plans a zero1/2/3 sharding without them
    zero: object = None
    offload_during_rollout: bool = False  # memory.offload_optimizer_during_rollout: states in host RAM for rollout + scoring
    world_size: int = 1
    gpu_memory_bytes: int | None = None
    host_memory_bytes: int | None = None  # host RAM per node; None = no host verdict
    device: str = "cuda"  # training.device: cpu puts every tensor in host RAM (the host plan is the plan)
    mode: str = "grpo"  # grpo | sft (vlmrl sft: no rollout; one row per prompt; see sft_workload)
    host_runtime_bytes: int | None = None  # per-process runtime RSS (libraries); None = HOST_RUNTIME_*_BYTES; a run measures its own
    profile: str = "vlmrl"  # vlmrl | naive | trl: whose step is planned (plan_profiles: a plain / TRL-style trainer's data path)
    logits_positions: str = "completion"  # profile naive: completion (logits_to_keep) | sequence (the LM head projects every position)
    # A colocated vLLM engine samples the rollouts (rollout.backend=vllm; plan.vllm): its cap as a share of the device
    # (0 = no vLLM: the trainer generates), its sleep level around the update (0 none, 1 weights to host RAM + KV
    # freed, 2 both discarded), its tensor-parallel size, images per prompt it is profiled for (limit_mm_per_prompt;
    # 0 = images_per_prompt) and its max_model_len (0 = prompt + completion)
    vllm_gpu_memory_utilization: float = 0.0
    vllm_sleep_level: int = 0
    vllm_tensor_parallel_size: int = 1
    vllm_limit_images: int = 0
    vllm_max_model_len: int = 0

    @property
    def rows_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations


def _multiturn_problems(w: Workload) -> list[str]:
    fields = ("tool_turns", "tool_images_per_turn", "tool_text_tokens", "max_images", "max_total_tokens")
    negative = [f"{f}={getattr(w, f)}" for f in fields if getattr(w, f) < 0]
    return [f"{', '.join(negative)}: multi-turn counts must be >= 0"] if negative else []


def check_workload(w: Workload) -> None:
    """PlanError listing every field of `w` outside its choices, each with the values it takes."""
    problems = _choice_problems(w) + _sharding_problems(w) + _zero_problems(w)
    if w.profile != "vlmrl" and w.mode == "sft":
        problems.append(f"profile={w.profile} plans another trainer's GRPO step: use mode grpo (SFT is planned for vlmrl sft only)")
    if w.video_frames < 0 or w.video_max_pixels < 1:
        problems.append("video_frames must be >= 0 and video_max_pixels >= 1")
    problems += _multiturn_problems(w)
    problems += _vllm_problems(w)
    if w.micro_batch < 1 or w.grad_accum < 1 or w.world_size < 1:
        problems.append("micro_batch, grad_accum and world_size must be >= 1")
    if problems:
        raise PlanError("invalid planner input:\n  - " + "\n  - ".join(problems))


def _choice_problems(w: Workload) -> list[str]:
    """Fields of `w` outside their fixed choices, in the order check_workload has always listed them."""
    choices = [
        ("sharding", SHARDINGS),
        ("offload", OFFLOADS),
        ("mode", ("grpo", "sft")),
        ("attn_implementation", ATTENTIONS),
        ("profile", PROFILES),
        ("logits_positions", LOGITS_POSITIONS),
        ("master_weights", MASTER_WEIGHTS),
        ("dtype", tuple(DTYPE_BYTES)),
    ]
    out = []
    for name, allowed in choices:
        value = getattr(w, name)
        if value not in allowed:
            out.append(f"{name}={value!r}: use grpo or sft" if name == "mode" else f"{name}={value!r}: use one of {', '.join(allowed)}")
    return out


def _sharding_problems(w: Workload) -> list[str]:
    out = []
    if w.offload == "optimizer+params" and w.sharding not in ("zero3", "fsdp"):
        out.append("offload=optimizer+params needs sharding zero3 or fsdp (parameters are offloaded shard by shard)")
    if w.offload != "none" and w.sharding in ("none", "ddp"):
        out.append(f"offload={w.offload} needs a ZeRO/FSDP sharding stage (zero1/2/3, fsdp)")
    return out


def _vllm_problems(w: Workload) -> list[str]:
    out = []
    if not 0.0 <= w.vllm_gpu_memory_utilization < 1.0 + 1e-9:
        out.append(f"vllm_gpu_memory_utilization={w.vllm_gpu_memory_utilization}: a share of the device in (0, 1] (0 = no vLLM)")
    if w.vllm_sleep_level not in (0, 1, 2):
        out.append(f"vllm_sleep_level={w.vllm_sleep_level}: use 0 (no sleep), 1 (weights to host RAM, KV freed) or 2 (both discarded)")
    if w.vllm_tensor_parallel_size < 1 or w.vllm_limit_images < 0 or w.vllm_max_model_len < 0:
        out.append("vllm_tensor_parallel_size must be >= 1, vllm_limit_images and vllm_max_model_len >= 0")
    return out


def _zero_problems(w: Workload) -> list[str]:
    """A DeepSpeed config (w.zero) whose ZeRO stage is not the sharding planned, or whose offload is not the offload
    planned (deepspeed.zero_offload)."""
    stage = getattr(w.zero, "stage", None)
    if stage and w.sharding != f"zero{stage}":
        return [f"sharding={w.sharding!r} but the DeepSpeed config (zero) asks for ZeRO-{stage}: use sharding zero{stage}"]
    if stage:
        offload = "optimizer+params" if (w.zero.offload_param and stage == 3) else ("optimizer" if w.zero.offload_optimizer else "none")
        if w.offload != offload:
            return [f"offload={w.offload!r} but the DeepSpeed config (zero) offloads {offload}: use offload {offload}"]
    return []


def sft_workload(base: Workload, stage: int, train_vision_tower: bool = False, target_tokens: int | None = None) -> Workload:
    """What one `vlmrl sft` step of `stage` does (src/vlmrl/sft.py): base.micro_batch rows (sft.batch_size), each with
    its own prompt and image (one vision pass per row, no shared prefix), the target's tokens as the completion,
    log-probs in base.logprob_chunk_tokens chunks (memory.logprob_chunk_tokens, as GRPO), one micro-batch per optimizer step, no rollout,
    no reference. Stage 1 trains the projector only; stage 2 the language model + projector (+ the vision tower with
    sft.train_vision_tower). With LoRA the stages train the same adapters (sft.py leaves them as they are)."""
    if stage not in (1, 2):
        raise PlanError(f"SFT stage {stage}: use 1 (projector only) or 2 (language model)")
    n = base.micro_batch
    stage_kw = {} if base.use_lora else {"projector_only": stage == 1, "freeze_vision": stage == 2 and not train_vision_tower}
    return dataclasses.replace(
        base,
        mode="sft",
        num_generations=1,
        prompts_per_step=n,
        micro_batch=n,
        grad_accum=1,
        prompts_per_call=None,
        group_vision=False,
        shared_prefix=False,
        beta=0.0,
        num_iterations=1,
        completion_tokens=target_tokens or base.completion_tokens,
        **stage_kw,
    )
