#!/usr/bin/env python
"""Write tests/golden/plan_golden.json.gz.gz: every (ModelSpec, Workload) the planner tests hand to `plan()` and every
configuration of `benchmarks/planner_accuracy.py trace`'s grid, each with the closed form's whole answer (terms,
phases, host terms, verdict, step time; or the PlanError message). tests/test_plan_golden.py replays them: a
refactor of the planner must leave every figure equal.

    PYTHONPATH=src python scripts/make_plan_golden.py            # runs the planner tests once with plan() recorded

Only regenerate on purpose (a change to the closed form's figures), and say why in the commit.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks"), str(ROOT / "tests")]

OUT = ROOT / "tests" / "golden" / "plan_golden.json.gz"  # gzip: 3 MB of JSON, 90 kB stored
TESTS = [
    "tests/test_planner.py",
    "tests/test_plan_profiles.py",
    "tests/test_plan_qwen35.py",
    "tests/test_plan_tiles.py",
    "tests/test_plan_video.py",
    "tests/test_check_verdict.py",
]
# Modules that call `plan` through a module global (the recorder replaces it there).
CALLERS = ("vlmrl.plan.planner", "vlmrl.plan.estimate", "vlmrl.plan.search", "vlmrl.plan.config")


def main() -> int:
    import importlib

    import pytest
    from plan_golden import key_of, outcome

    import vlmrl.plan.planner as planner

    original = planner.plan
    cases: dict[str, dict] = {}

    def recording_plan(spec, w):
        k = key_of(spec, w)
        if k not in cases:
            cases[k] = {"spec": dataclasses.asdict(spec), "workload": dataclasses.asdict(w), "expected": outcome(original, spec, w)}
        return original(spec, w)

    for name in CALLERS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, "plan", None) is original:
            mod.plan = recording_plan
    rc = pytest.main(["-q", "-x", "-p", "no:cacheprovider", *TESTS])
    if rc != 0:
        print("planner tests failed: golden file not written", file=sys.stderr)
        return 1
    from planner_accuracy import _sft_workload, spec_for, trace_grid, workload_for

    for p in trace_grid():
        spec = spec_for(p.model)
        recording_plan(spec, _sft_workload(p) if p.sft_stage else workload_for(p))
    text = json.dumps({"cases": list(cases.values())}, sort_keys=True, separators=(",", ":")) + "\n"
    OUT.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    print(f"{len(cases)} cases -> {OUT} ({OUT.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
