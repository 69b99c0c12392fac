"""docs/scaling_out.md's engine x stage x feature table (docs/engine_matrix.json, rendered by scripts/engine_matrix.py):
every test it names is collected, in the tier the table says; every combination has a cell; a "yes" cannot name a
test that is gone. (That the rendered block equals the page: tests/test_readme_figures.py.)"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import engine_matrix  # noqa: E402

MATRIX = json.loads(engine_matrix.MATRIX.read_text())


def test_every_named_test_is_collected_in_the_tier_the_table_says():
    """One pytest collection (a subprocess) of the named files: a renamed or deleted test, or one moved to or from the
    slow tier, fails here until `python scripts/engine_matrix.py --update` and `make reference` are run."""
    tests = engine_matrix.named_tests(MATRIX)
    now = engine_matrix.collected_tiers(tests)
    assert "not collected" not in now.values(), sorted(t for t, tier in now.items() if tier == "not collected")
    assert now == MATRIX["tiers"], {t: (MATRIX["tiers"].get(t), tier) for t, tier in now.items() if MATRIX["tiers"].get(t) != tier}


def test_every_engine_stage_and_feature_has_a_cell():
    for engine in MATRIX["engines"]:
        assert list(MATRIX["cells"][engine]) == MATRIX["stages"], engine
        for stage in MATRIX["stages"]:
            cells = MATRIX["cells"][engine][stage]
            assert list(cells) == MATRIX["features"], (engine, stage)
            for feature, cell in cells.items():
                assert (isinstance(cell, list) and cell) or cell.split(":")[0] in ("no", "n/a"), (engine, stage, feature, cell)
    deepspeed = {"ZeRO-1", "ZeRO-2", "ZeRO-2 + optimizer offload", "ZeRO-2 bf16", "ZeRO-3", "ZeRO-3 + param/optimizer offload"}
    assert set(MATRIX["engines"]) == {"single", "DDP", "FSDP2", *deepspeed} and MATRIX["stages"] == ["GRPO", "SFT"]


def test_tiers_come_from_the_collection_and_a_missing_test_is_caught():
    items = {"tests/t.py::a[1]": "default", "tests/t.py::a[2]": "slow", "tests/t.py::b": "slow", "tests/t.py::ab": "default"}
    tiers = engine_matrix.tiers_of(["tests/t.py::a", "tests/t.py::a[2]", "tests/t.py::b", "tests/t.py::gone"], items)
    assert tiers == {"tests/t.py::a": "default", "tests/t.py::a[2]": "slow", "tests/t.py::b": "slow", "tests/t.py::gone": "not collected"}


def test_the_table_renders_yes_slow_and_no_from_the_tiers():
    table = engine_matrix.render(MATRIX)
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| engine")]
    assert len(rows) == len(MATRIX["engines"]) * len(MATRIX["stages"]) + 1  # + the GPU row
    assert rows[-1].startswith("| any, on GPUs | GRPO, SFT | not run")
    toy = {
        "engines": ["e"],
        "stages": ["s"],
        "features": ["f1", "f2", "f3"],
        "gpu": "not run",
        "cells": {"e": {"s": {"f1": ["x::a", "x::b"], "f2": ["x::b"], "f3": "no: not tested"}}},
        "tiers": {"x::a": "default", "x::b": "slow"},
    }
    toy_table = engine_matrix.render(toy)
    assert "| e | s | yes (1, 2) | slow (2) | no |" in toy_table
    assert "1. `x::a` (default)" in toy_table and "2. `x::b` (slow)" in toy_table
