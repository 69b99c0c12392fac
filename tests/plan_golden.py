"""The golden planner cases (tests/golden/plan_golden.json, written by scripts/make_plan_golden.py): how a case is
keyed, how the closed form's answer is written down, and how a case's inputs are rebuilt."""

from __future__ import annotations

import dataclasses
import json


def _plain(x):
    """JSON's view of a value (tuples become lists), so a fresh answer compares equal to a stored one."""
    return json.loads(json.dumps(x, sort_keys=True))


def key_of(spec, w) -> str:
    return json.dumps([dataclasses.asdict(spec), dataclasses.asdict(w)], sort_keys=True)


def outcome(plan_fn, spec, w) -> dict:
    """Everything plan() answers for (spec, w), or its PlanError message."""
    from vlmrl.plan.planner import PlanError

    try:
        p = plan_fn(spec, w)
    except PlanError as e:
        return {"error": str(e)}
    return _plain(
        {
            "terms": p.terms,
            "phases": p.phases,
            "peak_allocated": p.peak_allocated,
            "reserved": p.reserved,
            "total": p.total,
            "host": p.host,
            "gpu_memory_bytes": p.gpu_memory_bytes,
            "verdict": p.verdict,
            "headroom": p.headroom,
            "notes": p.notes,
            "workload": p.workload,
            "step_time_s": p.step_time_s,
            "fits": p.fits,
        }
    )


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def rebuild(cls, fields: dict):
    """A ModelSpec / Workload from its stored dict (JSON lists back to the tuples the dataclasses hold)."""
    return cls(**{k: _tuples(v) for k, v in fields.items()})
