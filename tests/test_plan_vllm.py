"""A colocated vLLM in the memory plan (issue 34 part 6, plan.vllm): each term by hand on the hand-made architecture
of tests/test_planner.py, what each sleep level frees, tensor parallelism, the cap auto_fit picks, and the seed-003
report (ms-swift #4311) whose OOM the planner called "fits" while the vLLM half of the GPU was not counted.

By hand, FP32 (float32), G 4 x 2 prompts = 8 rows, P = 24 (20 text + 4 image tokens), C = 10, one 56 x 56 image
(16 patches, 4 tokens): vLLM's weights 1,000,000 x 4 B = 4,000,000 (/ tp); KV per token 2 (k, v) x 4 layers x 2 KV
heads x 16 x 4 B = 1,024 (tp 2: one head per rank, 512); the rollout's KV 8 rows x 34 tokens x 1,024 = 278,528;
encoder cache with limit 2 images: 2 x 4 tokens x 64 hidden x 4 B = 2,048; profiling peak: the sampler's
256 x 1,000 x 4 B = 1,024,000 float32 logits (above one layer over 34 tokens, 34 x 4 x (4 x 64 + 3 x 128) = 87,040,
and the tower over 2 images, 2 x 16 x 4 x (6 x 32 + 3 x 64) = 49,152).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from test_planner import FP32, SPEC

from vlmrl.plan import vllm
from vlmrl.plan.geometry import micro_batch
from vlmrl.plan.planner import GiB, PlanError, Workload, model_spec, parse_memory, plan
from vlmrl.plan.spec import ALLOCATOR_RESERVE, CUDA_CONTEXT_BYTES

pytestmark = pytest.mark.unit

V = dataclasses.replace(FP32, vllm_gpu_memory_utilization=0.5, vllm_limit_images=2)
RES = int(0.5 * 80 * GiB)


def test_each_vllm_term_by_hand():
    p = plan(SPEC, V)
    v = p.vllm
    assert v["reservation"] == RES == p.terms["vllm_reservation"]
    assert v["weights"] == 4_000_000
    assert v["encoder_cache"] == 2_048
    assert v["profile_peak"] == 1_024_000
    assert v["kv_needed"] == 278_528
    assert v["kv_one_sequence"] == 34 * 1_024
    assert v["kv_cache"] == RES - 4_000_000 - 2_048 - 1_024_000  # the KV blocks fill what the cap leaves


def test_profile_peak_is_the_text_layer_when_the_sequence_is_long():
    w = dataclasses.replace(V, vllm_max_model_len=20_000)
    mb = micro_batch(SPEC, w)
    assert vllm.profile_peak(SPEC, w, mb) == 20_000 * 4 * (4 * 64 + 3 * 128)  # 51,200,000 > the sampler's 1,024,000


def test_the_trainer_no_longer_generates_and_vllm_sits_beside_it_in_every_phase_without_sleep():
    alone, beside = plan(SPEC, FP32), plan(SPEC, V)
    assert alone.terms["kv_cache"] > 0 and beside.terms["kv_cache"] == 0 and beside.terms["generation_temporaries"] == 0
    trainer_rollout = alone.phases["rollout"] - alone.terms["kv_cache"] - alone.terms["generation_temporaries"]
    assert beside.phases["rollout"] == trainer_rollout + RES
    assert beside.phases["update"] == alone.phases["update"] + RES
    assert beside.phases["scoring"] == alone.phases["scoring"] + RES
    # the allocator's reserve is on the trainer's bytes only: the cap is a fixed share of the device
    assert beside.total == int(alone.phases["update"] * (1 + ALLOCATOR_RESERVE) + RES) + CUDA_CONTEXT_BYTES
    assert beside.terms["allocator_reserve"] == beside.reserved - beside.peak_allocated


@pytest.mark.parametrize("level, host", [(0, 0), (1, 4_000_000), (2, 0)])
def test_what_each_sleep_level_frees_and_keeps_in_host_ram(level, host):
    alone = plan(SPEC, FP32)
    p = plan(SPEC, dataclasses.replace(V, vllm_sleep_level=level))
    awake_in_training = 0 if level else RES
    assert p.phases["update"] == alone.phases["update"] + awake_in_training
    assert p.phases["rollout"] > RES  # awake while it samples, whatever the level
    assert p.vllm["freed_by_sleep"] == (RES if level else 0)
    assert p.host["vllm_sleeping_weights"] == host  # level 1: its weight copy in host RAM; level 2: discarded


def test_tensor_parallelism_divides_the_weight_copy_and_the_kv_heads():
    p = plan(SPEC, dataclasses.replace(V, vllm_tensor_parallel_size=2))
    assert p.vllm["weights"] == 2_000_000
    assert p.vllm["kv_one_sequence"] == 34 * 512
    # a TP group samples its 2 ranks' rows together, each rank holding one of the 2 KV heads: the same bytes per rank
    assert p.vllm["kv_needed"] == 2 * 8 * 34 * 512
    assert plan(SPEC, dataclasses.replace(V, vllm_tensor_parallel_size=4)).vllm["kv_one_sequence"] == 34 * 512  # 1 head at least


def test_a_cap_with_no_room_for_one_sequence_does_not_fit():
    tiny = dataclasses.replace(V, gpu_memory_bytes=8 * 2**20)  # 4 MiB cap < 4,000,000 weights + 1,026,048
    p = plan(SPEC, tiny)
    assert not p.fits and "vLLM cannot start" in p.verdict


def test_smallest_cap_holds_the_rollout_and_the_step_below_does_not():
    w = dataclasses.replace(V, gpu_memory_bytes=100 * 2**20)
    mb = micro_batch(SPEC, w)
    need = 4_000_000 + 2_048 + 1_024_000 + 278_528  # 5,304,576 = 5.06% of 100 MiB
    assert vllm.fixed_bytes(SPEC, w, mb) + vllm.kv_needed(SPEC, w, mb) == need
    assert vllm.smallest_cap(SPEC, w, mb) == 0.10
    assert plan(SPEC, dataclasses.replace(w, vllm_gpu_memory_utilization=0.10)).vllm["kv_cache"] >= need - 5_026_048
    below = plan(SPEC, dataclasses.replace(w, vllm_gpu_memory_utilization=0.05))
    assert below.vllm["kv_cache"] < below.vllm["kv_needed"] and any("preempts" in n for n in below.notes)


def test_vllm_off_changes_no_figure():
    assert plan(SPEC, FP32).vllm == {} and "vllm_reservation" not in plan(SPEC, FP32).terms


def test_bad_vllm_fields_are_refused_naming_them():
    with pytest.raises(PlanError, match="vllm_sleep_level=3"):
        plan(SPEC, dataclasses.replace(V, vllm_sleep_level=3))


# ---------------------------------------------------------------- seed-003: ms-swift #4311


def _field_report(report_id: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from planner_accuracy import FIELD_REPORTS

    return next(r for r in FIELD_REPORTS if r["id"] == report_id)


def _seed_003(**changes) -> Workload:
    """The report's run as benchmarks/planner_accuracy.py field plans it (its frameworks' behaviour: logprob chunking
    off, no grouped vision or shared prefix, DeepSpeed ZeRO-3 at its default buffer sizes)."""
    from vlmrl.plan.deepspeed import ZeroConfig

    rep = _field_report("ms-swift#4311")
    kw = dict(logprob_chunk_tokens=0, group_vision=False, shared_prefix=False, world_size=rep["gpus"])
    kw |= dict(gpu_memory_bytes=parse_memory(rep["gpu_memory"]), zero=ZeroConfig(stage=3))
    return Workload(**{**kw, **rep["settings"], **changes})


def test_seed_003_the_oom_with_vllm_at_half_the_gpu_does_not_fit():
    """Qwen2.5-VL-3B, 4 x 90 GB, ZeRO-3, G 8, vLLM colocated at 0.5 of the GPU: reported OOM. The trainer alone plans
    at 44 GiB; beside it vLLM reserves 45 GiB for the whole step (no sleep), which the planner did not count."""
    spec = model_spec("qwen2.5-vl-3b")
    w = _seed_003()
    assert w.vllm_gpu_memory_utilization == 0.5  # the report's own setting
    p = plan(spec, w)
    assert not p.fits, p.verdict
    assert p.terms["vllm_reservation"] == int(0.5 * 90 * GiB)
    assert "does NOT fit" in p.verdict and "vLLM colocated: 0.50 x 90.0 = 45.0 GiB" in p.verdict
    trainer_only = plan(spec, _seed_003(vllm_gpu_memory_utilization=0.0))
    assert trainer_only.fits  # what it was called before vLLM was counted
    assert p.total > 0.95 * 90 * GiB > trainer_only.total


def test_seed_003_the_fix_sleep_level_1_and_tp_4_fits():
    """The configuration the run was fixed with (issue 34: --sleep_level 1 --vllm_tensor_parallel_size 4, limit 2
    images): vLLM gives its 45 GiB back during scoring and the update, and keeps a quarter of its weights in host RAM."""
    rep = _field_report("ms-swift#4311")
    p = plan(model_spec("qwen2.5-vl-3b"), _seed_003(**rep["also"]["settings"]))
    assert p.fits, p.verdict
    assert p.vllm["weights"] == model_spec("qwen2.5-vl-3b").total_params * 2 // 4
    assert p.host["vllm_sleeping_weights"] == 4 * p.vllm["weights"]  # 4 processes on the node


def test_auto_fit_picks_the_smallest_cap_that_holds_the_rollout(tmp_path):
    from vlmrl.config import load_config
    from vlmrl.plan.search import auto_fit

    cfg = load_config(
        None,
        [
            "model.name_or_path=qwen2.5-vl-3b",
            "model.dtype=bfloat16",
            "rollout.backend=vllm",
            "rollout.vllm_gpu_memory_utilization=0.9",
            "rollout.num_generations=8",
            "rollout.max_completion_length=1024",
            "training.per_device_train_batch_size=8",
            "training.gradient_accumulation_steps=2",
        ],
    )
    new, lines = auto_fit(cfg, gpu_memory_bytes=int(80 * GiB))
    cap = new.rollout.vllm_gpu_memory_utilization
    assert cap < 0.9 and any(line.startswith("rollout.vllm_gpu_memory_utilization: 0.9 -> ") for line in lines)
    from vlmrl.plan.planner import plan_for_config

    p = plan_for_config(new, gpu_memory_bytes=int(80 * GiB))
    assert p.fits and p.vllm["kv_cache"] >= p.vllm["kv_needed"]
    lower = plan_for_config(new, gpu_memory_bytes=int(80 * GiB), vllm_gpu_memory_utilization=round(cap - 0.05, 2))
    assert lower.vllm["kv_cache"] < lower.vllm["kv_needed"]  # one step smaller no longer holds the rollout


def test_vlmrl_plan_shows_the_vllm_terms_by_name(capsys):
    from vlmrl.plan.cli import main

    rc = main(["--model", "qwen2.5-vl-3b", "--gpu-memory", "90GiB", "--vllm-gpu-memory-utilization", "0.5", "--vllm-sleep-level", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("vllm_reservation", "vllm_weights", "vllm_encoder_cache", "vllm_profile_peak", "vllm_kv_cache", "vllm_kv_needed"):
        assert name in out
    assert "vllm_sleeping_weights" in out and "vLLM colocated: 0.50 x 90.0" in out
