"""Trainer profiles of the planner (`--profile naive|trl`): the terms they add, by hand, and the CLI."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from vlmrl.plan.planner import GiB, ModelSpec, PlanError, Workload, image_patches, plan

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from planner_accuracy import tiny_qwen25_config  # noqa: E402 (benchmarks/ on the path first)

# Hand-sized architecture (as tests/test_planner.py): V = 1000, h = 64, vision 2 blocks of hv = 32, iv = 64.
SPEC = ModelSpec(
    name="hand",
    family="qwen2_5_vl",
    total_params=1_000_000,
    vision_params=200_000,
    projector_params=10_000,
    embed_params=100_000,
    lm_head_params=0,
    hidden=64,
    intermediate=128,
    layers=4,
    heads=4,
    kv_heads=2,
    head_dim=16,
    vocab=1000,
    v_hidden=32,
    v_intermediate=64,
    v_layers=2,
    v_heads=2,
    patch_size=14,
    merge_size=2,
    temporal_patch=2,
)
# fp32, 2 prompts x G=4, one micro-batch of 4 rows (one prompt's group), 20 text + 4 image tokens, 10 completion tokens.
W = Workload(
    dtype="float32",
    autocast=False,
    num_generations=4,
    prompts_per_step=2,
    micro_batch=4,
    grad_accum=1,
    prompt_text_tokens=20,
    max_pixels=56 * 56,
    completion_tokens=10,
    gpu_memory_bytes=80 * GiB,
)
N, C, V, G, PROMPTS = 4, 10, 1000, 4, 2
PATCHES = 16  # 56 x 56 px: (56 / 28 x 2)^2
PIXELS_PER_PROMPT = PATCHES * 3 * 2 * 14 * 14 * 4  # channels x temporal patch x patch^2 x fp32 = 75,264 bytes


def test_naive_profile_adds_exactly_the_expected_terms():
    """naive = vlmrl's plan with G copies (no grouped vision, no shared prefix, no chunks), plus exactly: the kept
    float32 log-softmax (4 N C V), its backward buffers (8 N C V) in place of the chunked head, and G - 1 more pixel
    copies per prompt; vlmrl's own chunk-off log-softmax (4 N C V in activations_other) is not counted twice."""
    assert image_patches(SPEC, 56 * 56) == PATCHES
    naive = plan(SPEC, dataclasses.replace(W, profile="naive"))
    flags = plan(SPEC, dataclasses.replace(W, group_vision=False, shared_prefix=False, logprob_chunk_tokens=0))
    vlmrl = plan(SPEC, W)
    assert naive.terms["full_vocab_logits"] == 4 * N * C * V == 160_000
    assert naive.terms["logprob_buffers"] == 8 * N * C * V == 320_000
    assert naive.terms["pixel_value_copies"] == PROMPTS * (G - 1) * PIXELS_PER_PROMPT == 451_584
    assert naive.terms["activations_other"] == flags.terms["activations_other"] - 4 * N * C * V
    # G copies of each image through the vision tower: 4 rows x 16 patches x 2 blocks x 2,952 bytes per patch
    # (2 (30 hv + 8 iv) + 4 heads), against one encode of the group's image on vlmrl's path.
    assert naive.terms["activations_vision"] == 2 * N * PATCHES * (2 * (30 * 32 + 8 * 64) + 4 * 2) == 377_856
    assert vlmrl.terms["activations_vision"] * G == naive.terms["activations_vision"]
    # HF generate prefills the G copies: the KV cache of prompts x G rows of prompt + completion (24 + 10 tokens).
    assert naive.terms["kv_cache"] == PROMPTS * G * (24 + C) * 2 * SPEC.layers * SPEC.kv_heads * SPEC.head_dim * 4
    changed = {"full_vocab_logits", "logprob_buffers", "pixel_value_copies", "activations_other", "allocator_reserve", "scoring_temporaries"}
    for k, v in naive.terms.items():
        if k not in changed:
            assert v == flags.terms[k], k
    assert naive.peak_allocated > vlmrl.peak_allocated


def test_naive_reference_scores_the_same_way():
    """With a reference model the scoring pass holds the logits, a float32 copy and the log-softmax: (c + 8) N C V."""
    w = dataclasses.replace(W, beta=0.04, profile="naive")
    p = plan(SPEC, dataclasses.replace(w, micro_batch=8, num_generations=8, prompts_per_step=1))
    assert p.terms["scoring_temporaries"] == (4 + 8) * 8 * C * V
    assert p.terms["reference_model"] == SPEC.total_params * 4


def test_naive_sequence_logits_by_hand():
    """logits_positions=sequence: the LM head projects all 4 x 33 prompt + completion positions (4 bytes each in fp32)
    before the completion slice; that tensor sits beside the slice's copies at the end of forward and in scoring."""
    w = dataclasses.replace(W, profile="naive", logits_positions="sequence", beta=0.04)
    p = plan(SPEC, w)
    whole = N * (24 + C - 1) * V * 4  # 528,000
    e = N * C * V
    assert p.terms["full_vocab_logits"] == 4 * e
    assert p.terms["logprob_buffers"] == whole + (4 + 8) * e - 4 * e == 848_000
    assert p.terms["scoring_temporaries"] == (4 + 8) * e + whole
    with pytest.raises(PlanError, match="logits_positions='all': use one of completion, sequence"):
        plan(SPEC, dataclasses.replace(w, logits_positions="all"))


