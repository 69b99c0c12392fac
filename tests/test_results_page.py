"""docs/results.md is rendered from benchmarks/results/ (scripts/results_page.py): a figure edited by hand, or a
result file re-measured without regenerating the page, fails here."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.unit


def _page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGE = _page()


def test_results_page_equals_what_the_result_files_render():
    assert (ROOT / "docs" / "results.md").read_text() == PAGE.render(), (
        "docs/results.md is stale or edited by hand: run python scripts/results_page.py"
    )


def test_a_hand_edited_figure_is_caught():
    text = (ROOT / "docs" / "results.md").read_text()
    edited = text.replace("| not run |", "| 5400 |", 1) if "| not run |" in text else text.replace("|", "| 1 |", 1)
    assert edited != text and edited != PAGE.render()


def _suite_file(folder: Path, smoke: bool, date: str, tokens: float) -> None:
    item = dict(model="qwen2.5-vl-3b", method="engine-graph", tokens_per_s=tokens, step_s=1.5, fraction_of_hbm_bound=0.25)
    meta = dict(device="NVIDIA H100 80GB HBM3", date=date, commit="abc1234", smoke=smoke, command="python benchmarks/gpu_suite.py")
    stages = dict(
        rollout=dict(status="ok", seconds=100.0, items=[item], notes=[]), update=dict(status="skipped: 3 s of the 540 s budget left", items=[])
    )
    name = f"gpu_suite_{'cpu-smoke' if smoke else 'H100'}_{date}.json"
    (folder / name).write_text(json.dumps(dict(meta=meta, stages=stages)))


def test_newest_real_run_fills_its_tables_and_the_rest_read_not_run(tmp_path):
    """A smoke run is never shown as a GPU figure; the newest real run is; a stage it skipped reads 'not run' with the reason."""
    _suite_file(tmp_path, smoke=False, date="2026-11-20", tokens=111.0)
    _suite_file(tmp_path, smoke=False, date="2026-11-25", tokens=2345.0)
    _suite_file(tmp_path, smoke=True, date="2026-11-26", tokens=7.0)
    page = PAGE.render(tmp_path)
    assert "| qwen2.5-vl-3b | engine-graph | 2345 | 1.50 | 25.0% |" in page
    assert "| 111 |" not in page and "| 7 |" not in page
    assert "NVIDIA H100 80GB HBM3, 2026-11-25, commit abc1234" in page
    update = page.split("## GRPO step")[1].split("##")[0]
    assert "| not run |" in update and "skipped: 3 s of the 540 s budget left" in update
    assert page.split("## Planner")[1].split("##")[0].count("| not run |") == 1  # a stage the run did not have
    assert "| qwen2.5-vl-3b | engine-graph | 7 |" in PAGE.render(tmp_path, smoke=True)


def test_without_any_suite_run_every_suite_table_reads_not_run(tmp_path):
    page = PAGE.render(tmp_path)
    assert page.count("| not run |") == 7 and "No GPU suite run yet" in page
