#!/usr/bin/env python
"""Accuracy of the memory planner's closed form (vlmrl.plan.planner).

    python benchmarks/planner_accuracy.py trace        # closed form vs exact meta-device trace, tiny .. 7B (CPU, ~3 min)
    python benchmarks/planner_accuracy.py measured     # closed form vs the GPU peaks in benchmarks/results/gpu_memory_*.json
    python benchmarks/planner_accuracy.py cpu          # prediction each real CPU run logs vs its peak RSS (10 runs, ~5 min)
    python benchmarks/planner_accuracy.py field        # public OOM reports: the planner's verdicts (planner_field_reports.json)
    python benchmarks/planner_accuracy.py trl          # --profile naive / trl vs TRL GRPOTrainer's peak RSS (planner_vs_trl.py)
    python benchmarks/planner_accuracy.py deepspeed    # ZeRO-2/3 runs on 2 CPU processes vs the planner (planner_deepspeed.py, ~20 min)

`trace` writes benchmarks/results/planner_accuracy_cpu_trace_<date>.json/.md: for each configuration the traced
update-step peak (plan_trace.trace_update: real modules on the meta device, bytes counted per storage) and the
closed form's update-phase peak under the same semantics (weights' dtype, no autocast, no reserve / context).

`measured` predicts `torch.cuda.max_memory_reserved` (and allocated) for every record of the gpu_memory
benchmark JSONs (real H100 runs of train.py), made NOW from the configs the JSONs record, and writes
benchmarks/results/planner_vs_<device>_<date of the measurement>.json/.md. Out-of-memory records are listed
with the planner's verdict (fits / does not fit) instead of a peak. On a machine with a GPU, run
benchmarks/gpu_memory.py first and then this with --inputs pointing at its JSONs: that is the whole harness.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vlmrl.plan.planner import (  # noqa: E402 (src/ on the path first)
    GiB,
    Workload,
    model_spec,
    plan,
    spec_from_hf_config,
)

# ---------------------------------------------------------------- tiny architecture (for CI-sized checks)


def tiny_qwen25_config(
    layers: int = 2,
    depth: int = 2,
    hidden: int = 256,
    inter: int = 704,
    heads: int = 4,
    kv: int = 2,
    vocab: int = 4096,
    v_hidden: int = 128,
    v_inter: int = 344,
    family: str = "qwen2_5_vl",
):
    """A small Qwen2.5-VL / Qwen2-VL config (head_dim 64) with the real structure."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen2_vl":
        vision = dict(
            depth=depth,
            embed_dim=v_hidden,
            mlp_ratio=4,
            num_heads=2,
            hidden_act="quick_gelu",
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            hidden_size=hidden,
        )
        return Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            tie_word_embeddings=True,
            image_token_id=3,
            video_token_id=4,
            vision_start_token_id=5,
            vision_end_token_id=6,
        )
    vision = dict(
        depth=depth,
        hidden_size=v_hidden,
        intermediate_size=v_inter,
        num_heads=2,
        hidden_act="silu",
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[depth - 1],
        out_hidden_size=hidden,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        image_token_id=3,
        video_token_id=4,
        vision_start_token_id=5,
        vision_end_token_id=6,
    )


def tiny_qwen3_config(moe: bool = False, layers: int = 2, hidden: int = 256, vocab: int = 4096):
    """A small Qwen3-VL (patch 16, DeepStack, interleaved M-RoPE) or Qwen3-VL-MoE (8 experts, top 2) config."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    text = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [8, 12, 12], "mrope_interleaved": True},
        pad_token_id=0,
    )
    if moe:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, decoder_sparse_step=1)
    vision = dict(
        depth=2,
        hidden_size=128,
        intermediate_size=344,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden,
        num_position_embeddings=256,
        deepstack_visual_indexes=[0],
    )
    config_class = Qwen3VLMoeConfig if moe else Qwen3VLConfig
    ids = dict(image_token_id=3, video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)
    return config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def tiny_gemma3_config(hidden: int = 256, layers: int = 2, vocab: int = 4096):
    """A small Gemma 3 (SigLIP at 224 px, patch 14, pooled to 64 tokens; 4 norms per decoder layer) config."""
    from transformers import Gemma3Config

    text = dict(
        hidden_size=hidden,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=vocab,
        sliding_window=64,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=224,
        patch_size=14,
        vision_use_head=False,
    )
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=64, image_token_index=3, boi_token_index=4, eoi_token_index=5)


def tiny_qwen35_config(
    layers: int = 4,
    hidden: int = 256,
    inter: int = 704,
    heads: int = 4,
    kv: int = 2,
    head_dim: int = 64,
    linear_heads: tuple = (2, 4),
    linear_dim: int = 64,
    moe: bool = False,
):
    """A small Qwen3.5 (hybrid decoder: three Gated DeltaNet layers per gated full-attention layer, Qwen3-VL-style ViT
    with patch 16) config; linear_heads = (key heads, value heads). moe: Qwen3.5-MoE (8 experts, top 2, a shared expert)."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = dict(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        linear_key_head_dim=linear_dim,
        linear_value_head_dim=linear_dim,
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "mrope_section": [head_dim // 32, head_dim * 3 // 64, head_dim * 3 // 64],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
        pad_token_id=0,
    )
    vision = dict(
        depth=2,
        hidden_size=128,
        intermediate_size=344,
        num_heads=2,
        out_hidden_size=hidden,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=256,
    )
    ids = dict(image_token_id=3, video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)
    if moe:
        width = text.pop("intermediate_size") // 2
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=width, shared_expert_intermediate_size=width)
        return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def tiny_tiled_config(model: str):
    """The config of the tiny LLaVA-OneVision / InternVL build (vlmrl.tiny_models.tiny_families), built once into a temporary folder."""
    import tempfile

    from transformers import AutoConfig

    from vlmrl.tiny_models.tiny_families import build_tiny_internvl, build_tiny_llava_onevision

    if model not in _TILED:
        build = build_tiny_llava_onevision if model == "tiny-llava-onevision" else build_tiny_internvl
        with tempfile.TemporaryDirectory() as d:
            _TILED[model] = AutoConfig.from_pretrained(build(Path(d) / model))
    return _TILED[model]


_TILED: dict = {}


# ---------------------------------------------------------------- closed form vs trace


@dataclasses.dataclass
class GridPoint:
    name: str
    model: str  # preset name or "tiny" / "tiny-qwen2"
    G: int
    micro_batch: int
    gc: bool
    lora: bool
    max_pixels: int
    completion: int = 64
    prompt_text: int = 41
    shared_prefix: bool = False
    chunk: int = 128
    attn: str = "sdpa"
    freeze_vision: bool = False
    sft_stage: int = 0  # 1 / 2: a `vlmrl sft` step (each row its own prompt and image; G is ignored)
    video_frames: int = 0  # frames of one video per prompt (0 = none)
    video_max_pixels: int = 128 * 28 * 28  # pixel cap per video frame
    images: int = 1  # images per prompt (0: a video-only prompt)