def test_trl_profile_fused_tiles_by_hand():
    """TRL 1.x's fused LM head: one tile of min(tokens, 4096) x min(V, 32768) entries. On CPU every position of the
    prompt + completion rows is projected and folded with torch ops (+29 bytes per entry in backward); on CUDA only
    completion positions, folded in place. Backward adds the float32 accumulators of the hidden states and the head."""
    cpu = plan(SPEC, dataclasses.replace(W, profile="trl", device="cpu"))
    tokens = N * (24 + C - 1)  # 132 positions
    assert cpu.terms["logprob_buffers"] == tokens * V * (4 + 29) + 4 * tokens * 64 + 4 * V * 64
    assert cpu.terms["full_vocab_logits"] == 0
    gpu = plan(SPEC, dataclasses.replace(W, profile="trl"))
    assert gpu.terms["logprob_buffers"] == N * C * V * 4 + 4 * N * C * 64 + 4 * V * 64
    big = dataclasses.replace(SPEC, vocab=151_936)
    tiled = plan(big, dataclasses.replace(W, profile="trl", device="cpu", micro_batch=200, prompts_per_step=50, num_generations=4))
    assert tiled.terms["logprob_buffers"] == 4096 * 32768 * 33 + 4 * 200 * 33 * 64 + 4 * 151_936 * 64  # the tile stops growing


def test_profile_input_guards():
    with pytest.raises(PlanError, match="profile='trl2': use one of vlmrl, naive, trl"):
        plan(SPEC, dataclasses.replace(W, profile="trl2"))
    with pytest.raises(PlanError, match="profile=naive plans another trainer's GRPO step"):
        plan(SPEC, dataclasses.replace(W, profile="naive", mode="sft"))


def _tiny_model_dir(tmp_path) -> Path:
    d = tmp_path / "tiny-model"
    d.mkdir(exist_ok=True)
    tiny_qwen25_config(layers=2, hidden=256, inter=704, heads=4, kv=2, vocab=32000).to_json_file(d / "config.json")
    return d


def test_cli_plan_profile_naive(tmp_path, capsys):
    from vlmrl.cli import main

    args = ["plan", "--model", str(_tiny_model_dir(tmp_path)), "--num-generations", "8", "--micro-batch", "16", "--prompts", "2"]
    assert main([*args, "--profile", "naive", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["profile"] == "naive" and out["workload"]["shared_prefix"] is False
    assert out["terms_gib"]["full_vocab_logits"] > 0 and out["terms_gib"]["pixel_value_copies"] > 0
    alt = out["vlmrl_profile"]
    assert alt["plan"]["workload"]["shared_prefix"] is True and alt["plan"]["total_gib"] < out["total_gib"]
    # Does not fit as a plain trainer (1.5 GiB with the 0.6 GiB CUDA context), nor as vlmrl with the same micro-batch
    # (0.8 GiB); a vlmrl config that fits is printed: smaller micro-batches, the effective batch kept.
    assert main([*args, "--profile", "naive", "--gpu-memory", "0.82GiB"]) == 0
    text = capsys.readouterr().out
    assert "--profile naive: does NOT fit" in text and "vlmrl, same work (group_vision True, shared_prefix True" in text
    assert "vlmrl config that fits" in text and "micro_batch: 16 -> " in text
    assert main([*args, "--profile", "naive", "--gpu-memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert "--profile naive: does NOT fit" in text and "log-prob chunks 128): fits" in text and "vlmrl config that fits" not in text


@pytest.mark.parametrize("extra, says", [(["--mode", "sft"], "--mode sft plans vlmrl sft only"), (["--trace"], "--trace runs vlmrl's own step")])
def test_cli_profile_conflicts_are_one_line(tmp_path, capsys, extra, says):
    from vlmrl.cli import main

    assert main(["plan", "--model", str(_tiny_model_dir(tmp_path)), "--profile", "naive", *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_cpu_heap_slack_spares_mmapped_blocks():
    """On a CPU run the planned tensors get CPU_ALLOCATOR_RESERVE of heap slack, except the log-prob head's blocks
    when each is above glibc's 32 MiB mmap ceiling (mmapped, unmapped on free): TRL's tile of 528 x 32,768 fp32
    entries (69 MB) at the update peak. A 4-row micro-batch (132 x 32,768 x 4 = 17 MB tiles) keeps the slack on all."""
    from vlmrl.plan.planner import CPU_ALLOCATOR_RESERVE

    big = dataclasses.replace(SPEC, vocab=151_936)
    w = dataclasses.replace(W, profile="trl", device="cpu", micro_batch=16, prompts_per_step=4)
    p = plan(big, w)
    assert max(p.phases, key=p.phases.get) == "update"
    head = p.terms["logprob_buffers"]
    assert 528 * 32768 * 4 >= 32 * 2**20 and head == 528 * 32768 * 33 + 4 * 528 * 64 + 4 * 151_936 * 64
    assert p.host["device_tensors_on_cpu"] == int((p.peak_allocated - head) * (1 + CPU_ALLOCATOR_RESERVE) + head)
    small = plan(big, dataclasses.replace(w, micro_batch=4, prompts_per_step=1))
    assert small.host["device_tensors_on_cpu"] == int(small.peak_allocated * (1 + CPU_ALLOCATOR_RESERVE))


def test_trainer_profiles_use_the_trainer_runtime_floor_on_cpu():
    from vlmrl.plan.profiles import TRAINER_CPU_RUNTIME_BYTES
    from vlmrl.plan.planner import HOST_RUNTIME_CPU_BYTES

    cpu = dataclasses.replace(W, device="cpu")
    assert plan(SPEC, cpu).host["runtime_per_process"] == HOST_RUNTIME_CPU_BYTES
    assert plan(SPEC, dataclasses.replace(cpu, profile="naive")).host["runtime_per_process"] == TRAINER_CPU_RUNTIME_BYTES
    assert plan(SPEC, dataclasses.replace(cpu, profile="trl", host_runtime_bytes=10**9)).host["runtime_per_process"] == 10**9
