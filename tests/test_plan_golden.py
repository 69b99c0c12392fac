"""The closed form's every figure, unchanged: each (ModelSpec, Workload) the planner tests plan and each configuration
of `benchmarks/planner_accuracy.py trace`'s grid, replayed against tests/golden/plan_golden.json.gz (written by
scripts/make_plan_golden.py before the planner was split into one function per term): the split changed no figure,
and the closed form vs trace comparison of the grid is therefore the one recorded before it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from plan_golden import outcome, rebuild

from vlmrl.plan.planner import ModelSpec, Workload, plan

GOLDEN = Path(__file__).parent / "golden" / "plan_golden.json.gz"
CASES = json.loads(gzip.decompress(GOLDEN.read_bytes()))["cases"]


def test_the_golden_file_covers_the_trace_grid_and_the_planner_tests():
    families = {c["spec"]["family"] for c in CASES}
    assert len(CASES) > 200
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma3", "internvl", "llava_onevision"} <= families
    assert any("error" in c["expected"] for c in CASES)  # PlanError messages are part of the answer too


# Added after the golden file was written (issue 28, multi-turn): at their single-turn values they change no figure.
# Added later still (issue 39, on-policy distillation): 0 without a teacher, as in every golden case.
# And (issue 39, generative rewards): 0 without an in-process judge.
MULTITURN_TERMS = ("tool_image_inputs", "teacher_model", "teacher_moved_in_for_scoring", "judge_model", "judge_generation")
MULTITURN_FIELDS = ("tool_turns", "tool_images_per_turn", "tool_text_tokens", "max_images", "max_total_tokens", "teacher_params")
MULTITURN_FIELDS += ("judge_params", "judge_generate_bytes")
# Added after it too (issue 23, DeepSpeed's own host buffers under offload): 0 for every case the golden file holds.
LATER_HOST_TERMS = ("engine_host_buffers", "vllm_sleeping_weights")
# Added after it too (issue 34, a colocated vLLM): at their defaults (no vLLM) they change no figure.
VLLM_FIELDS = ("vllm_gpu_memory_utilization", "vllm_sleep_level", "vllm_tensor_parallel_size", "vllm_limit_images", "vllm_max_model_len")


def single_turn_view(got: dict) -> dict:
    """`got` without the multi-turn terms and workload fields when they hold their single-turn values (kept otherwise,
    so a single-turn case that grew a tool term still fails)."""
    if "host" in got:
        got = {**got, "host": {k: v for k, v in got["host"].items() if not (k in LATER_HOST_TERMS and v == 0)}}
    if "terms" not in got:
        return got
    default = Workload()
    terms = {k: v for k, v in got["terms"].items() if not (k in MULTITURN_TERMS and v == 0)}
    later = MULTITURN_FIELDS + VLLM_FIELDS
    workload = {k: v for k, v in got["workload"].items() if not (k in later and v == getattr(default, k))}
    return {**got, "terms": terms, "workload": workload}


@pytest.mark.parametrize("chunk", range(8))
def test_every_figure_equals_the_golden_file(chunk):
    """Every term, phase, host term, verdict, note and step time, exactly (ints and float bits), in 8 slices."""
    mismatches = []
    for case in CASES[chunk::8]:
        spec, w = rebuild(ModelSpec, case["spec"]), rebuild(Workload, case["workload"])
        got = single_turn_view(outcome(plan, spec, w))
        if got != case["expected"]:
            diff = {k: (case["expected"].get(k), got.get(k)) for k in set(got) | set(case["expected"]) if got.get(k) != case["expected"].get(k)}
            mismatches.append((spec.name, diff))
    assert not mismatches, mismatches[:3]


@pytest.mark.slow
def test_model_specs_read_from_the_configs_are_unchanged():
    """The specs of the trace grid's models (meta-device parameter counts, dimensions) as plan.hf reads them now."""
    import dataclasses
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from planner_accuracy import spec_for, trace_grid

    stored = {c["spec"]["name"]: c["spec"] for c in CASES}
    models = sorted({p.model for p in trace_grid()})
    assert set(models) <= set(stored)
    changed = [m for m in models if json.loads(json.dumps(dataclasses.asdict(spec_for(m)))) != stored[m]]
    assert not changed