def unique_prompts(N: int, G: int) -> int:
    """Prompts among N consecutive rows when each prompt has G rows (aligned micro-batches)."""
    return -(-N // G) if (N % G == 0 or G % N == 0) else min(N, -(-N // G) + 1)


def _sft_workload(p: GridPoint) -> Workload:
    from vlmrl.plan.planner import sft_workload

    base = Workload(
        dtype="bfloat16",
        autocast=False,
        use_lora=p.lora,
        gradient_checkpointing=p.gc,
        micro_batch=p.micro_batch,
        prompt_text_tokens=p.prompt_text,
        max_pixels=p.max_pixels,
        completion_tokens=p.completion,
        attn_implementation=p.attn,
        images_per_prompt=p.images,
        video_frames=p.video_frames,
        video_max_pixels=p.video_max_pixels,
    )
    return dataclasses.replace(sft_workload(base, p.sft_stage, train_vision_tower=not p.freeze_vision), grad_accum=2)


def workload_for(p: GridPoint) -> Workload:
    """The traced micro-batch as a step: its prompts are the step's prompts (the trace holds their pixels). The
    trace is the steady state (gradients already there, as from an optimizer step's second micro-batch on), so the
    workload accumulates over at least two micro-batches."""
    U = unique_prompts(p.micro_batch, p.G)
    return Workload(
        dtype="bfloat16",
        autocast=False,
        use_lora=p.lora,
        gradient_checkpointing=p.gc,
        num_generations=p.G,
        prompts_per_step=U,
        micro_batch=p.micro_batch,
        grad_accum=max(2, U * p.G // p.micro_batch),  # steady state
        prompt_text_tokens=p.prompt_text,
        max_pixels=p.max_pixels,
        completion_tokens=p.completion,
        logprob_chunk_tokens=p.chunk,
        group_vision=True,
        shared_prefix=p.shared_prefix,
        attn_implementation=p.attn,
        freeze_vision=p.freeze_vision,
        images_per_prompt=p.images,
        video_frames=p.video_frames,
        video_max_pixels=p.video_max_pixels,
    )


def hf_config_for(model: str):
    if model == "tiny":
        return tiny_qwen25_config()
    if model == "tiny-qwen2":
        return tiny_qwen25_config(family="qwen2_vl")
    if model == "tiny-wide":  # weights large next to activations: the shared prefix's held gradients show
        return tiny_qwen25_config(layers=4, hidden=512, inter=1408, heads=8, kv=2)
    if model in ("tiny-qwen3", "tiny-qwen3-moe"):
        return tiny_qwen3_config(moe=model.endswith("moe"))
    if model == "tiny-gemma3":
        return tiny_gemma3_config()
    if model in ("tiny-llava-onevision", "tiny-internvl"):  # the tiny builds' configs (28 px anyres tiles / 56 px tiles, max 6)
        return tiny_tiled_config(model)
    if model in ("tiny-qwen35", "tiny-qwen35-moe"):
        return tiny_qwen35_config(moe=model.endswith("moe"))
    if model == "mid-qwen35":  # 8 layers at the widths public Qwen3.5 configs of ~4B use (not a published model)
        return tiny_qwen35_config(layers=8, hidden=2560, inter=9216, heads=16, kv=4, head_dim=256, linear_heads=(16, 32), linear_dim=128)
    from vlmrl.plan.presets import hf_config

    return hf_config(model)


def spec_for(model: str):
    if model == "tiny-internvl":  # its processor's max_patches is 6
        return dataclasses.replace(spec_from_hf_config(hf_config_for(model).to_dict(), model), max_tiles=6)
    if model.startswith(("tiny", "mid-")):
        return spec_from_hf_config(hf_config_for(model).to_dict(), model)
    return model_spec(model)


def compare_trace(p: GridPoint) -> dict:
    from vlmrl.plan.trace import setup_for, trace_update

    spec = spec_for(p.model)
    w = _sft_workload(p) if p.sft_stage else workload_for(p)
    setup = setup_for(spec, w)  # the same description as the closed form's, by one mapping
    t0 = time.perf_counter()
    r = trace_update(hf_config_for(p.model), setup)
    closed = plan(spec, w).phases["update"]
    return {
        "name": p.name,
        **dataclasses.asdict(p),
        "params": spec.total_params,
        "image_tokens": r.image_tokens,
        "trace_peak_gib": round(r.peak_bytes / GiB, 4),
        "closed_form_gib": round(closed / GiB, 4),
        "difference_pct": round(100 * (closed / r.peak_bytes - 1), 2),
        "trace_seconds": round(time.perf_counter() - t0, 1),
        "trace_breakdown_gib": {k: round(v / GiB, 4) for k, v in r.peak_breakdown.items()},
    }


PX_LOW, PX_HIGH = 448 * 448, 896 * 896


def trace_grid() -> list[GridPoint]:
    g = [
        GridPoint("tiny-full-G4", "tiny", 4, 4, False, False, PX_LOW),
        GridPoint("tiny-lora-G8-gc", "tiny", 8, 8, True, True, PX_HIGH),
        GridPoint("tiny-qwen2-full-G16", "tiny-qwen2", 16, 8, False, False, PX_LOW),
        GridPoint("2b-full-G8-gc", "qwen2-vl-2b", 8, 4, True, False, PX_HIGH),
        GridPoint("2b-lora-G4", "qwen2-vl-2b", 4, 4, False, True, PX_LOW),
        GridPoint("3b-full-G4", "qwen2.5-vl-3b", 4, 2, False, False, PX_LOW),
        GridPoint("3b-full-G8-gc", "qwen2.5-vl-3b", 8, 4, True, False, PX_LOW),
        GridPoint("3b-lora-G8", "qwen2.5-vl-3b", 8, 4, False, True, PX_LOW),
        GridPoint("3b-lora-G16-gc-896px", "qwen2.5-vl-3b", 16, 8, True, True, PX_HIGH),
        GridPoint("3b-full-G16-896px", "qwen2.5-vl-3b", 16, 4, False, False, PX_HIGH),
        GridPoint("7b-lora-G8", "qwen2.5-vl-7b", 8, 4, False, True, PX_LOW),
        GridPoint("7b-lora-G16-gc-896px", "qwen2.5-vl-7b", 16, 16, True, True, PX_HIGH),
        GridPoint("7b-full-G4-gc", "qwen2.5-vl-7b", 4, 4, True, False, PX_LOW),
        GridPoint("7b-full-G8-896px", "qwen2.5-vl-7b", 8, 2, False, False, PX_HIGH),
        GridPoint("3b-lora-G8-prefix", "qwen2.5-vl-3b", 8, 8, False, True, PX_LOW, shared_prefix=True),
        GridPoint("qwen2-7b-lora-G4", "qwen2-vl-7b", 4, 4, False, True, PX_HIGH),
        # The defaults (shared prefix on, full fine-tuning), eager attention and SFT stages (issue 13).
        GridPoint("3b-full-G4-prefix (default)", "qwen2.5-vl-3b", 4, 4, False, False, PX_LOW, shared_prefix=True),
        GridPoint("3b-full-G8-prefix-gc", "qwen2.5-vl-3b", 8, 4, True, False, PX_LOW, shared_prefix=True),
        GridPoint("7b-full-G4-prefix", "qwen2.5-vl-7b", 4, 4, False, False, PX_LOW, shared_prefix=True),
        GridPoint("7b-lora-G8-prefix", "qwen2.5-vl-7b", 8, 8, False, True, PX_HIGH, shared_prefix=True),
        GridPoint("3b-full-G4-eager", "qwen2.5-vl-3b", 4, 4, False, False, PX_LOW, shared_prefix=True, attn="eager"),
        GridPoint("3b-full-G4-eager-gc", "qwen2.5-vl-3b", 4, 4, True, False, PX_LOW, shared_prefix=True, attn="eager"),
        GridPoint("3b-lora-G8-eager-896px", "qwen2.5-vl-3b", 8, 4, False, True, PX_HIGH, attn="eager"),
        GridPoint("2b-full-G4-eager (qwen2-vl)", "qwen2-vl-2b", 4, 4, False, False, PX_LOW, attn="eager"),
        GridPoint("3b-sft-stage1", "qwen2.5-vl-3b", 1, 4, False, False, PX_LOW, completion=256, sft_stage=1),
        GridPoint("3b-sft-stage2", "qwen2.5-vl-3b", 1, 4, False, False, PX_LOW, completion=256, sft_stage=2, freeze_vision=True),
        GridPoint("7b-sft-stage2-gc", "qwen2.5-vl-7b", 1, 8, True, False, PX_HIGH, completion=512, sft_stage=2, freeze_vision=True),
        GridPoint("7b-sft-stage2-lora-eager", "qwen2.5-vl-7b", 1, 4, False, True, PX_LOW, completion=512, sft_stage=2, attn="eager"),
        # Qwen3-VL (patch 16, DeepStack) and Qwen3-VL-MoE (issue 16): tiny configs and the real sizes.
        GridPoint("tiny-qwen3-full-G8", "tiny-qwen3", 8, 4, False, False, PX_LOW),
        GridPoint("tiny-qwen3-lora-G4-gc", "tiny-qwen3", 4, 4, True, True, PX_LOW),
        GridPoint("tiny-qwen3moe-full-G8", "tiny-qwen3-moe", 8, 4, False, False, PX_LOW),
        GridPoint("tiny-qwen3moe-lora-G8-prefix", "tiny-qwen3-moe", 8, 8, False, True, PX_LOW, shared_prefix=True),
        GridPoint("q3-8b-full-G4", "qwen3-vl-8b", 4, 4, False, False, PX_LOW),
        GridPoint("q3-8b-lora-G8-gc", "qwen3-vl-8b", 8, 8, True, True, PX_LOW),
        GridPoint("q3-8b-full-G8-prefix", "qwen3-vl-8b", 8, 8, False, False, PX_LOW, shared_prefix=True),
        GridPoint("q3-30b-a3b-lora-G8-gc", "qwen3-vl-30b-a3b", 8, 8, True, True, PX_LOW),
        GridPoint("q3-30b-a3b-full-G8-prefix", "qwen3-vl-30b-a3b", 8, 8, False, False, PX_LOW, shared_prefix=True),
        # Gemma 3 (4 norms per decoder layer, 256 pooled image tokens).
        GridPoint("tiny-gemma3-full-G8", "tiny-gemma3", 8, 4, False, False, PX_LOW),
        GridPoint("tiny-gemma3-lora-G4-gc", "tiny-gemma3", 4, 4, True, True, PX_LOW),
        GridPoint("g3-4b-lora-G4", "gemma3-4b", 4, 4, False, True, PX_LOW),
        GridPoint("g3-4b-full-G8", "gemma3-4b", 8, 4, False, False, PX_LOW),
        GridPoint("g3-4b-full-G8-prefix", "gemma3-4b", 8, 8, False, False, PX_LOW, shared_prefix=True),
        GridPoint("g3-12b-lora-G8-gc", "gemma3-12b", 8, 8, True, True, PX_LOW),
        # Video rows (Qwen2-VL / Qwen2.5-VL; data.max_frames 16 at video_max_pixels 128*28*28 = 8 x 484 patches): the shared
        # prefix encodes each prompt's video once, the grouped path without it hands the batch to the naive path (per row).
        GridPoint(
            "tiny-video8-full-G4-prefix", "tiny", 4, 4, False, False, 224 * 224, shared_prefix=True, video_frames=8, video_max_pixels=112 * 112
        ),
        GridPoint("3b-video16-full-G4-prefix", "qwen2.5-vl-3b", 4, 4, False, False, PX_LOW, shared_prefix=True, video_frames=16, images=0),
        GridPoint("3b-video16-full-G4 (naive)", "qwen2.5-vl-3b", 4, 4, False, False, PX_LOW, video_frames=16, images=0),
        GridPoint("3b-video8+image-lora-G8-gc", "qwen2.5-vl-3b", 8, 4, True, True, PX_LOW, shared_prefix=True, video_frames=8),
        GridPoint("2b-video16-full-G4-prefix", "qwen2-vl-2b", 4, 4, False, False, PX_LOW, shared_prefix=True, video_frames=16, images=0),
        GridPoint("2b-video16-lora-G4 (naive)", "qwen2-vl-2b", 4, 4, False, True, PX_LOW, video_frames=16, images=0),
        # Qwen3-VL / Qwen3.5 video rows: 8 timestamp text tokens per temporal patch (`<t seconds>` + vision start/end).
        GridPoint("q3-4b-video16-full-G4-prefix", "qwen3-vl-4b", 4, 4, False, False, PX_LOW, shared_prefix=True, video_frames=16, images=0),
        GridPoint("q3-4b-video16-full-G4 (naive)", "qwen3-vl-4b", 4, 4, False, False, PX_LOW, video_frames=16, images=0),
        GridPoint("q3-8b-video16+image-lora-G8-gc", "qwen3-vl-8b", 8, 8, True, True, PX_LOW, shared_prefix=True, video_frames=16),
        GridPoint("mid-qwen35-video16-lora-G4-prefix", "mid-qwen35", 4, 4, False, True, PX_LOW, shared_prefix=True, video_frames=16, images=0),
        # Qwen3.5 (hybrid: 3 Gated DeltaNet layers per gated full-attention layer): tiny, and 8 layers at the widths of
        # public ~4B Qwen3.5 configs (hidden 2560, 32 value heads of 128; not a published model); Qwen3.5-MoE tiny.
        GridPoint("tiny-qwen35-full-G8", "tiny-qwen35", 8, 4, False, False, PX_LOW),
        GridPoint("tiny-qwen35-lora-G4-gc", "tiny-qwen35", 4, 4, True, True, PX_LOW),
        GridPoint("tiny-qwen35-full-G8-prefix", "tiny-qwen35", 8, 8, False, False, PX_LOW, shared_prefix=True),
        GridPoint("mid-qwen35-full-G4", "mid-qwen35", 4, 4, False, False, PX_LOW),
        GridPoint("mid-qwen35-full-G8-gc", "mid-qwen35", 8, 8, True, False, PX_HIGH),
        GridPoint("mid-qwen35-lora-G8-prefix", "mid-qwen35", 8, 8, False, True, PX_LOW, shared_prefix=True),
        GridPoint("mid-qwen35-lora-G4-long", "mid-qwen35", 4, 4, False, True, PX_LOW, completion=1024),
        GridPoint("tiny-qwen35moe-full-G8", "tiny-qwen35-moe", 8, 4, False, False, PX_LOW),
        # Tiled families (naive path: vision per row, no shared prefix): InternVL dynamic tiles, LLaVA-OneVision anyres.
        GridPoint("tiny-internvl-full-G4 (120x120: 5 tiles)", "tiny-internvl", 4, 4, False, False, 120 * 120),
        GridPoint("tiny-llava-onevision-full-G4 (90x90)", "tiny-llava-onevision", 4, 4, False, False, 90 * 90),
        GridPoint("internvl3-1b-full-G4 (672px: 5 tiles)", "internvl3-1b", 4, 4, False, False, 672 * 672),
        GridPoint("internvl3-2b-lora-G8-gc (896px)", "internvl3-2b", 8, 4, True, True, PX_HIGH),
        GridPoint("ov-7b-full-G4 (672px)", "llava-onevision-qwen2-7b", 4, 4, False, False, 672 * 672),
        GridPoint("ov-7b-lora-G8 (448px)", "llava-onevision-qwen2-7b", 8, 4, False, True, PX_LOW),
    ]
    return g


def _vision_cell(r: dict) -> str:
    """max_pixels (image tokens), or for video rows the frames, their cap and the prompt's vision tokens."""
    if not r.get("video_frames"):
        return f"{r['max_pixels']} ({r['image_tokens']})"
    images = f"{r['images']} x {r['max_pixels']} + " if r.get("images") else ""
    return f"{images}video {r['video_frames']} frames x {r['video_max_pixels']} ({r['image_tokens']})"


def _md_trace(rows: list[dict], date: str) -> str:
    intro = (
        "Update-step peak (weights + gradients + AdamW states + activations / temporaries) of one micro-batch in steady state; "
        "bf16 weights, no autocast, group_vision on (SFT: each row its own prompt and image). Eager rows run transformers' own "
        "eager attention on the meta device; the others the fused-kernel stand-in. `python benchmarks/planner_accuracy.py trace`."
    )
    lines = [
        f"# Planner closed form vs exact trace ({date}, CPU, meta device)",
        "",
        intro,
        "",
        "| config | params | mode | G | micro-batch | grad ckpt | prefix | attention | LoRA | max_pixels or video (vision tokens) | trace GiB | "
        "closed form GiB | diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mode = f"SFT {r['sft_stage']}" if r.get("sft_stage") else "GRPO"
        lines.append(
            f"| {r['name']} | {r['params'] / 1e9:.2f} B | {mode} | {r['G'] if mode == 'GRPO' else '-'} | {r['micro_batch']} | "
            f"{'on' if r['gc'] else 'off'} | {'on' if r['shared_prefix'] and mode == 'GRPO' else 'off'} | {r['attn']} | "
            f"{'r16' if r['lora'] else 'full'} | {_vision_cell(r)} | {r['trace_peak_gib']:.3f} | "
            f"{r['closed_form_gib']:.3f} | {r['difference_pct']:+.1f}% |"
        )
    within = sum(abs(r["difference_pct"]) <= 10 for r in rows)
    within3 = sum(abs(r["difference_pct"]) <= 3 for r in rows)
    lines += [
        "",
        f"Within +/-10%: {within} of {len(rows)}; within +/-3%: {within3}; largest |difference| {max(abs(r['difference_pct']) for r in rows):.1f}%.",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- closed form vs real CPU runs (host peak RSS)

MID = {"hidden_size": 1024, "num_layers": 8, "intermediate_size": 2816, "num_heads": 8, "num_kv_heads": 2, "vision_hidden": 256, "vision_depth": 4}
CPU_GRID = [  # name, tiny-model dims, command, config overrides
    ("tiny-grpo-full", {}, "train", []),
    ("tiny-grpo-lora", {}, "train", ["model.use_lora=true", "model.lora_r=8"]),
    ("tiny-sft-stage1", {}, "sft", ["sft.projector_steps=2", "sft.steps=0"]),
    ("mid-grpo-full", MID, "train", []),
    ("mid-grpo-full-eager", MID, "train", ["model.attn_implementation=eager"]),
    ("mid-grpo-lora", MID, "train", ["model.use_lora=true", "model.lora_r=16"]),
    ("mid-grpo-full-gc", MID, "train", ["model.gradient_checkpointing=true"]),
    (
        "mid-grpo-G8-long",
        MID,
        "train",
        [
            "rollout.num_generations=8",
            "rollout.generation_batch_size=16",
            "training.per_device_train_batch_size=8",
            "rollout.max_completion_length=48",
        ],
    ),
    ("mid-sft-stage2", MID, "sft", ["sft.projector_steps=0", "sft.steps=2"]),
    ("mid-sft-stage2-eager", MID, "sft", ["sft.projector_steps=0", "sft.steps=2", "model.attn_implementation=eager"]),
]


def cpu_run(name: str, dims: dict, command: str, overrides: list[str], work: Path, model: Path | None = None) -> dict:
    """One real `vlmrl train` / `vlmrl sft` of 2 steps on the CPU in a fresh process; the planner's logged
    prediction (plan/*) next to the measured lifetime peak RSS (mem/host_peak_rss) of that process. `model`: a
    trained model folder instead of a tiny one built with `dims`."""
    import subprocess

    from vlmrl.data.tasks import make_count_task
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    model = model or work / f"model-{abs(hash(json.dumps(dims, sort_keys=True))) % 10**8}"
    if not (model / "config.json").exists():
        build_tiny_qwen25vl(model, **dims)
    data = work / "count"
    if not (data / "train.jsonl").exists():
        make_count_task(data, n_train=32, n_test=8, seed=0, image_size=56)
    out = work / name
    args = [
        f"model.name_or_path={model}",
        f"data.train_path={data / 'train.jsonl'}",
        "data.eval_path=",
        f"training.output_dir={out}",
        "training.device=cpu",
        "training.max_steps=2",
        "rollout.num_generations=4",
        "rollout.generation_batch_size=8",
        "training.per_device_train_batch_size=4",
        "training.gradient_accumulation_steps=1",
        "rollout.max_completion_length=16",
        "sft.batch_size=4",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "training.resume=never",
        "training.overwrite_output_dir=true",
        *overrides,
    ]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vlmrl", command, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "plan/host_peak_rss" in r][-1]
    measured, predicted, runtime = last["mem/host_peak_rss"], last["plan/host_peak_rss"], last["plan/host_runtime"]
    tools = {k: round(sum(r.get(k, 0.0) for r in rows) / len(rows), 3) for k in ("tools/turns_mean", "tools/calls_mean") if k in last}
    return {
        **({"tools_mean_over_steps": tools} if tools else {}),
        "name": name,
        "command": command,
        "dims": dims or "tiny defaults",
        "overrides": overrides,
        "measured_peak_rss_gib": round(measured, 4),
        "predicted_peak_rss_gib": round(predicted, 4),
        "runtime_at_prediction_gib": round(runtime, 4),
        "predicted_tensors_gib": round(last["plan/peak_allocated"], 4),
        "difference_pct": round(100 * (predicted / measured - 1), 2),
        "above_runtime_difference_pct": round(100 * ((predicted - runtime) / (measured - runtime) - 1), 2),
        "seconds": round(time.perf_counter() - t0, 1),
    }


# Multi-turn GRPO with the zoom tool (issue 28): a tiny model trained to call it (benchmarks/zoom_task.py's tool SFT
# model, --model), the zoom task's rows; 2 steps each, as the cpu grid. tools.max_turn_tokens is the planner's turn length.
MT_COMMON = [
    "rollout.engine=continuous",
    "tools.tools=[zoom]",
    "tools.max_turn_tokens=96",
    "tools.max_total_tokens=256",
    "rollout.max_completion_length=96",
    "algorithm.reward_funcs=[accuracy]",
]
MT_GRID = [
    ("tiny-grpo-zoom-single-turn", ["rollout.max_completion_length=96", "algorithm.reward_funcs=[accuracy]"]),
    ("tiny-grpo-zoom-2turns", MT_COMMON + ["tools.max_turns=2"]),
    (
        "tiny-grpo-zoom-3turns-G8",
        MT_COMMON + ["tools.max_turns=3", "rollout.num_generations=8", "rollout.generation_batch_size=16", "training.per_device_train_batch_size=8"],
    ),
    # 30 steps of 32 completions: the peak of a longer run (before engine/host_alloc.py it grew step after step); learning
    # rate 0 keeps the policy calling the tool all along (with the tiny defaults' rate it had stopped: 0.06 calls per rollout)
    (
        "tiny-grpo-zoom-2turns-32x30steps",
        MT_COMMON
        + [
            "tools.max_turns=2",
            "rollout.num_generations=8",
            "rollout.generation_batch_size=32",
            "training.per_device_train_batch_size=32",
            "training.max_steps=30",
            "optim.learning_rate=0",
        ],
    ),
]


def multiturn_runs(model: Path, work: Path, only: str = "") -> list[dict]:
    """cpu_run of MT_GRID on the zoom task with `model` (which calls the tool, so the rollouts are multi-turn)."""
    from vlmrl.data.tasks import make_zoom_task

    data = work / "zoom"
    files = make_zoom_task(data, n_train=32, n_test=0)
    rows = []
    for name, overrides in MT_GRID:
        if only and name not in only.split(","):
            continue
        rows.append(cpu_run(name, {}, "train", [f"data.train_path={files['train']}", *overrides], work, model=model))
    return rows


def _md_cpu(rows: list[dict], date: str, machine: str) -> str:
    lines = [
        f"# Planner host prediction vs real CPU runs ({date}, {machine})",
        "",
        "Each row: `vlmrl train` or `vlmrl sft` for 2 steps with training.device=cpu in a fresh process "
        "(`python benchmarks/planner_accuracy.py cpu`); the planner's prediction logged by the run itself (plan/host_peak_rss: "
        "a runtime term = max(the RSS when it predicts, 0.38 GiB), + the planned tensors x 1.12, loading and buffers) vs that "
        "process's lifetime peak RSS (mem/host_peak_rss). 'above runtime' compares only the part above the runtime term "
        "(meaningless for the tiny rows, whose tensors are 0.01-0.02 GiB). The two constants (0.38 GiB, 12%) were read off "
        "tiny-grpo-full / tiny-sft-stage1 and mid-grpo-full / mid-sft-stage2 of an earlier run of this grid: those four rows "
        "are in-sample, the other six are not. Count task, 56 px images (16 image tokens), 16 completion tokens, fp32 weights; "
        "mid = 8 layers x 1024 hidden (0.10 B parameters).",
        "",
        "| run | command | measured peak RSS GiB | predicted GiB | diff | runtime term GiB | above runtime: diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['command']} | {r['measured_peak_rss_gib']:.3f} | {r['predicted_peak_rss_gib']:.3f} | "
            f"{r['difference_pct']:+.1f}% | {r['runtime_at_prediction_gib']:.3f} | {r['above_runtime_difference_pct']:+.1f}% |"
        )
    within = sum(abs(r["above_runtime_difference_pct"]) <= 10 for r in rows)
    lines += [
        "",
        f"Above-runtime within +/-10%: {within} of {len(rows)}; whole peak within +/-10%: "
        f"{sum(abs(r['difference_pct']) <= 10 for r in rows)} of {len(rows)}.",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- closed form vs measured GPU peaks


def _overrides(rec: dict) -> dict:
    out = {}
    for o in rec.get("overrides", []):
        k, v = o.split("=", 1)
        out[k] = v
    return out


def workload_from_record(rec: dict, grouped: bool, gpu_bytes: int) -> Workload:
    """The Workload of one gpu_memory benchmark record (the same train.py settings it ran with).

    Those runs predate memory.shared_prefix (so it is off); the plain JSON ran the naive log-prob path
    (group_vision off: one vision pass per completion row), the `_grouped` JSON the grouped path."""
    o = _overrides(rec)
    G = int(o["rollout.num_generations"])
    gen = int(o["rollout.generation_batch_size"])
    return Workload(
        dtype=o.get("model.dtype", "float32"),
        autocast=o.get("training.bf16") == "true",
        use_lora=o.get("model.use_lora") == "true",
        lora_r=int(o.get("model.lora_r", 16)),
        gradient_checkpointing=o.get("model.gradient_checkpointing") == "true",
        num_generations=G,
        prompts_per_step=gen // G,
        micro_batch=int(o["training.per_device_train_batch_size"]),
        grad_accum=int(o["training.gradient_accumulation_steps"]),
        prompt_text_tokens=41,  # the count task's prompt: 42 tokens, one image placeholder
        max_pixels=int(o["data.max_pixels"]),
        completion_tokens=int(o["rollout.max_completion_length"]),
        logprob_chunk_tokens=1024,
        group_vision=grouped,
        shared_prefix=False,
        gpu_memory_bytes=gpu_bytes,
    )


def compare_measured(paths: list[Path]) -> tuple[list[dict], dict]:
    rows, meta = [], {}
    for path in paths:
        d = json.loads(path.read_text())
        grouped = path.stem.endswith("_grouped")
        spec = model_spec(d["preset"])
        gpu = int(d["gpu_total_memory_gib"] * GiB)
        meta = {"device": d["device"], "measured_on": d["date"][:10], "torch": d.get("torch"), "transformers": d.get("transformers")}
        for rec in d["records"]:
            w = workload_from_record(rec, grouped, gpu)
            p = plan(spec, w)
            row = {
                "file": path.name,
                "preset": d["preset"],
                "config": rec["name"],
                "log_prob_path": "grouped" if grouped else "naive",
                "predicted_reserved_gib": round(p.reserved / GiB, 3),
                "predicted_allocated_gib": round(p.peak_allocated / GiB, 3),
                "predicted_total_with_context_gib": round(p.total / GiB, 3),
                "predicted_fits": p.fits,
                "predicted_phase_peaks_gib": {k: round(v / GiB, 3) for k, v in p.phases.items()},
            }
            if rec.get("oom"):
                partial = rec.get("partial") or {}
                row.update(
                    measured="OOM",
                    measured_reserved_gib=partial.get("gpu_peak_reserved_gib"),
                    note="out of memory on the device"
                    + (f" in step 2 after step 1 peaked at {partial['gpu_peak_reserved_gib']} GiB reserved" if partial else ""),
                    verdict_correct=not p.fits,
                )
            else:
                mr, ma = rec["gpu_peak_reserved_gib"], rec["gpu_peak_allocated_gib"]
                row.update(
                    measured_reserved_gib=mr,
                    measured_allocated_gib=ma,
                    reserved_difference_pct=round(100 * (p.reserved / GiB / mr - 1), 2),
                    allocated_difference_pct=round(100 * (p.peak_allocated / GiB / ma - 1), 2),
                    within_10pct=abs(p.reserved / GiB / mr - 1) <= 0.10,
                    verdict_correct=p.fits,
                )
            rows.append(row)
    return rows, meta


def _md_measured(rows: list[dict], meta: dict, predicted_on: str) -> str:
    intro = (
        f"Measured earlier with benchmarks/gpu_memory.py (torch {meta.get('torch')}, transformers {meta.get('transformers')}); "
        f"predicted on {predicted_on} by the closed form from the configs the JSONs record. One global constant comes from "
        "these runs: the allocator reserve (reserved / allocated - 1 = 6%, the mean over the ten successful Qwen2.5-VL-3B runs); the CUDA "
        "context (0.6 GiB) is not part of max_memory_reserved and only enters the fits / does-not-fit verdict."
    )
    lines = [
        f"# Planner prediction vs measured GPU peaks ({meta.get('device')}, measured {meta.get('measured_on')})",
        "",
        intro,
        "",
        "| file | config | path | measured reserved GiB | predicted reserved GiB | diff | measured allocated | predicted allocated | diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("measured") == "OOM":
            lines.append(
                f"| {r['file']} | {r['config']} | {r['log_prob_path']} | OOM | {r['predicted_reserved_gib']:.2f} "
                f"(+ctx {r['predicted_total_with_context_gib']:.2f}: {'fits' if r['predicted_fits'] else 'does not fit'}) | "
                f"verdict {'right' if r['verdict_correct'] else 'WRONG'} | | | |"
            )
        else:
            lines.append(
                f"| {r['file']} | {r['config']} | {r['log_prob_path']} | {r['measured_reserved_gib']:.2f} | "
                f"{r['predicted_reserved_gib']:.2f} | "
                f"{r['reserved_difference_pct']:+.1f}% | {r['measured_allocated_gib']:.2f} | {r['predicted_allocated_gib']:.2f} | "
                f"{r['allocated_difference_pct']:+.1f}% |"
            )
    ok = [r for r in rows if "within_10pct" in r]
    ooms = [r for r in rows if r.get("measured") == "OOM"]
    summary = (
        f"Within +/-10% of max_memory_reserved: {sum(r['within_10pct'] for r in ok)} of {len(ok)} measured configs; "
        f"OOM verdicts right: {sum(r['verdict_correct'] for r in ooms)} of {len(ooms)}."
    )
    lines += ["", summary]
    return "\n".join(lines) + "\n"


def _multiturn_mode(args, out: Path, today: str) -> int:
    import os
    import platform
    import tempfile

    if not args.model:
        raise SystemExit("multiturn: --model DIR (a model that calls the zoom tool, e.g. benchmarks/zoom_task.py's sft_tool/final)")
    machine = f"CPU {platform.machine()}, {os.cpu_count()} cores (shared), load {'/'.join(f'{v:.1f}' for v in os.getloadavg())} at the start"
    with tempfile.TemporaryDirectory() as tmp:
        rows = multiturn_runs(Path(args.model), Path(tmp), args.only)
    for r in rows:
        got = f"measured {r['measured_peak_rss_gib']:.3f} predicted {r['predicted_peak_rss_gib']:.3f} {r['difference_pct']:+.1f}%"
        print(f"{r['name']:<28} {got} {r.get('tools_mean_over_steps', {})}")
    stem = out / f"planner_accuracy_cpu_multiturn_{today}"
    stem.with_suffix(".json").write_text(json.dumps({"date": today, "machine": machine, "model": args.model, "rows": rows}, indent=1))
    note = (
        "Multi-turn rows: `python benchmarks/planner_accuracy.py multiturn --model <tool SFT model>`: GRPO with tools.tools=[zoom] on the "
        "zoom task (448x448 images seen at 56x56), rollout.engine=continuous; the planner's turn length is tools.max_turn_tokens (96), "
        "its sequence tools.max_turns x that + 32 text tokens and one image per tool turn (capped at tools.max_total_tokens=256). "
        "tools_mean_over_steps: turns and tool calls per rollout the run actually made. " + (args.note or "")
    )
    stem.with_suffix(".md").write_text(_md_cpu(rows, today, machine) + "\n" + note + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("trace", "measured", "field", "cpu", "multiturn", "trl", "deepspeed", "_trl_child"))
    ap.add_argument("--model", help="multiturn: a model trained to call the zoom tool (zoom_task.py's sft_tool/final)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--only", default="", help="trace: comma-separated grid names")
    ap.add_argument("--inputs", nargs="*", default=None, help="measured: gpu_memory_*.json files (default: all in benchmarks/results)")
    ap.add_argument("--rounds", type=int, default=1, help="trl: fresh TRL processes per config (peak RSS varies between them)")
    ap.add_argument("--python", default=None, help="trl: a Python with TRL installed (default /work/venv-extras/bin/python)")
    ap.add_argument("--note", default=None, help="cpu / trl / deepspeed: a paragraph added to the results file (machine state, context)")
    ap.add_argument("--reuse", default=None, help="deepspeed: predict again for the runs measured in this planner_deepspeed_cpu_*.json")
    ap.add_argument("--compare", default=None, help="deepspeed: an earlier planner_deepspeed_cpu_*.json whose rows are listed beside these")
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mode == "_trl_child":
        from planner_vs_trl import child

        return child(args.spec, args.result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    today = _dt.date.today().isoformat()
    if args.mode == "field":
        rows = field_verdicts()
        for r in rows:
            print(
                f"{r['id']:<18} {r['model']:<14} {r['gpus']}x{r['gpu_memory']:<7} predicted {r['predicted_total_gib']:6.1f} GiB "
                f"{'fits' if r['fits'] else 'DOES NOT FIT':<13} | reported: {r['outcome']}"
                + (f" | {r['also']}" if "also" in r else "")
                + (f" | profile: {r['profile']}" if "profile" in r else "")
            )
        (out / "planner_field_reports.json").write_text(json.dumps({"date": today, "rows": rows}, indent=1))
        return 0
    if args.mode == "trl":
        return _trl_mode(args, out, today)
    if args.mode == "deepspeed":
        return _deepspeed_mode(args, out, today)
    if args.mode == "multiturn":
        return _multiturn_mode(args, out, today)
    if args.mode == "cpu":
        import platform
        import tempfile

        machine = f"CPU {platform.machine()}, {__import__('os').cpu_count()} cores (shared)"
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for name, dims, command, overrides in CPU_GRID:
                if args.only and name not in args.only.split(","):
                    continue
                r = cpu_run(name, dims, command, overrides, Path(tmp))
                rows.append(r)
                print(
                    f"{name:<24} measured {r['measured_peak_rss_gib']:.3f} GiB predicted {r['predicted_peak_rss_gib']:.3f} GiB "
                    f"{r['difference_pct']:+6.1f}%  above runtime {r['above_runtime_difference_pct']:+6.1f}%  ({r['seconds']} s)",
                    flush=True,
                )
        (out / f"planner_accuracy_cpu_runs_{today}.json").write_text(json.dumps({"date": today, "machine": machine, "rows": rows}, indent=1))
        (out / f"planner_accuracy_cpu_runs_{today}.md").write_text(_md_cpu(rows, today, machine) + (f"\n{args.note}\n" if args.note else ""))
        return 0
    if args.mode == "trace":
        grid = [g for g in trace_grid() if not args.only or g.name in args.only.split(",")]
        rows = []
        for g in grid:
            r = compare_trace(g)
            rows.append(r)
            print(
                f"{r['name']:<24} trace {r['trace_peak_gib']:8.3f} GiB  closed {r['closed_form_gib']:8.3f} GiB  {r['difference_pct']:+6.1f}%  "
                f"({r['trace_seconds']} s)",
                flush=True,
            )
        data = {
            "date": today,
            "machine": "CPU (meta device trace)",
            "rows": rows,
            "within_10pct": sum(abs(r["difference_pct"]) <= 10 for r in rows),
            "configs": len(rows),
        }
        (out / f"planner_accuracy_cpu_trace_{today}.json").write_text(json.dumps(data, indent=1))
        (out / f"planner_accuracy_cpu_trace_{today}.md").write_text(_md_trace(rows, today))
        return 0 if data["within_10pct"] == len(rows) else 1
    paths = [Path(p) for p in args.inputs] if args.inputs else sorted((ROOT / "benchmarks" / "results").glob("gpu_memory_*.json"))
    rows, meta = compare_measured(paths)
    for r in rows:
        print(json.dumps({k: r[k] for k in r if k not in ("predicted_phase_peaks_gib",)}))
    dev = "h100" if "H100" in (meta.get("device") or "") else (meta.get("device") or "gpu").split()[-1].lower()
    stem = f"planner_vs_{dev}_{meta.get('measured_on')}"
    data = {
        "device": meta.get("device"),
        "measured_on": meta.get("measured_on"),
        "predicted_on": today,
        "note": "measured earlier on the GPU; predicted now by the closed form from the recorded configs",
        "constants": {"allocator_reserve": 0.06, "cuda_context_gib": 0.6},
        "rows": rows,
    }
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text(_md_measured(rows, meta, today))
    return 0


def _deepspeed_mode(args, out: Path, today: str) -> int:
    """ZeRO-2/3 runs on 2 CPU processes vs the planner (benchmarks/planner_deepspeed.py); --reuse predicts again for
    the runs a results file holds (their measurements kept as they are)."""
    import platform
    import tempfile

    from planner_deepspeed import markdown, measure, predict

    measured_keys = ("name", "command", "deepspeed_config", "overrides", "output_dir", "runtime_at_prediction_gib", "logged_prediction_gib")
    if args.reuse:
        old = json.loads(Path(args.reuse).read_text())
        runs, machine, date = old["rows"], old["machine"], old["date"]
        kept = (*measured_keys, "malloc_env", "ranks", "seconds", "load_at_start", "load_at_end", "config", "pass")
        kept += ("mmap_threshold_pinned", "step_times_s")
        runs = [{k: v for k, v in r.items() if k in kept} for r in runs]
        extra = {k: old[k] for k in ("exploratory", "note", "compare") if k in old}
    else:
        machine, date, extra = f"CPU {platform.machine()}, {__import__('os').cpu_count()} cores (shared)", today, {}
        with tempfile.TemporaryDirectory() as tmp:
            runs = json.loads(json.dumps(measure(Path(tmp), args.only)))  # as a results file holds them (rank keys "0", "1")
            for r in runs:  # predict needs the run's config.yaml: keep it in the results
                r["config"] = (Path(r["output_dir"]) / "config.yaml").read_text()
            # the measurements first (predicting again from them: --reuse), then the predictions
            raw = {"date": date, "predicted_on": today, "machine": machine, "rows": runs}
            (out / f"planner_deepspeed_cpu_{date}_measured.json").write_text(json.dumps(raw, indent=1))
    rows = [r | predict(r) for r in runs]
    for r in rows:
        m, p = r["measured_peak_rss_gib"], r["predicted_peak_rss_gib"]
        print(f"{r['name']:<26} measured {m:.3f} predicted {p:.3f} GiB {r['difference_pct']:+6.1f}%")
    if args.note:
        extra["note"] = args.note
    if args.compare:  # the earlier file's figures as it recorded them (its measurements and its planner's predictions)
        before = json.loads(Path(args.compare).read_text())
        keys = ("measured_peak_rss_gib", "predicted_peak_rss_gib", "difference_pct", "peak_segment", "malloc_env")
        then = {r["name"]: {k: r.get(k) for k in keys} for r in before["rows"]}
        extra["compare"] = {"file": Path(args.compare).name, "date": before["date"], "rows": then}
    data = {"date": date, "predicted_on": today, "machine": machine, "rows": rows, **extra}
    (out / f"planner_deepspeed_cpu_{date}.json").write_text(json.dumps(data, indent=1))
    (out / f"planner_deepspeed_cpu_{date}.md").write_text(markdown(data))
    return 0 if all(abs(r["difference_pct"]) <= 10 for r in rows) else 1


def _trl_mode(args, out: Path, today: str) -> int:
    """Profiles naive / trl vs TRL GRPOTrainer's measured peak RSS (benchmarks/planner_vs_trl.py)."""
    import os
    import platform
    import shlex
    import tempfile

    from planner_vs_trl import DEFAULT_PYTHON, markdown, merge, run

    names = [n for n in (args.only or "a,b,c,d").split(",") if n]
    machine = f"CPU {platform.machine()}, {os.cpu_count()} cores (shared)"
    command = shlex.join(["python", "benchmarks/planner_accuracy.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory() as tmp:
        rows = [{**r, "command": command} for r in run(names, args.python or DEFAULT_PYTHON, Path(tmp), args.rounds)]
    for r in rows:
        print(
            f"{r['config']}: measured {r['measured_peak_rss_gib']:.3f} GiB; naive {r['naive']['predicted_peak_rss_gib']:.3f} "
            f"({r['naive']['difference_pct']:+.1f}%), trl {r['trl']['predicted_peak_rss_gib']:.3f} ({r['trl']['difference_pct']:+.1f}%)"
        )
    path = out / f"planner_accuracy_trl_cpu_{today}.json"
    if path.is_file():  # a later run of some configs (more rounds) replaces those configs' rows only
        rows = merge(json.loads(path.read_text())["rows"], rows)
    notes = [n for n in (json.loads(path.read_text()).get("note") if path.is_file() else None, args.note) if n]
    note = "\n\n".join(dict.fromkeys(notes)) or None
    record = {"date": today, "machine": machine, "command": command, "note": note, "rows": rows}
    path.write_text(json.dumps(record, indent=1))
    (out / f"planner_accuracy_trl_cpu_{today}.md").write_text(markdown(rows, today, machine, command, note))
    return 0


# ---------------------------------------------------------------- public field reports

# Public reports with enough configuration to evaluate (docs/planner.md lists them with the verdicts). Settings the
# reports do not state are assumptions, named in "assumed". Frameworks of early 2025 (TRL-based R1-V / VLM-R1 /
# ms-swift) computed full-vocabulary logits (logprob chunking off), ran the naive path (no grouped vision, no shared
# prefix), kept a reference model (beta 0.04 by default) and ran DeepSpeed ZeRO-3 with bf16 (fp32 master + moments).
FIELD_REPORTS = [
    {
        "id": "R1-V#71",
        "profile": {"profile": "naive", "logits_positions": "sequence"},  # R1-V's trainer: model(...).logits over the whole sequence
        "url": "https://github.com/StarsfieldAI/R1-V/issues/71",
        "model": "qwen2.5-vl-7b",
        "gpus": 4,
        "gpu_memory": "a100-80gb",
        "outcome": "OOM in step 1 (zero3.json); the thread says the ZeRO-3 offload config is needed",
        "settings": dict(
            sharding="zero3",
            micro_batch=4,
            num_generations=4,
            prompts_per_step=1,
            grad_accum=2,
            gradient_checkpointing=False,
            max_pixels=401408,
            completion_tokens=512,
            prompt_text_tokens=100,
            beta=0.04,
        ),
        "assumed": "100 text tokens per prompt; TRL < 0.15 semantics (1 prompt x G=4 completions per device in one forward)",
        "also": {"label": "same with ZeRO-3 + optimizer/param offload", "settings": dict(offload="optimizer+params")},
    },
    {
        "id": "ms-swift#4311",
        "profile": {"profile": "naive"},  # ms-swift GRPO (a TRL GRPOTrainer subclass); logits_to_keep assumed
        "url": "https://github.com/modelscope/ms-swift/issues/4311",
        "model": "qwen2.5-vl-3b",
        "gpus": 4,
        "gpu_memory": "90GiB",
        "outcome": "OOM (full fine-tuning, vision tower trained)",
        "settings": dict(
            sharding="zero3",
            micro_batch=8,
            num_generations=8,
            prompts_per_step=1,
            grad_accum=4,
            gradient_checkpointing=True,
            max_pixels=602112,
            completion_tokens=1024,
            prompt_text_tokens=200,
            beta=0.04,
            vllm_gpu_memory_utilization=0.5,  # vLLM colocated at half the GPU, no sleep (issue 34's account of the run)
        ),
        "assumed": "gradient checkpointing on (ms-swift default), beta 0.04 (default), 200 text tokens, "
        "per_device_train_batch_size counts completions, vLLM colocated at 0.5 without sleep",
        "also": {
            "label": "the fix: --sleep_level 1 --vllm_tensor_parallel_size 4 --vllm_limit_mm_per_prompt '{\"image\": 2}'",
            "settings": dict(vllm_sleep_level=1, vllm_tensor_parallel_size=4, vllm_limit_images=2),
        },
    },
    {
        "id": "R1-V#107",
        "profile": {"profile": "naive", "logits_positions": "sequence"},  # R1-V's trainer: model(...).logits over the whole sequence
        "url": "https://github.com/StarsfieldAI/R1-V/issues/107",
        "model": "qwen2.5-vl-3b",
        "gpus": 8,
        "gpu_memory": "a100-80gb",
        "outcome": "OOM with sdpa; a commenter reports it runs with ZeRO-3 + flash_attention_2",
        "settings": dict(
            sharding="zero3",
            micro_batch=8,
            num_generations=8,
            prompts_per_step=1,
            grad_accum=2,
            gradient_checkpointing=False,
            max_pixels=401408,
            completion_tokens=256,
            prompt_text_tokens=100,
            beta=0.04,
            attn_implementation="sdpa",
        ),
        "assumed": "completion length 256 (TRL default then), 100 text tokens, sdpa as reported",
        "also": {"label": "same with flash_attention_2 (what ran)", "settings": dict(attn_implementation="flash_attention_2")},
    },
    {
        "id": "VLM-R1#77 (G=8)",
        "profile": {"profile": "naive", "logits_positions": "sequence"},  # VLM-R1's trainer: no logits_to_keep for VLMs
        "url": "https://github.com/om-ai-lab/VLM-R1/issues/77",
        "model": "qwen2.5-vl-3b",
        "gpus": 8,
        "gpu_memory": "h100-80gb",
        "outcome": "OOM with num_generations=8",
        "settings": dict(
            sharding="zero3",
            micro_batch=8,
            num_generations=8,
            prompts_per_step=1,
            grad_accum=2,
            gradient_checkpointing=False,
            max_pixels=640 * 480,
            completion_tokens=256,
            prompt_text_tokens=100,
            beta=0.04,
        ),
        "assumed": "COCO-size images (640x480 px), completion length 256, 100 text tokens",
    },
    {
        "id": "VLM-R1#77 (G=4)",
        "profile": {"profile": "naive", "logits_positions": "sequence"},  # VLM-R1's trainer: no logits_to_keep for VLMs
        "url": "https://github.com/om-ai-lab/VLM-R1/issues/77",
        "model": "qwen2.5-vl-3b",
        "gpus": 8,
        "gpu_memory": "h100-80gb",
        "outcome": "runs with num_generations=4 (the posted command)",
        "settings": dict(
            sharding="zero3",
            micro_batch=4,
            num_generations=4,
            prompts_per_step=1,
            grad_accum=2,
            gradient_checkpointing=False,
            max_pixels=640 * 480,
            completion_tokens=256,
            prompt_text_tokens=100,
            beta=0.04,
        ),
        "assumed": "as above",
    },
    {
        "id": "EasyR1#59 (host RAM)",
        "url": "https://github.com/hiyouga/EasyR1/issues/59",
        "model": "qwen2.5-vl-7b",
        "gpus": 8,
        "gpu_memory": "a100-40gb",
        "host_memory": "760GB",
        "outcome": "host OOM: Ray killed the job at 726 of 760 GB with FSDP offload_params + offload_optimizer on; the maintainer's fix "
        "was to turn both offloads off",
        "settings": dict(
            sharding="fsdp",
            offload="optimizer+params",
            master_weights="fp32",
            dtype="float32",
            micro_batch=4,
            num_generations=5,
            prompts_per_step=16,
            grad_accum=20,
            gradient_checkpointing=True,
            max_pixels=1003520,
            completion_tokens=1024,
            prompt_text_tokens=200,
            beta=0.0,
        ),
        "assumed": "EasyR1's example of March 2025 as remembered (fp32 FSDP parameters, n=5, 1024 response tokens, max_pixels 1003520); "
        "the reference model and the colocated vLLM engine are not planned (beta 0 here)",
        "also": {"label": "same without offload (the fix)", "settings": dict(offload="none")},
    },
    {
        "id": "LLaVA#655 (SFT, 4 GPUs)",
        "url": "https://github.com/haotian-liu/LLaVA/issues/655",
        "model": "llava-1.5-7b",
        "gpus": 4,
        "gpu_memory": "a100-40gb",
        "sft_stage": 2,
        "outcome": "OOM in LLaVA-1.5-7B visual instruction tuning with ZeRO-2 and batch 1; the reporter then found they ran 4 of the "
        "8 A100-40G the maintainer says are enough",
        "settings": dict(
            sharding="zero2", micro_batch=1, gradient_checkpointing=True, completion_tokens=1400, prompt_text_tokens=64, freeze_vision=True
        ),
        "assumed": "model_max_length 2048 filled (576 image tokens + 64 prompt + 1400 answer tokens), flash attention (LLaVA's train_mem), "
        "DeepSpeed bf16 with fp32 masters",
        "also": {"label": "same on 8 GPUs (the maintainer's setup)", "settings": dict(world_size=8)},
    },
    {
        "id": "LLaVA#528 (SFT, 1 GPU)",
        "url": "https://github.com/haotian-liu/LLaVA/issues/528",
        "model": "llava-1.5-7b",
        "gpus": 1,
        "gpu_memory": "a100-80gb",
        "sft_stage": 2,
        "outcome": "OOM: visual instruction tuning of LLaVA-1.5-7B on one GPU with zero3.json, batch 16",
        "settings": dict(
            sharding="zero3", micro_batch=16, gradient_checkpointing=True, completion_tokens=600, prompt_text_tokens=64, freeze_vision=True
        ),
        "assumed": "one A100 80G, COCO conversations (~600 answer tokens), fp32 masters (DeepSpeed)",
    },
    {
        "id": "R1-V#61",
        "profile": {"profile": "naive", "logits_positions": "sequence"},  # R1-V's trainer: model(...).logits over the whole sequence
        "url": "https://github.com/StarsfieldAI/R1-V/issues/61",
        "model": "qwen2-vl-2b",
        "gpus": 8,
        "gpu_memory": "a100-80gb",
        "outcome": "OOM (no --deepspeed flag in the command)",
        "settings": dict(
            sharding="ddp",
            micro_batch=8,
            num_generations=8,
            prompts_per_step=1,
            grad_accum=2,
            gradient_checkpointing=False,
            max_pixels=401408,
            completion_tokens=256,
            prompt_text_tokens=100,
            beta=0.04,
        ),
        "assumed": "DDP (no DeepSpeed config given), bf16 weights, completion length 256, 100 text tokens",
    },
]


def _with_settings(w: Workload, settings: dict) -> Workload:
    """w with a report's alternative settings; an offload under a DeepSpeed config is that config's offload too."""
    w = dataclasses.replace(w, **settings)
    if w.zero is not None and "offload" in settings:
        zero = dataclasses.replace(w.zero, offload_optimizer=w.offload != "none", offload_param=w.offload == "optimizer+params")
        w = dataclasses.replace(w, zero=zero)
    return w


def _profile_verdict(spec, w: Workload, rep: dict) -> dict:
    p = plan(spec, w)
    out = {"settings": rep["profile"], "predicted_total_gib": round(p.total / GiB, 1), "fits": p.fits, "verdict": p.verdict}
    if "also" in rep:
        q = plan(spec, _with_settings(w, rep["also"]["settings"]))
        out["also"] = {"label": rep["also"]["label"], "predicted_total_gib": round(q.total / GiB, 1), "fits": q.fits}
    return out


def field_verdicts() -> list[dict]:
    from vlmrl.plan.planner import parse_memory

    rows = []
    for rep in FIELD_REPORTS:
        spec = model_spec(rep["model"])
        kw = dict(
            dtype="bfloat16",
            autocast=True,
            logprob_chunk_tokens=0,
            group_vision=False,
            shared_prefix=False,
            world_size=rep["gpus"],
            gpu_memory_bytes=parse_memory(rep["gpu_memory"]),
            host_memory_bytes=parse_memory(rep["host_memory"]) if "host_memory" in rep else None,
        )
        base = Workload(**{**kw, **rep["settings"]})
        if rep.get("sft_stage"):
            from vlmrl.plan.planner import sft_workload

            base = sft_workload(
                dataclasses.replace(base, logprob_chunk_tokens=1024),
                rep["sft_stage"],
                train_vision_tower=not rep["settings"].get("freeze_vision", False),
            )
            base = dataclasses.replace(base, logprob_chunk_tokens=0, attn_implementation="flash_attention_2")
        without = plan(spec, base)
        if base.sharding in ("zero1", "zero2", "zero3"):  # DeepSpeed's own buffers at its default sizes
            from vlmrl.plan.deepspeed import ZeroConfig

            base = dataclasses.replace(base, zero=ZeroConfig(stage=int(base.sharding[-1])))
        p = plan(spec, base)
        row = {k: rep[k] for k in ("id", "url", "model", "gpus", "gpu_memory", "outcome", "assumed")}
        row.update(
            settings=rep["settings"],
            deepspeed_defaults=base.zero is not None,
            predicted_total_gib=round(p.total / GiB, 1),
            without_zero_buffers_gib=round(without.total / GiB, 1),
            fits_without_zero_buffers=without.fits,
            zero_terms_gib={k: round(v / GiB, 2) for k, v in p.terms.items() if k.startswith("zero") or k in ("gathered_parameters", "comm_buffers")},
            verdict=p.verdict,
            fits=p.fits,
            host_total_gib=round(p.host["total"] / GiB, 1),
            host_fits=p.host_fits,
            phases_gib={k: round(v / GiB, 1) for k, v in p.phases.items()},
        )
        if "profile" in rep:  # the same report planned with the trainer profile (vlmrl plan --profile naive ...)
            row["profile"] = _profile_verdict(spec, dataclasses.replace(base, **rep["profile"]), rep)
        if "also" in rep:
            q = plan(spec, _with_settings(base, rep["also"]["settings"]))
            row["also"] = {
                "label": rep["also"]["label"],
                "predicted_total_gib": round(q.total / GiB, 1),
                "fits": q.fits,
                "host_total_gib": round(q.host["total"] / GiB, 1),
                "host_fits": q.host_fits,
            }
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
