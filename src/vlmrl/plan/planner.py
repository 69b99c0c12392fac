"""Memory planner: the per-device GPU peak of a GRPO or SFT step and the host RAM per node, term by term, before launch.

Pure arithmetic on two plain dataclasses: `ModelSpec` (numbers describing an architecture) and `Workload`
(what one step does). Nothing here imports torch, transformers, accelerate, deepspeed or vllm at module
level; `spec_from_hf_config` imports torch/transformers lazily to count parameters on the meta device.

Where the coefficients come from: the per-token activation bytes of a decoder layer / vision block were
read off the exact trace (`vlmrl.plan.trace`, a real forward + backward of the real modules on the meta
device) by varying one dimension at a time, and written as functions of the dimensions (see docs/planner.md).
Two global constants describe the CUDA device and were fit to the H100 measurements in benchmarks/results
(`ALLOCATOR_RESERVE`, the caching allocator's reserved-over-allocated ratio) or taken as a typical value
(`CUDA_CONTEXT_BYTES`, not measured here). Nothing is fit per configuration.

Main entry points:
  plan(spec, workload) -> Plan                 terms (bytes), peaks per phase, host terms, verdict (device and host)
  sft_workload(base, stage) -> Workload        what one `vlmrl sft` step of stage 1 / 2 does
  model_states / host_terms / eager_attention_bytes   the pieces, each documented with its formula
  plan_for_config(cfg, world_size, gpu_memory_bytes) -> Plan
  search(spec, workload, allow=...) -> ranked feasible candidates (step-time model)
  auto_fit(cfg, gpu_memory_bytes, world_size) -> (new_cfg, changes)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from vlmrl.plan.profiles import (
    LOGITS_POSITIONS,
    PROFILES,
    TRAINER_CPU_RUNTIME_BYTES,
    logprob_head_bytes,
    pixel_copies_bytes,
    profile_workload,
)

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

# Step-time model constants (H100-class; only the ranking of candidates uses them).
PEAK_FLOPS = 989e12 * 0.40  # bf16 dense x an assumed 40% utilisation
HBM_BYTES_PER_S = 3.35e12
PCIE_BYTES_PER_S = 25e9
INTERCONNECT_BYTES_PER_S = 300e9
CPU_ADAM_PARAMS_PER_S = 1.0e9


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
    completion_tokens: int = 64
    logprob_chunk_tokens: int = 128
    group_vision: bool = True
    shared_prefix: bool = True
    beta: float = 0.0
    num_iterations: int = 1
    ref_placement: str = "device"
    sharding: str = "none"
    master_weights: str = "auto"  # auto | none | fp32: see master_weights_scheme
    attn_implementation: str = "sdpa"  # model.attn_implementation: sdpa / flash_attention_2 (fused) or eager ([B, heads, S, S] kept)
    generation_gather: str = "full"  # zero3/fsdp rollout: full = whole model gathered once, layers = one block at a time
    offload: str = "none"
    offload_during_rollout: bool = False  # memory.offload_optimizer_during_rollout: states in host RAM for rollout + scoring
    world_size: int = 1
    gpu_memory_bytes: int | None = None
    host_memory_bytes: int | None = None  # host RAM per node; None = no host verdict
    device: str = "cuda"  # training.device: cpu puts every tensor in host RAM (the host plan is the plan)
    mode: str = "grpo"  # grpo | sft (vlmrl sft: no rollout; one row per prompt; see sft_workload)
    host_runtime_bytes: int | None = None  # per-process runtime RSS (libraries); None = HOST_RUNTIME_*_BYTES; a run measures its own
    profile: str = "vlmrl"  # vlmrl | naive | trl: whose step is planned (plan_profiles: a plain / TRL-style trainer's data path)
    logits_positions: str = "completion"  # profile naive: completion (logits_to_keep) | sequence (the LM head projects every position)

    @property
    def rows_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations


def image_patches(spec: ModelSpec, max_pixels: int) -> int:
    """Vision patches of one image at the pixel cap (dynamic resolution) or at the tower's fixed size."""
    if spec.v_layers == 0:
        return 0
    if not spec.dynamic_resolution:
        tiles = tiled_image(spec, *square_image(max_pixels))[0] if spec.tiling else 1
        return tiles * (spec.image_size // spec.patch_size) ** 2
    unit = spec.patch_size * spec.merge_size
    side_units = max(1, int(math.isqrt(max(max_pixels, unit * unit)) // unit))  # square image, multiples of patch*merge
    return (side_units * spec.merge_size) ** 2


def image_tokens(spec: ModelSpec, max_pixels: int) -> int:
    """LLM tokens of one image at the pixel cap (a square; tiled families: their tiles of that square)."""
    if spec.tiling and spec.v_layers:
        return tiled_image(spec, *square_image(max_pixels))[1]
    return image_patches(spec, max_pixels) // (spec.merge_size**2)


def square_image(max_pixels: int) -> tuple[int, int]:
    """(height, width) of the square image at the pixel cap the planner assumes."""
    side = max(1, math.isqrt(max(max_pixels, 1)))
    return side, side


def best_pinpoint(height: int, width: int, pinpoints: tuple) -> tuple[int, int]:
    """The anyres canvas (height, width) an image is fitted into: the one that keeps most of the image's pixels once it
    is scaled (aspect kept) to fit, and among those the one with the fewest unused pixels."""
    best, best_key = (0, 0), None
    for ch, cw in pinpoints:
        scale = min(cw / width, ch / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        key = (kept, -(ch * cw - kept))
        if best_key is None or key > best_key:
            best, best_key = (ch, cw), key
    return best


def anyres_image(spec: ModelSpec, height: int, width: int) -> tuple[int, int]:
    """(tiles the tower encodes, LLM tokens) of one image under LLaVA-OneVision's anyres: the base image (one tile)
    plus the grid of tiles of its best canvas; the grid's features are cropped to the image's aspect (the padding
    removed), pooled down when they exceed anyres_max_tiles tiles' worth by more than 10%, and end each row with a
    newline token."""
    side = spec.image_size // spec.patch_size  # features per tile side
    ch, cw = best_pinpoint(height, width, spec.tile_pinpoints)
    rows, cols = ch // spec.image_size, cw // spec.image_size
    fh, fw = side * rows, side * cols
    if width * fh > fw * height:  # wider than the canvas: rows of padding above and below
        fh -= 2 * ((fh - int(round(height * fw / width, 7))) // 2)
    else:
        fw -= 2 * ((fw - int(round(width * fh / height, 7))) // 2)
    ratio = math.sqrt(fh * fw / (spec.anyres_max_tiles * side * side))
    if ratio > 1.1:
        fh, fw = int(fh // ratio), int(fw // ratio)
    return 1 + rows * cols, fh * fw + fh + side * side


def dynamic_tiles(height: int, width: int, tile: int, max_tiles: int, min_tiles: int = 1) -> int:
    """Tiles InternVL's processor cuts an image into: the grid (columns x rows, min_tiles..max_tiles tiles) whose aspect is
    closest to the image's (on a tie the larger grid, while the image covers more than half of it), plus a thumbnail
    of the whole image when the grid has more than one tile."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if min_tiles <= c * r <= max_tiles]
    grids.sort(key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff or (diff == best_diff and area > 0.5 * tile * tile * c * r):
            best, best_diff = (c, r), min(diff, best_diff)
    n = best[0] * best[1]
    return n + (n > 1)


def tiled_image(spec: ModelSpec, height: int, width: int) -> tuple[int, int]:
    """(tiles the tower encodes, LLM tokens) of one height x width image of a tiled family (spec.tiling)."""
    per_tile = (spec.image_size // spec.patch_size) ** 2
    if spec.tiling == "anyres":
        return anyres_image(spec, height, width)
    if spec.tiling == "dynamic":
        tiles = dynamic_tiles(height, width, spec.image_size, spec.max_tiles)
        return tiles, tiles * per_tile // spec.merge_size**2
    return 1, per_tile // spec.merge_size**2


# Qwen3-VL / Qwen3.5 write `<t seconds>` and a vision start/end pair around each temporal patch of a video: text tokens
# per temporal patch (an estimate: "<0.5 seconds>" is about 6 tokens of a Qwen tokenizer, plus the 2 markers).
TIMESTAMPED_VIDEO_FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
TIMESTAMP_TEXT_TOKENS = 8
# Families whose video rows the planner counts (Qwen-VL temporal patches, checked against the trace); vlmrl also trains
# video rows on LLaVA-OneVision and InternVL, which `vlmrl plan` does not model yet.
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", *TIMESTAMPED_VIDEO_FAMILIES)
# Families with vlmrl's grouped-vision and shared-prefix paths (logprobs.grouped_family); the others (SmolVLM, Idefics3,
# ...) take the naive path: every row encodes its own copy of its prompt's images, no shared prefix.
FAST_PATH_FAMILIES = (
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "llava", "llava_onevision", "internvl"
)  # fmt: skip


def video_grid(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(temporal patches, patches of one frame) of one prompt's video: ceil(frames / temporal_patch) temporal
    patches (the processor repeats the last frame of an odd count), each frame a square at w.video_max_pixels."""
    if w.video_frames <= 0 or spec.v_layers == 0:
        return 0, 0
    return -(-w.video_frames // max(spec.temporal_patch, 1)), image_patches(spec, w.video_max_pixels)


def naive_fallback(spec: ModelSpec, w: Workload) -> tuple[Workload, bool, list]:
    """(the workload as vlmrl runs it, whether grouped vision / the shared prefix fell back, notes): a family without
    vlmrl's fast paths (not in FAST_PATH_FAMILIES) runs the naive path whatever memory.group_vision / shared_prefix
    say, as vlmrl logs (families.FALLBACK_REASONS)."""
    if not (spec.v_layers > 0 and spec.family not in FAST_PATH_FAMILIES and (w.group_vision or w.shared_prefix)):
        return w, False, []
    note = f"{spec.family}: grouped vision and the shared prefix fall back to the naive path (vision encoded per row)"
    return dataclasses.replace(w, group_vision=False, shared_prefix=False), True, [note]


def vision_encodes(spec: ModelSpec, w: Workload, unique: int, prefix: bool) -> tuple[int, bool]:
    """(prompt encodes of one micro-batch's vision pass, whether it is the naive video path). Grouped vision encodes
    each of the `unique` prompts once; a batch with videos takes the naive path (each of the micro-batch's rows encodes
    its own copy of its prompt's pixels) unless the shared prefix runs, whose prefill encodes each video once."""
    if w.video_frames and spec.family not in VIDEO_FAMILIES:
        raise PlanError(f"video rows: the planner models videos on {', '.join(VIDEO_FAMILIES)} only, not {spec.family or spec.name}")
    naive_video = w.video_frames > 0 and not prefix
    return (unique if (w.group_vision and not naive_video) else w.micro_batch), naive_video


def video_text_tokens(spec: ModelSpec, w: Workload) -> int:
    """Text tokens a prompt's video adds besides its vision tokens (Qwen3-VL / Qwen3.5 timestamps and markers)."""
    return video_grid(spec, w)[0] * TIMESTAMP_TEXT_TOKENS if spec.family in TIMESTAMPED_VIDEO_FAMILIES else 0


def prompt_vision(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(vision patches, LLM vision tokens) of one prompt: its images at w.max_pixels + its video (video_grid)."""
    t, frame = video_grid(spec, w)
    patches = image_patches(spec, w.max_pixels) * w.images_per_prompt + t * frame
    return patches, image_tokens(spec, w.max_pixels) * w.images_per_prompt + t * frame // spec.merge_size**2


# ---------------------------------------------------------------- per-token activation coefficients (bytes)


def text_layer_bytes(spec: ModelSpec, w: Workload, cbytes: int) -> float:
    """Bytes one decoder layer keeps for backward per token (no checkpointing).

    Full fine-tuning: two RMSNorms (fp32 copy + normalised input + output: 16h), q after RoPE, k and v
    repeated to the query heads, attention output and its contiguous copy (10 x heads*head_dim), the gated
    MLP's gate, up, act and product (8i), the float32 log-sum-exp per head (4 heads), less 2h the trace does
    not keep. LoRA (fp32 adapters): each adapted Linear keeps a float32 copy of its input (half that under
    autocast, which casts it back to bf16) plus r floats, while the frozen norms and base Linears stop
    keeping 6h + 2*heads*head_dim + 2i."""
    h, i, qd = spec.hidden, spec.intermediate, spec.heads * spec.head_dim
    s = cbytes / 2
    extra_norms = spec.norms_per_layer - 2
    full = s * (14 * h + 8 * h * extra_norms + 10 * qd + 8 * i) + 4 * spec.heads
    if spec.gated_attention:
        # Qwen3.5's full-attention layer (read off the trace one dimension at a time): its (1 + weight) float32 norms keep
        # 20h, q_proj's doubled output (query + gate), the q/k norms, the gate's sigmoid and product 20 qd, k and v 8 per
        # KV dimension (the fused kernels read them grouped), the MLP 8i.
        full = s * (20 * h + 20 * qd + 8 * spec.kv_heads * spec.head_dim + 8 * i) + 4 * spec.heads
    in_dims = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": qd, "gate_proj": h, "up_proj": h, "down_proj": i}
    # Under LoRA Qwen3.5's frozen float32 norms drop 12h (the weight's share) and the gated attention 8 qd.
    frozen = 12 * h + 8 * qd + 2 * i if spec.gated_attention else 6 * h + 3 * h * extra_norms + 2 * qd + 2 * i
    return full + _lora_layer_delta(spec, w, cbytes, in_dims, frozen)


def _lora_layer_delta(spec: ModelSpec, w: Workload, cbytes: int, in_dims: dict, frozen: float) -> float:
    """LoRA's change to a decoder layer's bytes per token: each adapted Linear keeps a float32 copy of its input (half
    that under autocast) plus r floats, while the frozen norms and base Linears stop keeping `frozen` (in c/2 units)."""
    if not w.use_lora:
        return 0.0
    copy = 2 if w.autocast else 4
    all_linear = "all-linear" in w.lora_targets
    adapted = [d for n, d in in_dims.items() if all_linear or n in w.lora_targets]
    return copy * sum(adapted) + 4 * w.lora_r * len(adapted) - cbytes / 2 * frozen


LINEAR_ATTN_CHUNK = 64  # transformers' chunked gated delta rule: tokens per chunk (each row padded to a multiple)


def linear_layer_bytes(spec: ModelSpec, w: Workload, cbytes: int) -> tuple[float, float]:
    """Bytes a Gated DeltaNet (linear-attention) decoder layer of Qwen3.5 keeps for backward: (per token, per token of
    each row padded to a multiple of LINEAR_ATTN_CHUNK), read off the trace one dimension at a time.

    Per token: the norms and the MLP (20h + 8i in c/2 units, as the full-attention layer), the causal conv's input and
    output (2c per q, k, v channel), the gated RMSNorm of the output ((12 + 3c) per value dimension: float32 input, gate
    and its SiLU, cast products), beta and the decay (36 bytes per value head). Per padded token, in float32, per value
    head (query and key heads are repeated to the value heads): q, k before and after the L2 norm, scaling and decay,
    k x beta and the solved k (8 dk); v, the solved values and each chunk's corrected values (3 dv); five chunk x chunk
    matrices (the decay mask, the UT system, the intra-chunk attention and their factors: 5 x 64); and the recurrent
    state each chunk writes ([dk, dv] per chunk: dk dv / 64 per token)."""
    h, i = spec.hidden, spec.intermediate
    k_dim, v_dim = spec.linear_k_heads * spec.linear_k_dim, spec.linear_v_heads * spec.linear_v_dim
    dk, dv = spec.linear_k_dim, spec.linear_v_dim
    per_token = cbytes / 2 * (20 * h + 8 * i) + 2 * cbytes * (2 * k_dim + v_dim) + (12 + 3 * cbytes) * v_dim + 36 * spec.linear_v_heads
    per_padded = 4 * spec.linear_v_heads * (8 * dk + 3 * dv + 5 * LINEAR_ATTN_CHUNK + dk * dv / LINEAR_ATTN_CHUNK)
    in_dims = {"in_proj_qkv": h, "in_proj_z": h, "in_proj_a": h, "in_proj_b": h, "out_proj": v_dim, "gate_proj": h, "up_proj": h, "down_proj": i}
    return per_token + _lora_layer_delta(spec, w, cbytes, in_dims, 12 * h + 2 * v_dim + 2 * i), per_padded


def first_linear_layer_bytes(spec: ModelSpec, w: Workload, cbytes: int) -> float | None:
    """LoRA without adapters in the Gated DeltaNet mixer (the default targets): layer 0's input needs no gradient, so
    when it is a linear-attention layer its mixer and norms keep nothing; its MLP keeps its gated activations (8i) and
    its adapters' inputs. None when this does not apply (layer 0 keeps what every linear-attention layer keeps)."""
    mixer = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
    if not (w.use_lora and spec.first_layer_linear) or "all-linear" in w.lora_targets or any(m in w.lora_targets for m in mixer):
        return None
    h, i = spec.hidden, spec.intermediate
    return cbytes / 2 * 8 * i + _lora_layer_delta(spec, w, cbytes, {"gate_proj": h, "up_proj": h, "down_proj": i}, 0)


def linear_state_bytes(spec: ModelSpec, cbytes: int) -> float:
    """One row's Gated DeltaNet cache over all linear-attention layers: the causal conv's last columns (compute dtype)
    and the float32 recurrent state [v_heads, dk, dv] (no sequence axis: the same for any length)."""
    conv = (2 * spec.linear_k_heads * spec.linear_k_dim + spec.linear_v_heads * spec.linear_v_dim) * spec.linear_conv_kernel * cbytes
    return spec.linear_attn_layers * (conv + 4 * spec.linear_v_heads * spec.linear_k_dim * spec.linear_v_dim)


def vision_block_bytes(spec: ModelSpec, cbytes: int) -> float:
    """Bytes one vision block keeps per patch (trainable tower, no checkpointing): fused qkv kept whole,
    RoPE'd q/k, attention output + copy, two norms (30 hv), the MLP (gated: 8 iv; Qwen2-VL's fc1 -> quick_gelu -> fc2:
    4 iv, read off the trace of qwen2-vl-2b), fp32 lse per head."""
    s = cbytes / 2
    mlp = 8 if spec.v_mlp_gated else 4
    return s * (spec.v_block_hidden * spec.v_hidden + mlp * spec.v_intermediate) + 4 * spec.v_heads


# ---------------------------------------------------------------- the plan


@dataclass
class Plan:
    terms: dict  # name -> bytes (per device)
    phases: dict  # rollout / scoring / update -> peak bytes allocated
    peak_allocated: int
    reserved: int  # peak_allocated x (1 + ALLOCATOR_RESERVE): compare with torch.cuda.max_memory_reserved
    total: int  # reserved + CUDA context: what must fit on the device
    host: dict  # host RAM terms per node (bytes)
    gpu_memory_bytes: int | None
    verdict: str
    headroom: int | None
    notes: list = field(default_factory=list)
    workload: dict = field(default_factory=dict)
    step_time_s: float = 0.0

    @property
    def fits(self) -> bool:
        """Fits on the device and, when a host size is given, in host RAM (on a CPU run: in host RAM only)."""
        host_ok = self.host_fits is not False
        if self.workload.get("device") == "cpu":
            return bool(self.host_fits)
        return self.gpu_memory_bytes is not None and self.total <= FIT_FRACTION * self.gpu_memory_bytes and host_ok

    @property
    def host_fits(self) -> bool | None:
        size = self.workload.get("host_memory_bytes")
        return None if not size else self.host["total"] <= FIT_FRACTION * size

    def to_dict(self) -> dict:
        gib = lambda b: round(b / GiB, 3)
        return {
            "verdict": self.verdict,
            "fits": self.fits if (self.gpu_memory_bytes or self.host_fits is not None) else None,
            "host_fits": self.host_fits,
            "host_total_gib": gib(self.host["total"]),
            "total_gib": gib(self.total),
            "reserved_gib": gib(self.reserved),
            "peak_allocated_gib": gib(self.peak_allocated),
            "gpu_memory_gib": gib(self.gpu_memory_bytes) if self.gpu_memory_bytes else None,
            "headroom_gib": gib(self.headroom) if self.headroom is not None else None,
            "phases_gib": {k: gib(v) for k, v in self.phases.items()},
            "terms_gib": {k: gib(v) for k, v in self.terms.items()},
            "host_gib": {k: gib(v) for k, v in self.host.items()},
            "step_time_s": round(self.step_time_s, 3),
            "notes": list(self.notes),
            "workload": self.workload,
        }


def _check(w: Workload) -> None:
    problems = []
    if w.sharding not in SHARDINGS:
        problems.append(f"sharding={w.sharding!r}: use one of {', '.join(SHARDINGS)}")
    if w.offload not in OFFLOADS:
        problems.append(f"offload={w.offload!r}: use one of {', '.join(OFFLOADS)}")
    if w.offload == "optimizer+params" and w.sharding not in ("zero3", "fsdp"):
        problems.append("offload=optimizer+params needs sharding zero3 or fsdp (parameters are offloaded shard by shard)")
    if w.offload != "none" and w.sharding in ("none", "ddp"):
        problems.append(f"offload={w.offload} needs a ZeRO/FSDP sharding stage (zero1/2/3, fsdp)")
    if w.mode not in ("grpo", "sft"):
        problems.append(f"mode={w.mode!r}: use grpo or sft")
    if w.attn_implementation not in ATTENTIONS:
        problems.append(f"attn_implementation={w.attn_implementation!r}: use one of {', '.join(ATTENTIONS)}")
    if w.profile not in PROFILES:
        problems.append(f"profile={w.profile!r}: use one of {', '.join(PROFILES)}")
    if w.logits_positions not in LOGITS_POSITIONS:
        problems.append(f"logits_positions={w.logits_positions!r}: use one of {', '.join(LOGITS_POSITIONS)}")
    if w.profile != "vlmrl" and w.mode == "sft":
        problems.append(f"profile={w.profile} plans another trainer's GRPO step: use mode grpo (SFT is planned for vlmrl sft only)")
    if w.master_weights not in MASTER_WEIGHTS:
        problems.append(f"master_weights={w.master_weights!r}: use one of {', '.join(MASTER_WEIGHTS)}")
    if w.dtype not in DTYPE_BYTES:
        problems.append(f"dtype={w.dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    if w.video_frames < 0 or w.video_max_pixels < 1:
        problems.append("video_frames must be >= 0 and video_max_pixels >= 1")
    if w.micro_batch < 1 or w.grad_accum < 1 or w.world_size < 1:
        problems.append("micro_batch, grad_accum and world_size must be >= 1")
    if problems:
        raise PlanError("invalid planner input:\n  - " + "\n  - ".join(problems))


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


def sft_plans_for_config(cfg, gpu_memory_bytes: int | None = None, target_tokens: int | None = None, **extra) -> dict:
    """{stage: Plan} for the stages cfg.sft runs (sft.projector_steps > 0: stage 1, sft.steps > 0: stage 2). The
    target length is `target_tokens` (vlmrl sft measures its data) or rollout.max_completion_length."""
    s = cfg.sft
    base = workload_from_config(cfg, 1, gpu_memory_bytes, **extra)
    base = dataclasses.replace(base, micro_batch=s.batch_size)
    spec = spec_for_config(cfg)
    stages = [k for k, steps in ((1, s.projector_steps), (2, s.steps)) if steps > 0]
    return {k: plan(spec, sft_workload(base, k, s.train_vision_tower, target_tokens)) for k in stages}


def master_weights_scheme(w: Workload) -> str:
    """'none' (AdamW on the weights themselves, states in their dtype) or 'fp32' (a float32 master copy of every
    trainable parameter + float32 moments). 'auto' is what vlmrl runs under each engine: torch AdamW on the weights
    without DeepSpeed (none, ddp) and under FSDP2 (mixed_precision "no"); DeepSpeed ZeRO-1/2/3 always keep float32
    partitions for the optimizer, whatever the weights' dtype."""
    if w.master_weights != "auto":
        return w.master_weights
    return "fp32" if w.sharding in ("zero1", "zero2", "zero3") else "none"


def eager_attention_bytes(spec: ModelSpec, w: Workload, cb: int, rows: tuple, vis_images: int, patches_per_image: int) -> dict:
    """Eager attention's score tensors (model.attn_implementation=eager), bytes.

    transformers' eager_attention_forward (Qwen2-VL / Qwen2.5-VL text and vision) computes scores = q k^T in the
    compute dtype, softmax(scores, dtype=float32) and casts the probabilities back: backward keeps the float32
    softmax output and the cast probabilities, (4 + c) bytes per [heads, query, key] element, per layer call. The
    fused kernels (sdpa, flash) keep a float32 log-sum-exp per head and query instead (in text_layer_bytes /
    vision_block_bytes), so that is taken off. rows: ((rows, queries, keys), ...) of one decoder layer's attention
    calls (prompt pass and completion pass on the shared-prefix path). Returns text / vision bytes kept for
    backward over all layers, one layer's worth (what checkpointing recomputes), and the no-grad transient of one
    layer call (scores in c, float32 softmax, cast probabilities)."""
    if w.attn_implementation != "eager":
        return {"text": 0, "vision": 0, "text_layer": 0, "vision_block": 0, "transient": 0}
    per = 4 + cb
    pairs = sum(r * q * k for r, q, k in rows)
    queries = sum(r * q for r, q, k in rows)
    text_layer = spec.heads * (pairs * per - 4 * queries)
    vision_block = 0.0
    if spec.v_layers and patches_per_image:
        full = spec.v_layers if spec.v_full_attn_blocks < 0 else spec.v_full_attn_blocks
        window = min(spec.v_window_patches or patches_per_image, patches_per_image)
        elems = full * patches_per_image**2 + (spec.v_layers - full) * patches_per_image * window
        vision_block = spec.v_heads * vis_images * (elems * per - 4 * spec.v_layers * patches_per_image) / spec.v_layers
    return {
        "text": (spec.layers - spec.linear_attn_layers) * text_layer,  # Qwen3.5's linear-attention layers have no scores
        "vision": spec.v_layers * vision_block,
        "text_layer": text_layer,
        "vision_block": vision_block,
        "transient": spec.heads * max(r * q * k for r, q, k in rows) * (2 * cb + 4),
    }


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


def host_terms(
    spec: ModelSpec,
    w: Workload,
    states: dict,
    step_buffers: float,
    device_peak: int,
    ref_on_cpu: bool,
    processes: int | None = None,
    mmapped: int = 0,
) -> dict:
    """Host RAM of one node (min(world size, 8) processes), bytes, term by term, and its peak over three moments:
    loading (each process builds its copy on the CPU before moving it),
    training (runtime per process, CPU-offloaded optimizer / gradients / parameters, pinned transfer buffers, the
    reference model on the CPU, each process's images and rollout buffers, and on a CPU run every tensor the
    device plan counts), and saving (rank 0 gathers the full weights on the CPU for save_pretrained / export).
    mmapped: bytes of the device peak in blocks above GLIBC_MMAP_MAX_BYTES (CPU runs: no heap slack on them)."""
    n = w.world_size
    r = processes or min(n, 8)
    base_w = states["base_weights"]
    shards = n if w.sharding in ("zero1", "zero2", "zero3", "fsdp") else 1
    offloaded = w.offload != "none"
    cpu = w.device == "cpu"
    cpu_runtime = HOST_RUNTIME_CPU_BYTES if w.profile == "vlmrl" else TRAINER_CPU_RUNTIME_BYTES
    runtime = w.host_runtime_bytes or (cpu_runtime if cpu else HOST_RUNTIME_CUDA_BYTES)
    terms = {
        "runtime_per_process": runtime * r,
        "model_loading": r * base_w,  # each process's copy (the checkpoint's mapped pages are shared page cache)
        "offloaded_optimizer_states": (states["master"] + states["moments"]) * r if offloaded else 0,
        "offloaded_gradients": states["trainable"] * 4 / shards * r if offloaded else 0,  # float32 gradient partitions for CPU Adam
        "offloaded_parameters": base_w / n * r if w.offload == "optimizer+params" else 0,
        # memory.offload_optimizer_during_rollout: host buffers the states are parked in (kept from step to step)
        "parked_optimizer_states": (states["master"] + states["moments"]) * r if parks(w) else 0,
        "pinned_buffers": 4 * COMM_BUCKET_BYTES * r if offloaded else 0,
        "reference_on_cpu": spec.total_params * DTYPE_BYTES[w.dtype] * r if ref_on_cpu else 0,
        "images_and_rollout_buffers": step_buffers * r,
        "data": HOST_DATA_BYTES if not cpu else 0,
        "device_tensors_on_cpu": ((device_peak - mmapped) * (1 + CPU_ALLOCATOR_RESERVE) + mmapped) * r if cpu else 0,
        # save_pretrained copies device tensors to the CPU; CPU tensors of an unsharded run are written as they are
        "gathered_state_dict_at_save": base_w if (not cpu or w.sharding in ("zero3", "fsdp")) else 0,
    }
    runtime = terms["runtime_per_process"] + terms["data"]
    training = runtime + sum(
        terms[k]
        for k in (
            "offloaded_optimizer_states",
            "offloaded_gradients",
            "offloaded_parameters",
            "parked_optimizer_states",
            "pinned_buffers",
            "reference_on_cpu",
            "images_and_rollout_buffers",
            "device_tensors_on_cpu",
        )
    )
    phases = {"loading": runtime + terms["model_loading"], "training": training, "saving": training + terms["gathered_state_dict_at_save"]}
    out = {k: int(v) for k, v in terms.items()}
    out.update({f"peak_{k}": int(v) for k, v in phases.items()})
    out["total"] = int(max(phases.values()))
    if processes is None:  # one process's own peak (what its peak RSS measures); rank 0 gathers the state dict
        out["process_peak"] = host_terms(spec, w, states, step_buffers, device_peak, ref_on_cpu, 1, mmapped)["total"]
    return out


def host_verdict(host: dict, host_memory_bytes: int | None) -> str:
    total = host["total"]
    if not host_memory_bytes:
        return f"needs {total / GiB:.1f} GiB of host RAM per node (no host size given: --host-memory)"
    if total <= FIT_FRACTION * host_memory_bytes:
        return f"host RAM fits: {total / GiB:.1f} of {host_memory_bytes / GiB:.1f} GiB per node"
    return f"host RAM does NOT fit: {total / GiB:.1f} GiB needed of {host_memory_bytes / GiB:.1f} GiB per node"


def parks(w: Workload) -> bool:
    """The optimizer states leave the device for rollout and scoring (they are not already offloaded; no SFT rollout)."""
    return w.offload_during_rollout and w.offload == "none" and w.mode != "sft"


def model_states(spec: ModelSpec, w: Workload) -> dict:
    """Bytes per device of weights, gradients, the float32 master copy, AdamW's two moments and the step's
    full-size temporary (foreach sqrt(exp_avg_sq)), under the precision scheme (master_weights_scheme) and the
    sharding: optimizer state (master + moments) sharded over n from ZeRO-1 on, gradients from ZeRO-2, weights
    from ZeRO-3 / FSDP. The same scheme on one device gives the same bytes under every engine."""
    b = DTYPE_BYTES[w.dtype]
    n = w.world_size
    lora_n = spec.lora_params(w.lora_r, w.lora_targets) if w.use_lora else 0
    if w.use_lora:
        trainable, tb = lora_n, 4  # peft keeps adapters in float32
    elif w.projector_only:
        trainable, tb = spec.projector_params, b
    elif w.freeze_vision:
        trainable, tb = spec.total_params - spec.vision_params + spec.projector_params, b
    else:
        trainable, tb = spec.total_params, b
    scheme = master_weights_scheme(w)
    state_shards = n if w.sharding in ("zero1", "zero2", "zero3", "fsdp") else 1
    grad_shards = n if w.sharding in ("zero2", "zero3", "fsdp") else 1
    full_shard = w.sharding in ("zero3", "fsdp")
    base_w = spec.total_params * b + lora_n * 4
    weights = 0 if (full_shard and w.offload == "optimizer+params") else base_w / (n if full_shard else 1)
    if scheme == "fp32":
        master = trainable * 4 / state_shards if tb < 4 else 0  # float32 trainables are their own master copy
        moments = trainable * 8 / state_shards
        step_tmp = trainable * 4 / state_shards
    else:
        master = 0
        moments = trainable * 2 * tb / state_shards
        step_tmp = trainable * tb / state_shards
    grads = trainable * tb / grad_shards
    if w.offload != "none":
        grads = min(grads, COMM_BUCKET_BYTES * 4)  # gradients stream to the host bucket by bucket
        step_tmp = 0  # the step runs on the CPU
    return {
        "trainable": trainable,
        "trainable_bytes": tb,
        "lora_params": lora_n,
        "base_weights": base_w,
        "scheme": scheme,
        "weights": weights,
        "gradients": grads,
        "master": master,
        "moments": moments,
        "step_temporary": step_tmp,
    }


def generation_rows(w: Workload) -> tuple[int, int]:
    """(rows whose KV cache the rollout holds at once, prompts prefilled together). The loop holds every row of a
    generate call (prompts_per_call x G); the continuous engine (shared prefix) a preallocated cache of
    decode_batch_size slots and prefills at most slots / G prompts at a time."""
    ppc = w.prompts_per_call or w.prompts_per_step
    rows = ppc * w.num_generations
    if w.rollout_engine != "continuous" or not w.shared_prefix:
        return rows, ppc
    slots = min(w.decode_batch_size or rows, rows)
    return slots, max(1, slots // w.num_generations)


def plan(spec: ModelSpec, w: Workload) -> Plan:
    """The closed form. All figures are bytes on one device (the busiest rank). w.profile naive / trl: another
    trainer's data path for the same work (plan_profiles)."""
    _check(w)
    w = profile_workload(w)
    w, fallback, notes = naive_fallback(spec, w)
    b = DTYPE_BYTES[w.dtype]
    cb = 2 if (w.autocast or b == 2) else 4  # compute (activation) dtype bytes
    n = w.world_size
    full_shard = w.sharding in ("zero3", "fsdp")

    st = model_states(spec, w)
    trainable, tb, lora_n = st["trainable"], st["trainable_bytes"], st["lora_params"]
    weights, grads, master, opt_states, opt_temp = st["weights"], st["gradients"], st["master"], st["moments"], st["step_temporary"]
    vision_trains = (not w.use_lora) and (not w.freeze_vision) and (not w.projector_only)
    text_trains = not w.projector_only
    opt_on_device = w.offload == "none"
    if not opt_on_device:
        notes.append(f"optimizer states ({(opt_states + master) / GiB:.2f} GiB) live in host RAM")
    opt_dev = opt_states if opt_on_device else 0
    master_dev = master if opt_on_device else 0
    comm = COMM_BUCKET_BYTES if (n > 1 and w.sharding != "none") else 0
    gathered = 0
    if full_shard:
        per_layer = (spec.total_params - spec.embed_params - spec.lm_head_params) / max(spec.layers + spec.v_layers, 1)
        gathered = 2 * per_layer * b + max(spec.embed_params, spec.lm_head_params) * b  # prefetch 2 layers + the biggest matrix
    reference = 0
    if w.beta > 0 and not w.use_lora and w.ref_placement == "device":
        reference = spec.total_params * b / (n if full_shard else 1)
    ref_moved_in = spec.total_params * b if (w.beta > 0 and not w.use_lora and w.ref_placement == "cpu") else 0

    # Tokens.
    patches, itok = prompt_vision(spec, w)  # images + video of one prompt
    vtok = math.prod(video_grid(spec, w)) // spec.merge_size**2
    P = w.prompt_text_tokens + video_text_tokens(spec, w) + itok
    C = w.completion_tokens
    N = w.micro_batch
    G = w.num_generations
    # Unique prompts in a micro-batch of N consecutive rows (rows are prompt-major, G per prompt).
    U = (math.ceil(N / G) if (N % G == 0 or G % N == 0) else min(N, math.ceil(N / G) + 1)) if w.group_vision else N
    gc = w.gradient_checkpointing
    prefix = w.shared_prefix and w.group_vision and not gc and spec.v_layers > 0
    encodes, naive_video = vision_encodes(spec, w, U, prefix)
    rows_step = w.rows_per_step
    pixel_bytes = patches * 3 * spec.temporal_patch * spec.patch_size**2 * 4  # fp32 pixel values of one prompt
    pixel_copies = pixel_copies_bytes(w, pixel_bytes)  # plain trainers hold each prompt's pixels G times
    batch_inputs = w.prompts_per_step * pixel_bytes + pixel_copies
    rollout_buffers = rows_step * (P + C) * 8 + rows_step * C * 4 * (1 + (w.num_iterations > 1) + (w.beta > 0))

    # Update: activations of one micro-batch.
    text_tokens = (U * P + N * C) if prefix else N * (P + C)
    per_layer = text_layer_bytes(spec, w, cb)
    if w.attn_implementation == "flash_attention_2":  # flash reads grouped k, v as they are: no copies repeated to the query heads
        per_layer -= (cb / 2) * 4 * (spec.heads - spec.kv_heads) * spec.head_dim
    vis_block = vision_block_bytes(spec, cb) if spec.v_layers else 0
    # Qwen3.5: linear-attention layers keep their own bytes per token, part of them per chunk-padded token of each row.
    lin_tok, lin_pad = linear_layer_bytes(spec, w, cb) if spec.linear_attn_layers else (0.0, 0.0)
    segments = ((U, P), (N, C - 1)) if prefix else ((N, P + C),)
    decoder = _DecoderBytes(spec, lin_pad, segments, first_linear_layer_bytes(spec, w, cb) if spec.linear_attn_layers else None)
    vis_patches = encodes * patches
    V, h = spec.vocab, spec.hidden
    calls = ((U, P, P), (N, C - 1, P + C - 1)) if prefix else ((N, P + C, P + C),)
    eager = eager_attention_bytes(spec, w, cb, calls, encodes, image_patches(spec, w.max_pixels) * w.images_per_prompt)
    t_video, frame = video_grid(spec, w)  # vision attention runs per temporal patch of a video (one frame's patches each)
    ev = eager_attention_bytes(spec, w, cb, calls, encodes * t_video, frame)
    eager |= {k: eager[k] + ev[k] for k in ("vision", "vision_block")}
    if gc:
        text_act = spec.layers * text_tokens * cb * h
        vision_act = spec.v_layers * vis_patches * cb * spec.v_hidden  # checkpointed blocks keep their inputs even when frozen
        # one layer recomputed in backward + its gradient buffers
        # (+ its eager scores and, while that layer's backward runs, their gradients: the same size again)
        # (a Gated DeltaNet layer: x 1.1, its float32 chunk tensors are freed as its backward goes, read off the trace)
        one_layer = max(1.35 * per_layer * text_tokens, 1.1 * decoder.layer(lin_tok, text_tokens) if spec.linear_attn_layers else 0)
        recompute = one_layer + (eager["text_layer"] + eager["transient"] if text_trains else 0)
    else:
        text_act = decoder.all_layers(per_layer, lin_tok, text_tokens)
        vision_act = spec.v_layers * vis_patches * vis_block if vision_trains else 0
        recompute = 0
    eager_act = 0 if gc else eager["text"] * text_trains + eager["vision"] * vision_trains
    if prefix:  # completion rows attend to the gathered prompt cache (k, v at KV heads, + repeated to query heads unless flash)
        repeated = 0 if w.attn_implementation == "flash_attention_2" else spec.heads
        text_act += decoder.full_layers * N * P * cb * 2 * (spec.kv_heads + repeated) * spec.head_dim
        text_act += N * linear_state_bytes(spec, cb)  # Qwen3.5: each row's gathered conv and recurrent states
    # Outside the layers: embeddings, image-feature scatter, final norm, the completion slice (12h per token; 7h with
    # checkpointing, where the embedding output is the only extra copy kept), patch embedding + merger (8 hv per patch).
    projector_trains = vision_trains or w.projector_only  # the merger keeps its inputs (frozen tower: measured smaller, left out)
    misc_act = (7 if gc else 12) * h * text_tokens * (cb / 2) + (8 * spec.v_hidden * vis_patches * (cb / 2) if projector_trains else 0)
    if not text_trains and not gc:
        # Projector only: the decoder is frozen but the gradient still flows through it to the image features, so each
        # layer keeps what its input gradient needs: everything but the inputs of the frozen norms and Linears.
        h_, qd = spec.hidden, spec.heads * spec.head_dim
        frozen_lin = (cb / 2) * (6 * h_ + 2 * spec.linear_v_heads * spec.linear_v_dim + 2 * spec.intermediate)
        text_act = decoder.all_layers(per_layer - (cb / 2) * (6 * h_ + 2 * qd + 2 * spec.intermediate), lin_tok - frozen_lin, text_tokens)
    chunk = min(w.logprob_chunk_tokens, N * C) if w.logprob_chunk_tokens > 0 else N * C
    lm_bwd = 12 * chunk * V * (cb / 2)  # LM-head chunk recomputed in backward: logits, fp32 copy, log-softmax, grads
    lm_no_grad = 8 * chunk * V * (cb / 2)
    full_logits = 0
    head_unit = chunk * V * cb  # the smallest vocabulary-sized tensor of the head (host: mmapped when large)
    head_trains = text_trains and not w.use_lora and not w.projector_only
    if w.profile != "vlmrl":  # a plain trainer's head: whole logits (naive) or TRL's fused tiles (trl)
        head = logprob_head_bytes(w, N, P, C, V, h, cb, head_trains)
        full_logits, lm_bwd, lm_no_grad, head_unit = head["kept"], head["backward"], head["no_grad"], head["unit"]
    elif w.logprob_chunk_tokens <= 0:
        full_logits = 4 * N * C * V  # the whole float32 log-softmax kept for backward
    emb_grad_tmp = 0
    if text_trains and not w.use_lora and not w.projector_only:
        emb_grad_tmp = (3 if spec.lm_head_params == 0 else 2) * V * h * b  # fresh embedding / LM-head gradients before accumulation
    misc_act += full_logits if w.profile == "vlmrl" else 0  # vlmrl with chunking off: counted with the other activations
    activations = text_act + vision_act + misc_act + eager_act + (full_logits if w.profile != "vlmrl" else 0)
    # The chunked log-prob backward runs first, with every activation still alive; when the LM head trains, its
    # weight gradient (fresh per chunk + the running sum) sits beside the chunk's logits.
    # (one chunk only: its gradients come after its logits are freed; nothing to add)
    head_grad_tmp = 2 * V * h * b if (head_trains and 0 < w.logprob_chunk_tokens < N * C and w.profile == "vlmrl") else 0
    bwd_transient = max(lm_bwd + head_grad_tmp, recompute)
    # Shared prefix: every decoder weight is used twice (prompt pass, completion pass), so autograd holds each
    # weight's gradient from the completion pass until the prompt pass adds its own (one summed gradient per weight).
    # Backward through the completion pass frees its activations layer by layer while these fill up: the peak is at
    # one end, and at the far end the prompt pass's activations and the vision tower's are still alive.
    prefix_held = 0
    prefix_bwd_act = 0
    if prefix and text_trains:
        decoder_params = lora_n if w.use_lora else spec.total_params - spec.vision_params - spec.embed_params - spec.lm_head_params
        prefix_held = decoder_params * tb
        prefix_bwd_act = decoder.all_layers(per_layer, lin_tok, U * P, ((U, P),)) + vision_act + misc_act + eager["vision"] * vision_trains
        prefix_bwd_act += eager_attention_bytes(spec, w, cb, ((U, P, P),), 0, 0)["text"]  # the prompt pass's scores

    # Scoring (no grad) and rollout (generation) transients.
    score_tokens = text_tokens if (w.shared_prefix and w.group_vision) else N * (P + C)
    score_transient = max(lm_no_grad, score_tokens * cb * (4 * h + 3 * spec.intermediate), eager["transient"])
    gen_rows, ppc = generation_rows(w)
    kv_per_token = 2 * (spec.layers - spec.linear_attn_layers) * spec.kv_heads * spec.head_dim * cb
    kv_cache = gen_rows * (P + C) * kv_per_token + gen_rows * linear_state_bytes(spec, cb)
    prefill_tokens = (ppc if w.shared_prefix else gen_rows) * P
    prefill_patches = (ppc if w.shared_prefix else gen_rows) * patches
    prefill_rows = ppc if w.shared_prefix else gen_rows
    gen_transient = max(
        prefill_tokens * cb * (4 * h + 3 * spec.intermediate),
        eager_attention_bytes(spec, w, cb, ((prefill_rows, P, P),), 0, 0)["transient"],
        prefill_patches * cb * (6 * spec.v_hidden + 3 * spec.v_intermediate) if spec.v_layers else 0,
        gen_rows * V * 4 * 3,
    )

    if w.mode == "sft":  # no rollout: no KV cache, no sampling; the batch is the micro-batch's prompts and targets
        kv_cache = gen_transient = 0
        rollout_buffers = N * C * 8 * 2
    persistent = weights + master_dev + opt_dev + reference + batch_inputs + rollout_buffers + comm
    # memory.generation_gather=full: the whole model is all-gathered for the rollout (one copy, the own shard included).
    gen_gathered = spec.total_params * b if (full_shard and w.generation_gather == "full" and w.mode != "sft") else gathered
    parked = master_dev + opt_dev if parks(w) else 0  # not on the device between updates
    rollout = persistent - parked + kv_cache + gen_transient + gen_gathered
    scoring = persistent - parked + (ref_moved_in + score_transient + gathered if (w.beta > 0 or w.num_iterations > 1) else 0)
    # Gradients are set to None after every optimizer step. With one micro-batch per optimizer step
    # (grad_accum 1) a backward never finds gradients already there: each fresh gradient becomes .grad (no
    # accumulation temporaries), and the decoder gradients held on the shared-prefix path are the gradients.
    # From the second micro-batch of a step on (grad_accum > 1, the trace's steady state) they coexist.
    steady = w.grad_accum > 1
    fwd_bwd = persistent + (grads if steady else 0) + activations + bwd_transient + gathered
    # The naive path of a batch with videos or of a family without fast paths (select_rows) copies each row's pixel
    # values; the copies live until the forward returns (before backward), so they add to the end of the forward.
    row_pixels = N * pixel_bytes if ((naive_video and w.group_vision) or fallback) else 0
    fwd_end = persistent + (grads if steady else 0) + activations + row_pixels + gathered
    fwd_bwd = max(fwd_bwd, fwd_end)
    bwd_end = persistent + grads + (emb_grad_tmp if steady else 0) + gathered
    if prefix_held:
        bwd_end = max(bwd_end, persistent + (grads if steady else 0) + emb_grad_tmp * steady + prefix_held + prefix_bwd_act + gathered)
    if w.device == "cpu":
        opt_temp = 0  # torch AdamW runs per tensor (no foreach) on CPU tensors
    opt_step = persistent + grads + opt_temp
    update = max(fwd_bwd, bwd_end, opt_step)
    phases = {"rollout": int(rollout), "scoring": int(scoring), "update": int(update)}
    peak = max(phases.values())
    reserved = int(peak * (1 + ALLOCATOR_RESERVE))
    total = reserved + CUDA_CONTEXT_BYTES
    terms = {
        "weights": weights,
        "gradients": grads,
        "master_weights": master_dev,
        "optimizer_states": opt_dev,
        "optimizer_step_temporary": opt_temp,
        "reference_model": reference,
        "activations_text": text_act,
        "activations_vision": vision_act,
        "activations_other": misc_act,
        "full_vocab_logits": full_logits if w.profile != "vlmrl" else 0,
        "eager_attention_scores": eager_act,
        "logprob_buffers": lm_bwd,
        "checkpoint_recompute": recompute,
        "embedding_grad_temporaries": emb_grad_tmp,
        "prefix_held_gradients": prefix_held,
        "kv_cache": kv_cache,
        "generation_temporaries": gen_transient,
        "scoring_temporaries": score_transient if (w.beta > 0 or w.num_iterations > 1) else 0,
        "reference_moved_in_for_scoring": ref_moved_in,
        "gathered_parameters": gathered,
        "gathered_for_generation": gen_gathered if gen_gathered != gathered else 0,
        "batch_inputs": batch_inputs - pixel_copies + rollout_buffers,
        "pixel_value_copies": pixel_copies,
        "naive_row_pixel_copies": row_pixels,
        "comm_buffers": comm,
        "allocator_reserve": reserved - peak,
        "cuda_context": CUDA_CONTEXT_BYTES,
    }
    terms = {k: int(v) for k, v in terms.items()}
    mmapped = _mmapped_at_peak(phases, head_unit, full_logits, lm_bwd + head_grad_tmp, fwd_bwd, recompute, lm_no_grad, score_transient)
    host = host_terms(spec, w, st, batch_inputs + rollout_buffers, int(peak), ref_moved_in > 0, None, mmapped)
    gpu = w.gpu_memory_bytes if w.device != "cpu" else None
    headroom, verdict = _verdict(int(total), w, host)
    out = Plan(
        terms=terms,
        phases=phases,
        peak_allocated=int(peak),
        reserved=reserved,
        total=int(total),
        host=host,
        gpu_memory_bytes=gpu,
        verdict=verdict,
        headroom=headroom,
        notes=notes,
        workload=dataclasses.asdict(w) | {"image_tokens_per_prompt": itok - vtok, "video_tokens_per_prompt": vtok, "prompt_tokens": P},
    )
    out.step_time_s = step_time(spec, w, trainable)
    return out


class _DecoderBytes:
    """Activation bytes over the decoder's layers: full-attention layers per token, Qwen3.5's linear-attention layers
    per token plus per token of each row padded to a multiple of LINEAR_ATTN_CHUNK. segments: ((rows, length), ...)."""

    def __init__(self, spec: ModelSpec, lin_pad: float, segments: tuple, first: float | None = None):
        self.linear = spec.linear_attn_layers
        self.full_layers = spec.layers - self.linear
        self.lin_pad = lin_pad
        self.segments = segments
        self.first = first  # bytes per token of layer 0 when it keeps less than the others (first_linear_layer_bytes)

    def padded(self, segments: tuple | None = None) -> int:
        return sum(r * -(-max(n, 0) // LINEAR_ATTN_CHUNK) * LINEAR_ATTN_CHUNK for r, n in segments or self.segments)

    def layer(self, lin_tok: float, tokens: float, segments: tuple | None = None) -> float:
        """One linear-attention layer."""
        return tokens * lin_tok + self.padded(segments) * self.lin_pad

    def all_layers(self, per_full: float, lin_tok: float, tokens: float, segments: tuple | None = None) -> float:
        if not self.linear:
            return self.full_layers * tokens * per_full
        if self.first is None:
            return self.full_layers * tokens * per_full + self.linear * self.layer(lin_tok, tokens, segments)
        return self.full_layers * tokens * per_full + (self.linear - 1) * self.layer(lin_tok, tokens, segments) + self.first * tokens


def _mmapped_at_peak(
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


def _verdict(total: int, w: Workload, host: dict) -> tuple[int | None, str]:
    """(device headroom, the verdict line): the device's, and the host's when a host size is given (on CPU: only it)."""
    gpu = w.gpu_memory_bytes
    if w.device == "cpu":
        return None, "CPU run: no device memory; " + host_verdict(host, w.host_memory_bytes)
    if gpu:
        headroom = int(gpu - total)
        verdict = (
            f"fits: {total / GiB:.1f} of {gpu / GiB:.1f} GiB, {headroom / GiB:.1f} GiB headroom"
            if total <= FIT_FRACTION * gpu
            else f"does NOT fit: {total / GiB:.1f} GiB needed on a {gpu / GiB:.1f} GiB device"
            + (f" ({-headroom / GiB:.1f} GiB over)" if headroom < 0 else f" (within {(1 - FIT_FRACTION):.0%} margin)")
        )
    else:
        headroom, verdict = None, f"needs {total / GiB:.1f} GiB per device (no device size given)"
    if w.host_memory_bytes:
        verdict += "; " + host_verdict(host, w.host_memory_bytes)
    return headroom, verdict


# ---------------------------------------------------------------- step-time model (ranking only)


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
    t_score = fwd * ((w.beta > 0) + (w.num_iterations > 1))
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


# ---------------------------------------------------------------- model specs


def _dims(obj, *names, default=None):
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return default


@lru_cache(maxsize=64)
def _spec_cached(config_json: str, name: str) -> ModelSpec:
    from transformers import AutoConfig

    d = json.loads(config_json)
    cfg = AutoConfig.for_model(**d)
    return _spec_from_config_object(cfg, name)


def spec_from_hf_config(config: Any, name: str = "") -> ModelSpec:
    """ModelSpec of a HF VLM config (PretrainedConfig, a dict, or a path to config.json / a model folder):
    the architecture is instantiated on the meta device (no memory) to count parameters."""
    if isinstance(config, (str, Path)):
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise PlanError(f"{config}: no such config.json (give a preset name, a model folder or a config.json path)")
        try:
            d = json.loads(p.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlanError(f"{p}: not a JSON config ({e}); give a model's config.json") from None
        return _known_architecture(d, str(p), name or p.parent.name)
    if isinstance(config, dict):
        return _known_architecture(config, "config", name or config.get("model_type", "model"))
    return _spec_from_config_object(config, name or getattr(config, "model_type", "model"))


def _known_architecture(d: dict, where: str, name: str) -> ModelSpec:
    """The spec of a config dict; one PlanError line (not transformers' traceback) when transformers cannot
    build it as an image-text model."""
    model_type = d.get("model_type") if isinstance(d, dict) else None
    how = (
        "pass the config.json of an architecture this transformers knows as an image-text model (model_type such as "
        "qwen2_5_vl, qwen2_vl, qwen3_vl, llava, llava_onevision, internvl, idefics3), or a preset (vlmrl plan --list-models)"
    )
    if not model_type:
        raise PlanError(f"{where}: no model_type in the config; {how}")
    try:
        return _spec_cached(json.dumps(d, sort_keys=True), name)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        import transformers

        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if first.startswith("Unrecognized model identifier"):
            first = "an architecture it does not know"
        elif first.startswith("Unrecognized configuration class"):
            first = "not an image-text model"
        elif len(first) > 120:
            first = first[:117] + "..."
        raise PlanError(
            f"{where}: model_type {model_type!r} cannot be planned with transformers {transformers.__version__} ({first}); {how}"
        ) from None


def _spec_from_config_object(cfg, name: str) -> ModelSpec:
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.loading import output_head, projector, unwrap, vision_tower

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    core = unwrap(model)
    total = sum(p.numel() for p in model.parameters())
    from vlmrl.models.loading import ModelLoadError

    try:
        vt = vision_tower(model)
        vision = sum(p.numel() for p in vt.parameters())
    except ModelLoadError:
        vt, vision = None, 0
    try:
        proj = projector(model)
        proj_n = sum(p.numel() for p in proj.parameters())
        inside = {id(p) for p in vt.parameters()} if vt is not None else set()
        if not all(id(p) in inside for p in proj.parameters()):
            vision += proj_n  # LLaVA-style projector outside the tower: count it with vision
    except ModelLoadError:
        proj_n = 0
    emb = core.get_input_embeddings()
    head = output_head(model)
    tied = head.weight is emb.weight
    t = cfg.get_text_config()
    heads = t.num_attention_heads
    head_dim = _dims(t, "head_dim", default=None) or t.hidden_size // heads
    linears: dict[tuple, int] = {}
    vision_ids = {id(m) for m in vt.modules()} if vt is not None else set()
    for mname, m in core.named_modules():
        if isinstance(m, torch.nn.Linear) and id(m) not in vision_ids and m is not head:
            key = (mname.rsplit(".", 1)[-1], m.in_features, m.out_features)
            linears[key] = linears.get(key, 0) + 1
    v = getattr(cfg, "vision_config", None)
    kw: dict = {}
    if v is not None:
        vh = _dims(v, "hidden_size", "embed_dim", default=0)
        if getattr(cfg, "model_type", "") == "qwen2_vl":
            vh = v.embed_dim
            kw["v_mlp_gated"] = False  # fc1 -> quick_gelu -> fc2
        vi = _dims(v, "intermediate_size", default=None) or int(vh * _dims(v, "mlp_ratio", default=4))
        kw.update(
            v_hidden=vh,
            v_intermediate=vi,
            v_layers=_dims(v, "depth", "num_hidden_layers", default=0),
            v_heads=_dims(v, "num_heads", "num_attention_heads", default=1),
            patch_size=_dims(v, "patch_size", default=14),
            merge_size=_dims(v, "spatial_merge_size", default=1),
            temporal_patch=_dims(v, "temporal_patch_size", default=1),
        )
        if getattr(v, "fullatt_block_indexes", None) is not None and getattr(v, "window_size", None):
            kw["v_full_attn_blocks"] = len(v.fullatt_block_indexes)  # Qwen2.5-VL: windowed attention elsewhere
            kw["v_window_patches"] = (v.window_size // kw["patch_size"]) ** 2
        if getattr(cfg, "model_type", "") not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
            size = _dims(v, "image_size", default=336)
            patch = kw["patch_size"]
            kw["image_size"] = size[0] if isinstance(size, (list, tuple)) else size
            kw["patch_size"] = patch[0] if isinstance(patch, (list, tuple)) else patch
            # Token reduction after the tower: InternVL pixel shuffle (downsample_ratio 0.5 -> 4x fewer), Idefics3/SmolVLM
            # scale_factor (3 -> 9x fewer); LLaVA keeps every patch (the CLS token is dropped).
            ratio = getattr(cfg, "downsample_ratio", None)
            kw["merge_size"] = round(1 / ratio) if ratio else int(getattr(cfg, "scale_factor", 1) or 1)
            kw.update(_tiling_dims(cfg))
            if getattr(cfg, "mm_tokens_per_image", None):  # Gemma 3: patches average-pooled to a fixed token count
                kw["merge_size"] = round(math.sqrt((kw["image_size"] // kw["patch_size"]) ** 2 / cfg.mm_tokens_per_image))
    moe = _moe_dims(t, core)
    if getattr(cfg, "model_type", "") == "gemma3":
        moe["norms_per_layer"] = 4
    if getattr(cfg, "model_type", "") in ("qwen3_5", "qwen3_5_moe"):  # hybrid decoder: Gated DeltaNet + gated full attention
        moe.update(
            gated_attention=True,
            linear_attn_layers=sum(kind == "linear_attention" for kind in (getattr(t, "layer_types", None) or ())),
            linear_k_heads=t.linear_num_key_heads,
            linear_v_heads=t.linear_num_value_heads,
            linear_k_dim=t.linear_key_head_dim,
            linear_v_dim=t.linear_value_head_dim,
            linear_conv_kernel=t.linear_conv_kernel_dim,
            first_layer_linear=bool(getattr(t, "layer_types", None)) and t.layer_types[0] == "linear_attention",
        )
    return ModelSpec(
        name=name,
        family=getattr(cfg, "model_type", ""),
        total_params=total,
        vision_params=vision,
        projector_params=proj_n,
        embed_params=emb.weight.numel(),
        lm_head_params=0 if tied else head.weight.numel(),
        hidden=t.hidden_size,
        intermediate=moe.pop("intermediate", None) or getattr(t, "intermediate_size", 0) or 0,
        layers=t.num_hidden_layers,
        heads=heads,
        kv_heads=_dims(t, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        vocab=t.vocab_size,
        lora_linears=tuple((s, i, o, c) for (s, i, o), c in sorted(linears.items())),
        **kw,
        **moe,
    )


def _tiling_dims(cfg) -> dict:
    """The tiled families' ModelSpec fields: LLaVA-OneVision anyres (pinpoints, anyres_max_N), InternVL dynamic tiles;
    both towers (SigLIP, InternViT: no RoPE, fc1 -> GELU -> fc2) keep 20 hv + 4 iv per patch, read off the trace
    (internvl3-1b, llava-onevision-qwen2-7b)."""
    model_type = getattr(cfg, "model_type", "")
    if model_type not in ("internvl", "llava_onevision"):
        return {}
    kw: dict = {"v_block_hidden": 20, "v_mlp_gated": False}
    if model_type == "internvl":
        kw["tiling"] = "dynamic"  # tiles of image_size, up to ModelSpec.max_tiles (the processor's max_patches)
    elif getattr(cfg, "image_grid_pinpoints", None):
        kw["tiling"] = "anyres"
        kw["tile_pinpoints"] = tuple(tuple(p) for p in cfg.image_grid_pinpoints)
        kw["anyres_max_tiles"] = int(str(getattr(cfg, "vision_aspect_ratio", "anyres_max_9")).rsplit("_", 1)[-1])
    return kw


def _moe_dims(text_config, core) -> dict:
    """MoE decoders: routed-expert parameters, the fraction a token uses, and the MLP width one token's activations
    see (top_k routed experts + the shared expert) in place of the dense intermediate_size."""
    experts = getattr(text_config, "num_experts", 0) or 0
    top_k = getattr(text_config, "num_experts_per_tok", 0) or 0
    if not experts or not top_k:
        return {}
    routed = sum(p.numel() for n, p in core.named_parameters() if ".mlp.experts." in n)
    width = top_k * text_config.moe_intermediate_size + (getattr(text_config, "shared_expert_intermediate_size", 0) or 0)
    return {"routed_expert_params": routed, "experts_active_fraction": top_k / experts, "intermediate": width}


def model_spec(model: str) -> ModelSpec:
    """A bundled preset name, or a path to a model folder / config.json."""
    from vlmrl.fixtures.presets import PLANNER_PRESETS, PRESETS

    if model in PRESETS or model in PLANNER_PRESETS:
        return _preset_spec(model)
    if Path(model).exists():
        return spec_from_hf_config(model)
    names = sorted(PRESETS) + sorted(PLANNER_PRESETS)
    raise PlanError(f"unknown model {model!r}: give a preset ({', '.join(names)}) or a path to a config.json")


@lru_cache(maxsize=32)
def _preset_spec(name: str) -> ModelSpec:
    from vlmrl.fixtures.presets import hf_config

    return spec_from_hf_config(hf_config(name), name)


# ---------------------------------------------------------------- vlmrl configs

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
        num_iterations=a.num_iterations,
        ref_placement=mem.ref_placement,
        offload_during_rollout=mem.offload_optimizer_during_rollout,
        world_size=world_size,
        gpu_memory_bytes=gpu_memory_bytes,
    )
    host_gib = getattr(t, "auto_fit_host_memory_gib", None)
    if host_gib:
        kw["host_memory_bytes"] = int(host_gib * GiB)
    kw.update(extra)
    return Workload(**kw)


def spec_for_config(cfg) -> ModelSpec:
    name = cfg.model.name_or_path
    if name.startswith("embedded:"):
        from vlmrl.fixtures.tiny import default_model_path

        path = default_model_path()
        if not (Path(path) / "config.json").is_file():
            raise PlanError(f"{name}: the embedded tiny model is not built yet ({path}); run vlmrl demo once, or plan with --model")
        return spec_from_hf_config(path, name)
    return model_spec(name)


def plan_for_config(cfg, world_size: int = 1, gpu_memory_bytes: int | None = None, **extra) -> Plan:
    """Plan of a vlmrl Config (training.auto_fit_gpu_memory_gib is used when gpu_memory_bytes is None)."""
    if gpu_memory_bytes is None:
        gib = getattr(cfg.training, "auto_fit_gpu_memory_gib", None)
        gpu_memory_bytes = int(gib * GiB) if gib else None
    return plan(spec_for_config(cfg), workload_from_config(cfg, world_size, gpu_memory_bytes, **extra))


# ---------------------------------------------------------------- search


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
    allow = set(allow)
    Gs = [base.num_generations]
    if "num_generations" in allow:
        Gs += [g for g in (base.num_generations // 2, base.num_generations // 4) if g >= 2 and g not in Gs]
    pixels = [base.max_pixels]
    if "max_pixels" in allow:
        pixels += [base.max_pixels // 2, base.max_pixels // 4]
    prompt_counts = [base.prompts_per_step]
    if "effective_batch" in allow:
        prompt_counts += [p for p in (base.prompts_per_step // 2, base.prompts_per_step // 4) if p >= 1 and p not in prompt_counts]
    if shardings is None:
        shardings = ("none",) if base.world_size == 1 else ("ddp", "zero1", "zero2", "zero3")
        if base.sharding not in shardings:
            shardings = (base.sharding, *shardings)
    offloads_for = {
        "none": ("none",),
        "ddp": ("none",),
        "zero1": ("none", "optimizer"),
        "zero2": ("none", "optimizer"),
        "zero3": ("none", "optimizer", "optimizer+params"),
        "fsdp": ("none", "optimizer", "optimizer+params"),
    }
    # Memory savers the given config has stay on: a candidate that turns one off to go faster would trade the
    # user's margin for speed (and "fixing" an OOM by switching checkpointing off is never right).
    gcs = (True,) if base.gradient_checkpointing else (False, True)
    refs = ("device", "cpu") if (base.beta > 0 and not base.use_lora and base.ref_placement == "device") else (base.ref_placement,)
    offload_rank = {o: i for i, o in enumerate(OFFLOADS)}
    offloads_for = {k: tuple(o for o in v if offload_rank[o] >= offload_rank[base.offload]) for k, v in offloads_for.items()}
    step_rows = base.micro_batch * base.grad_accum  # rows per optimizer step (kept)
    out: list[Candidate] = []
    for G in Gs:
        for prompts in prompt_counts:
            rows = prompts * G
            # keep rows per optimizer step when possible; else (G / prompts changed) keep its ratio to the rollout
            per_opt = (
                step_rows
                if (G == base.num_generations and prompts == base.prompts_per_step)
                else max(1, step_rows * rows // max(1, base.rows_per_step))
            )
            engines = [(sh, off) for sh in shardings for off in offloads_for.get(sh, ("none",))]
            for mb, ppc, gc, (sh, off), ref, px in itertools.product(_divisors(per_opt), _divisors(prompts), gcs, engines, refs, pixels):
                w = dataclasses.replace(
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
                p = plan(spec, w)
                if p.fits or include_infeasible:
                    out.append(Candidate(w, p, _describe(base, w)))
    out.sort(key=lambda c: (not c.plan.fits, c.plan.step_time_s, c.plan.total))
    return out[:top] if top else out


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


def auto_fit(cfg, gpu_memory_bytes: int | None = None, world_size: int = 1, sharding: str | None = None):
    """(new_cfg, changes): the fastest configuration predicted to fit, over knobs vlmrl's config has (micro-batch
    with the effective batch kept, generation prompts per call, gradient checkpointing, reference placement; and
    num_generations / max_pixels / effective batch only when listed in training.auto_fit_allow). Raises PlanError
    naming the knobs when nothing fits."""
    from vlmrl.config import replace

    if gpu_memory_bytes is None:
        gpu_memory_bytes = device_memory_bytes(cfg)
    allow = tuple(getattr(cfg.training, "auto_fit_allow", ()) or ())
    spec = spec_for_config(cfg)
    extra = {"sharding": sharding} if sharding and world_size > 1 else {}
    base = workload_from_config(cfg, world_size, gpu_memory_bytes, **extra)
    shardings = (base.sharding,)  # the engine is the launcher's choice: auto_fit keeps it
    found = search(spec, base, allow=allow, top=1, shardings=shardings)
    if not found:
        now = plan(spec, base)
        knobs = (
            "training.per_device_train_batch_size (with gradient_accumulation_steps), memory.generation_prompts_per_call, "
            "model.gradient_checkpointing" + (", memory.ref_placement" if base.beta > 0 and not base.use_lora else "")
        )
        locked = [k for k in ("num_generations", "max_pixels", "effective_batch") if k not in allow]
        host = (
            f" and {base.host_memory_bytes / GiB:.0f} GiB of host RAM (the current one needs {now.host['total'] / GiB:.1f})"
            if base.host_memory_bytes
            else ""
        )
        raise PlanError(
            f"auto_fit: no configuration fits in {gpu_memory_bytes / GiB:.1f} GiB{host} (the current one needs {now.total / GiB:.1f} GiB). "
            f"Searched {knobs}. Still locked: {', '.join(locked) or 'nothing'} (allow them in training.auto_fit_allow), or use "
            "LoRA (model.use_lora), bf16 weights, more GPUs with ZeRO/FSDP (vlmrl plan --search --gpus N), or a bigger device."
        )
    best = found[0].workload
    changes: dict[str, Any] = {}
    t = cfg.training
    if best.micro_batch != t.per_device_train_batch_size or best.grad_accum != t.gradient_accumulation_steps:
        changes["training__per_device_train_batch_size"] = best.micro_batch
        changes["training__gradient_accumulation_steps"] = best.grad_accum
    if (best.prompts_per_call or base.prompts_per_step) != (cfg.memory.generation_prompts_per_call or base.prompts_per_step):
        changes["memory__generation_prompts_per_call"] = best.prompts_per_call
    if best.gradient_checkpointing != cfg.model.gradient_checkpointing:
        changes["model__gradient_checkpointing"] = best.gradient_checkpointing
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
    if not changes:
        return cfg, []
    lines = [f"{k.replace('__', '.')}: {_get(cfg, k)} -> {v}" for k, v in changes.items()]
    new = replace(cfg, **changes)
    p = plan(spec, best)
    lines.append(f"predicted peak {p.total / GiB:.1f} GiB of {gpu_memory_bytes / GiB:.1f} GiB; step-time model {p.step_time_s:.2f} s")
    return new, lines


def _get(cfg, dotted: str):
    section, name = dotted.split("__", 1)
    return getattr(getattr(cfg, section), name)


# ---------------------------------------------------------------- at run time (train.py)

PREDICTION_WARN_FRACTION = 0.25  # a measured GPU peak this far from the prediction is worth a warning


def apply_auto_fit(cfg, log, world_size: int = 1, sharding: str | None = None):
    """training.auto_fit: the config the planner picks, every change logged. PlanError when nothing fits."""
    new_cfg, changes = auto_fit(cfg, world_size=world_size, sharding=sharding)
    for line in changes or ["auto_fit: the configuration as given is predicted to fit and to be the fastest; nothing changed"]:
        log(line if line.startswith("auto_fit") else f"auto_fit: {line}")
    return new_cfg


def runs_on_cpu(cfg) -> bool:
    """training.device is cpu, or auto on a machine without CUDA."""
    dev = cfg.training.device
    if dev == "cpu":
        return True
    if dev != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def _run_context(cfg, world_size: int = 1) -> tuple[bool, int | None, dict]:
    """(cpu, gpu bytes, workload extras) of the run about to start: on CPU the runtime RSS measured now."""
    cpu = runs_on_cpu(cfg)
    gpu = None
    if not cpu:
        try:
            gpu = device_memory_bytes(cfg)
        except PlanError:
            gpu = None
    extra: dict = {}
    if cpu:
        from vlmrl.engine.memory import host_rss

        # libraries imported later in the run (the model family, tokenizer, data) count from the start
        extra.update(device="cpu", host_runtime_bytes=max(int(host_rss() * GiB), HOST_RUNTIME_CPU_BYTES))
    return cpu, gpu, extra


def _log_prediction(p: Plan, log, what: str = "") -> None:
    if p.workload.get("device") == "cpu":
        log(
            f"planner: {what}CPU run, predicted host peak RSS {p.host['process_peak'] / GiB:.2f} GiB per process "
            f"(tensors {p.peak_allocated / GiB:.2f} GiB, runtime now {p.workload['host_runtime_bytes'] / GiB:.2f} GiB)"
            + (f"; {p.verdict}" if p.workload.get("host_memory_bytes") else "")
        )
    else:
        log(
            f"planner: {what}predicted per-device GPU peak {p.peak_allocated / GiB:.2f} GiB allocated, "
            f"{p.reserved / GiB:.2f} GiB reserved" + (f" ({p.verdict})" if p.gpu_memory_bytes else "")
        )


def predict_for_run(cfg, log, world_size: int = 1, sharding: str | None = None, what: str = "", **data_shape) -> Plan | None:
    """The planner's prediction for this run, logged once; None (with the reason) when the model cannot be
    planned. Never stops a run: the prediction is advice. `sharding`: the engine's (ddp, fsdp, zero2, zero3).
    `data_shape`: Workload fields read from the data (images_per_prompt, video_frames: `data_shape_of`).
    On a CPU run every tensor lives in host RAM: the prediction is this process's peak RSS, from the RSS it has
    now (libraries loaded, measured) plus the planned tensors, loading and buffers (Plan.host["process_peak"])."""
    try:
        _, gpu, extra = _run_context(cfg, world_size)
        if sharding and world_size > 1:
            extra["sharding"] = sharding
        p = plan_for_config(cfg, world_size=world_size, gpu_memory_bytes=gpu, **extra, **data_shape)
    except Exception as e:  # noqa: BLE001 - any model the planner cannot read must not stop training
        log(f"planner: no prediction for this run ({type(e).__name__}: {e})")
        return None
    _log_prediction(p, log, what)
    return p


def describe_data_shape(shape: dict) -> str:
    """'2 images per prompt, a 16-frame video' for a data_shape_of result."""
    parts = [f"{shape.get('images_per_prompt', 1)} images per prompt"]
    if shape.get("video_frames"):
        parts.append(f"a {shape['video_frames']}-frame video")
    return ", ".join(parts)


def data_shape_of(rows: list[dict], limit_images: int | None, max_frames: int) -> dict:
    """Workload fields the config cannot tell and the training rows can: the most images of a row (within
    limit_images) and, when rows have videos, one video of max_frames frames per prompt. {} when the rows match the
    planner's default (one image, no video)."""
    most = max((len(r.get("images") or []) for r in rows), default=1)
    most = min(most, limit_images) if limit_images else most
    shape = {"images_per_prompt": most} if most != 1 else {}
    if any(r.get("videos") for r in rows):
        shape["video_frames"] = max_frames
    return shape


def predict_for_sft(cfg, log, target_tokens: int | None = None) -> Plan | None:
    """`predict_for_run` for `vlmrl sft`: each configured stage planned and logged; returns the larger one."""
    try:
        _, gpu, extra = _run_context(cfg)
        plans = sft_plans_for_config(cfg, gpu, target_tokens, **extra)
    except Exception as e:  # noqa: BLE001 - advice only
        log(f"planner: no prediction for this run ({type(e).__name__}: {e})")
        return None
    for stage, p in plans.items():
        _log_prediction(p, log, f"SFT stage {stage}: ")
    return max(plans.values(), key=lambda p: (p.host["process_peak"], p.peak_allocated)) if plans else None


def measured_vs_predicted(p: Plan | None, warn) -> dict:
    """memory_stats() now plus the plan/* comparison (for loops that do not collect memory metrics themselves)."""
    if p is None:
        return {}
    from vlmrl.engine.memory import memory_stats

    stats = memory_stats()
    return {**stats, **prediction_vs_measured(p, stats, warn)}


def prediction_vs_measured(p: Plan | None, metrics: dict, warn) -> dict:
    """plan/* keys for metrics.jsonl: the prediction and its error against what the step measured: on CUDA the
    reserved peak (mem/gpu_peak_reserved, GiB), on a CPU run this process's peak RSS (mem/host_peak_rss, GiB);
    warns when the miss is over PREDICTION_WARN_FRACTION."""
    if p is None:
        return {}
    if p.workload.get("device") == "cpu":
        predicted = p.host["process_peak"] / GiB
        out = {
            "plan/host_peak_rss": predicted,
            "plan/peak_allocated": p.peak_allocated / GiB,
            "plan/host_runtime": p.workload["host_runtime_bytes"] / GiB,
        }
        measured, key, what = metrics.get("mem/host_peak_rss"), "plan/error_host_rss", "GiB host peak RSS"
    else:
        predicted = p.reserved / GiB
        out = {"plan/peak_allocated": p.peak_allocated / GiB, "plan/peak_reserved": predicted}
        measured, key, what = metrics.get("mem/gpu_peak_reserved"), "plan/error_reserved", "GiB reserved"
    if measured:
        error = (predicted - measured) / measured
        out[key] = error
        if abs(error) > PREDICTION_WARN_FRACTION:
            warn(
                f"WARNING: planner predicted {predicted:.2f} {what}, measured {measured:.2f} GiB "
                f"({error:+.0%}); please report the config (vlmrl plan --json) so the planner can learn from it"
            )
    return out
