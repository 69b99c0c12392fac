"""The results files of benchmarks/dynamic_sampling.py and benchmarks/distill.py: their "Reading" is computed from the
results JSON (other numbers give another reading), not fixed text in the script."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.unit


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ds_run(name: str, accuracy: dict, extra: int = 0) -> dict:
    steps = [{"step": s, "seconds": float(s), "completions": 64 * s + extra * s, "reward": 0.5, "frac_reward_zero_std": 0.0} for s in range(1, 101)]
    return {"name": name, "steps": steps, "eval_accuracy": accuracy}


def _ds_result(base_acc: dict, dyn_acc: dict) -> dict:
    return {
        "date": "2026-01-01",
        "command": "python benchmarks/dynamic_sampling.py",
        "cpu": "cpu",
        "cpus": 2,
        "load_before": 0.1,
        "load_after": 0.2,
        "torch": "t",
        "transformers": "tf",
        "json": "x.json",
        "target": max(base_acc.values()),
        "verdict": "v",
        "test_size": 100,
        "runs": [_ds_run("baseline", base_acc), _ds_run("dynamic", dyn_acc, extra=32)],
    }


def test_dynamic_sampling_reading_follows_the_numbers():
    ds = _bench("dynamic_sampling")
    sooner = _ds_result({0: 0.25, 50: 0.25, 100: 0.75}, {0: 0.25, 50: 0.75, 100: 0.75})
    text = ds.reading(sooner)
    assert "75.0%: baseline step 100, dynamic step 50" in text
    assert "generated 9600 completions against the baseline's 6400 (1.50x)" in text
    assert "stayed at or below 0.2 on 2 cores" in text and "100 held-out rows" in text
    later = _ds_result({0: 0.25, 50: 0.75, 100: 0.75}, {0: 0.25, 50: 0.25, 100: 0.25})
    assert "75.0%: baseline step 50, dynamic not reached" in ds.reading(later)
    flat = _ds_result({0: 0.25, 100: 0.25}, {0: 0.25, 100: 0.25})
    assert "Neither run rose above the starting 25.0% within 100 steps" in ds.reading(flat)
    assert f"Reading: {ds.reading(sooner)}" in ds.markdown(sooner)


def test_the_committed_dynamic_sampling_results_match_their_json():
    """The .md in benchmarks/results is what the script renders from the JSON next to it (regenerated, not edited)."""
    ds = _bench("dynamic_sampling")
    path = ROOT / "benchmarks" / "results" / "dynamic_sampling_cpu_2026-11-28.json"
    result = json.loads(path.read_text())
    for run in result["runs"]:
        run["eval_accuracy"] = {int(k): v for k, v in run["eval_accuracy"].items()}
    assert path.with_suffix(".md").read_text() == ds.markdown(result)


def _distill_result(grpo: list[float], mixed: list[float], kl_first: float, kl_last: float) -> dict:
    def run(final: float, kl: bool) -> dict:
        return {
            "accuracy": {"0": 0.25, "50": final},
            "reverse_kl": {str(s): (kl_first if s <= 5 else kl_last) for s in range(1, 51)} if kl else {},
            "reward": {},
            "seconds": 1.0,
        }

    return {
        "date": "2026-01-01",
        "cpu": "cpu",
        "cpus": 2,
        "load_average": [0.1, 0.2],
        "command": "python benchmarks/distill.py",
        "eval_set": "test",
        "steps": 50,
        "teacher_steps": 150,
        "student_init_seed": 1,
        "seeds": [1, 2],
        "teacher": {"on_test": {"0": 0.25, "150": 0.75}, "on_eval_set": 0.75},
        "runs": {"grpo": {str(i + 1): run(a, False) for i, a in enumerate(grpo)}, "mixed 1": {str(i + 1): run(a, True) for i, a in enumerate(mixed)}},
        "setup_seconds": {},
    }


def test_distill_reading_follows_the_numbers():
    d = _bench("distill")
    closer = _distill_result([0.25, 0.5], [0.75, 0.5], 0.9, 0.1)
    text = d.reading(closer)
    assert "**mixed 1** ended closer to the teacher than GRPO alone on 1 of 2 seeds (1 equal)" in text
    assert "mean gap 12.5 points against GRPO's 37.5" in text and "fell on every seed" in text
    further = _distill_result([0.75, 0.75], [0.25, 0.25], 0.1, 0.9)
    text = d.reading(further)
    assert "on 0 of 2 seeds (0 equal)" in text and "mean gap 50.0 points against GRPO's 0.0" in text and "did not fall" in text
    assert d.reading(closer) in d.markdown(closer)
    one_more = copy.deepcopy(closer)
    one_more["runs"]["mixed 1"]["2"]["accuracy"]["50"] = 0.75
    assert "on 2 of 2 seeds (0 equal)" in d.reading(one_more)


@pytest.mark.parametrize(
    "stem",
    [
        "distill_cpu_2026-11-28",
        "distill_cpu_2026-11-28_probe",
        "distill_cpu_2026-11-28_teacher150_resumed",
        "distill_cpu_2026-11-28_teacher150_resumed_probe",
    ],
)
def test_the_committed_distill_results_match_their_json(stem):
    d = _bench("distill")
    path = ROOT / "benchmarks" / "results" / f"{stem}.json"
    assert path.with_suffix(".md").read_text() == d.markdown(json.loads(path.read_text()))
