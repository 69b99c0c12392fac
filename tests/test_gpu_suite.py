"""benchmarks/gpu_suite.py: the full suite's plan, its budget machinery, and a --smoke run of the same stage code on the
CPU at tiny sizes (so the suite that a lent GPU runs once does not rot between GPUs)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.integration


def _suite():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


SUITE = _suite()


def _result(out: Path) -> dict:
    (path,) = out.glob("gpu_suite_cpu-smoke_*.json")
    return json.loads(path.read_text())


@pytest.mark.unit
def test_dry_run_prints_every_stage_and_the_budget(capsys):
    assert SUITE.main(["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "total budget 570 s" in text
    for stage in SUITE.STAGES:
        assert f"{stage.name:<14} {stage.budget_s:>8}" in text
    assert sum(s.budget_s for s in SUITE.STAGES) + SUITE.RENDER_S <= 570  # one 10-minute device call, install included


@pytest.mark.unit
def test_device_peaks_match_the_longest_name_first():
    assert SUITE.device_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert SUITE.device_peaks("NVIDIA H100 PCIe") == (756e12, 2.0e12)
    assert SUITE.device_peaks("NVIDIA H200") == (989e12, 4.8e12)
    assert SUITE.device_peaks("cpu") == (None, None)


def test_full_suite_without_a_gpu_says_so(capsys, tmp_path):
    assert SUITE.main(["--work", str(tmp_path)]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_a_stage_over_its_budget_is_stopped_and_keeps_what_it_measured(tmp_path):
    assert SUITE.main(["--smoke", "--only", "_budget_check", "--budget", "40", "--work", str(tmp_path), "--no-render"]) == 1
    stage = _result(tmp_path / "results")["stages"]["_budget_check"]
    assert stage["status"] == "stopped at its budget (5 s)" and stage["items"] == [{"kept": True}]


def test_a_stage_past_the_total_budget_is_skipped_with_a_note(tmp_path):
    assert SUITE.main(["--smoke", "--only", "rollout", "--budget", "20", "--work", str(tmp_path), "--no-render"]) == 1
    result = _result(tmp_path / "results")
    assert result["stages"]["rollout"]["status"].startswith("skipped: 5 s of the 20 s budget left")
    assert result["meta"]["commit"] and result["meta"]["device"] == "cpu" and result["meta"]["smoke"] is True


def test_smoke_runs_every_stage_and_renders_the_page(tmp_path):
    """Every stage's code on the CPU at tiny sizes; the numbers are CPU numbers, only their presence is checked."""
    assert SUITE.main(["--smoke", "--budget", "3600", "--work", str(tmp_path)]) == 0
    stages = _result(tmp_path / "results")["stages"]
    assert list(stages) == [s.name for s in SUITE.STAGES] and all(s["status"] == "ok" for s in stages.values())
    rollout = stages["rollout"]["items"]
    assert [i["method"] for i in rollout] == ["hf", "loop", "engine", "engine-static"]  # engine-graph: CUDA only, noted
    assert all(i["tokens_per_s"] > 0 and i["fraction_of_hbm_bound"] is None for i in rollout)
    assert "needs CUDA" in stages["rollout"]["notes"][0]
    vllm = stages["vllm"]
    if importlib.util.find_spec("vllm") is None:  # the default venv: the stage says why it did not run
        assert vllm["items"] == [] and "vllm: not run" in vllm["notes"][0]
    (update,) = stages["update"]["items"]
    assert update["time_update_s"] > 0 and update["text_parameters"] > 0 and update["mfu"] is None  # no peak FLOP/s for a CPU
    mismatch = stages["mismatch"]["items"]
    assert [(i["weights"], i["bf16_autocast"]) for i in mismatch[::4]] == [("bfloat16", False), ("float32", True)]
    assert [i["engine"] for i in mismatch[:4]] == ["loop"] + ["continuous"] * 3 and all(i["tokens"] > 0 for i in mismatch)
    assert all(i["mismatch/kl"] >= 0 and i["mismatch/max_ratio"] >= i["mismatch/min_ratio"] for i in mismatch)
    (oom,) = stages["oom"]["items"]
    assert oom["recovered"] and oom["injected"] and "out of memory in update at size 32" in oom["halvings"][0]
    (planner,) = stages["planner"]["items"]
    assert planner["predicted_peak_gib"] > 0 and planner["measured_peak_gib"] > 0 and planner["peak_kind"] == "host RSS"
    (engine,) = stages["memory_engine"]["items"]
    assert [r["name"] for r in engine["rows"]] == ["all off", "+ continuous rollout engine (all on)"]
    page = (tmp_path / "results" / "results.md").read_text()
    assert "| tiny-qwen2.5-vl | engine-static |" in page and "injected (CPU)" in page
