"""Qwen3.5 in the memory planner: the hybrid decoder's spec (Gated DeltaNet layers, gated full attention), its
per-layer bytes, KV cache and linear-attention state by hand, and the closed form against the meta-device trace."""

import dataclasses
import sys
from pathlib import Path

import pytest

from vlmrl.plan.planner import (
    LINEAR_ATTN_CHUNK,
    Workload,
    linear_layer_bytes,
    linear_state_bytes,
    plan,
    spec_from_hf_config,
    text_layer_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from planner_accuracy import GridPoint, compare_trace, tiny_qwen35_config  # noqa: E402


@pytest.fixture(scope="module")
def spec():
    return spec_from_hf_config(tiny_qwen35_config().to_dict(), "tiny-qwen35")


def test_spec_reads_the_hybrid_decoder(spec):
    assert spec.family == "qwen3_5" and spec.layers == 4 and spec.linear_attn_layers == 3 and spec.first_layer_linear
    assert (spec.linear_k_heads, spec.linear_v_heads, spec.linear_k_dim, spec.linear_v_dim, spec.linear_conv_kernel) == (2, 4, 64, 64, 4)
    assert spec.gated_attention and spec.merge_size == 2 and spec.patch_size == 16 and spec.image_size == 0  # dynamic resolution


def test_linear_layer_bytes_by_hand(spec):
    """bf16, full fine-tuning: per token 20h + 8i (norms, MLP) + 2c (2K + V) (conv) + 18 V (gated norm) + 36 per value
    head; per padded token 4 x Hv x (8 dk + 3 dv + 5 x 64 + dk dv / 64)."""
    h, i, K, V = 256, 704, 2 * 64, 4 * 64
    per_token, per_padded = linear_layer_bytes(spec, Workload(), 2)
    assert per_token == 20 * h + 8 * i + 4 * (2 * K + V) + 18 * V + 36 * 4
    assert per_padded == 4 * 4 * (8 * 64 + 3 * 64 + 5 * LINEAR_ATTN_CHUNK + 64 * 64 / LINEAR_ATTN_CHUNK)


def test_kv_cache_counts_full_attention_layers_and_the_linear_state(spec):
    """The rollout's cache: K and V of the one full-attention layer per token, plus per row each linear-attention
    layer's conv columns and float32 recurrent state (no sequence axis)."""
    w = Workload(num_generations=4, prompts_per_step=2, micro_batch=4, max_pixels=224 * 224, prompt_text_tokens=20, completion_tokens=10)
    w = dataclasses.replace(w, shared_prefix=False)
    p = plan(spec, w)
    rows, tokens = 8, p.workload["prompt_tokens"] + 10
    kv = rows * tokens * 2 * 1 * spec.kv_heads * spec.head_dim * 2
    state = 3 * ((2 * 128 + 256) * 4 * 2 + 4 * 4 * 64 * 64)
    assert linear_state_bytes(spec, 2) == state
    assert p.terms["kv_cache"] == kv + rows * state
    longer = plan(spec, dataclasses.replace(w, completion_tokens=110))
    assert longer.terms["kv_cache"] - p.terms["kv_cache"] == rows * 100 * 2 * spec.kv_heads * spec.head_dim * 2  # the state does not grow


def test_chunk_padding_counts_per_row(spec):
    """The chunked delta rule pads each row to a multiple of 64 tokens: one more completion token past a boundary
    adds a whole chunk per row to the linear layers' float32 tensors."""
    w = Workload(autocast=False, micro_batch=4, num_generations=4, prompts_per_step=1, grad_accum=2, images_per_prompt=0, shared_prefix=False)
    P = w.prompt_text_tokens  # 64 text tokens, no image
    at = plan(spec, dataclasses.replace(w, completion_tokens=128 - P))
    past = plan(spec, dataclasses.replace(w, completion_tokens=129 - P))
    per_token, per_padded = linear_layer_bytes(spec, w, 2)
    full_layer_token = (past.terms["activations_text"] - at.terms["activations_text"] - 3 * 4 * (per_token + 64 * per_padded)) / 4
    assert full_layer_token == pytest.approx(text_layer_bytes(spec, w, 2))  # the rest: the full-attention layer's token per row


# Closed form vs trace: tiny Qwen3.5 (3 linear + 1 full layer) and an 8-layer one at the widths of public ~4B Qwen3.5
# configs (hidden 2560, 32 value heads of 128; not a published model), within 3%; Qwen3.5-MoE within 10% (expert
# dispatch buffers are not modelled, as for Qwen3-VL-MoE).
QWEN35_GRID = [
    GridPoint("tiny-qwen35-full-G8", "tiny-qwen35", 8, 4, False, False, 448 * 448),
    GridPoint("tiny-qwen35-lora-G4-gc", "tiny-qwen35", 4, 4, True, True, 224 * 224),
    GridPoint("tiny-qwen35-full-G8-prefix", "tiny-qwen35", 8, 8, False, False, 224 * 224, shared_prefix=True),
    GridPoint("tiny-qwen35-lora-G8-prefix", "tiny-qwen35", 8, 8, False, True, 224 * 224, shared_prefix=True),
    GridPoint("mid-qwen35-full-G4", "mid-qwen35", 4, 4, False, False, 448 * 448),
    GridPoint("mid-qwen35-lora-G8-prefix", "mid-qwen35", 8, 8, False, True, 448 * 448, shared_prefix=True),
    GridPoint("mid-qwen35-full-G8-gc", "mid-qwen35", 8, 8, True, False, 448 * 448),
    GridPoint("mid-qwen35-lora-G4-long", "mid-qwen35", 4, 4, False, True, 448 * 448, completion=512),
    GridPoint("tiny-qwen35-full-G4-prefix-eager", "tiny-qwen35", 4, 4, False, False, 224 * 224, shared_prefix=True, attn="eager"),
    GridPoint("mid-qwen35-lora-G4-eager", "mid-qwen35", 4, 4, False, True, 448 * 448, attn="eager"),
]
QWEN35_MOE_GRID = [
    GridPoint("tiny-qwen35moe-full-G8", "tiny-qwen35-moe", 8, 4, False, False, 448 * 448),
    GridPoint("tiny-qwen35moe-lora-G8-prefix", "tiny-qwen35-moe", 8, 8, False, True, 224 * 224, shared_prefix=True),
]


@pytest.mark.parametrize("point", QWEN35_GRID, ids=lambda g: g.name)
def test_qwen35_closed_form_within_3pct_of_trace(point):
    r = compare_trace(point)
    assert abs(r["difference_pct"]) <= 3, r


@pytest.mark.parametrize("point", QWEN35_MOE_GRID, ids=lambda g: g.name)
def test_qwen35_moe_closed_form_within_10pct_of_trace(point):
    r = compare_trace(point)
    assert abs(r["difference_pct"]) <= 10, r


def test_eager_scores_only_in_full_attention_layers(spec):
    """Eager attention keeps a score matrix per full-attention layer only (one of the four tiny layers)."""
    from vlmrl.plan.planner import eager_attention_bytes

    w = Workload(attn_implementation="eager")
    e = eager_attention_bytes(spec, w, 2, ((4, 100, 100),), 0, 0)
    assert e["text"] == (spec.layers - spec.linear_attn_layers) * e["text_layer"] == e["text_layer"]
