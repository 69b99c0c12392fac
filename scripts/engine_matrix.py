"""The engine x stage x feature table of docs/scaling_out.md, from docs/engine_matrix.json.

A cell names the tests that show the combination works (pytest node ids; a test function without `[...]` stands for
all its parameters) or says "no: not tested" (printed "no") / "no: why" / "n/a: why". Each test's tier comes from pytest's own collection: `--update`
collects the named files with `-m slow` and `-m 'not slow'` and writes the result into the JSON's `tiers`;
tests/test_engine_matrix.py collects again and fails when a named test is gone or its tier changed, so the table cannot
claim an untested "yes" or a wrong tier.

    python scripts/engine_matrix.py            # print the table
    python scripts/engine_matrix.py --update   # re-collect the tiers into docs/engine_matrix.json
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
MATRIX = ROOT / "docs" / "engine_matrix.json"


def named_tests(matrix: dict) -> list[str]:
    """Every test the cells name, in the order they first appear."""
    seen: dict[str, None] = {}
    for stages in matrix["cells"].values():
        for features in stages.values():
            for cell in features.values():
                if isinstance(cell, list):
                    seen.update(dict.fromkeys(cell))
    return list(seen)


# One collection of every test (slow ones too), printing each test's id and tier: a plugin, so one subprocess does it.
_COLLECT = """
import sys, pytest
class Tiers:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("@@", item.nodeid, "slow" if item.get_closest_marker("slow") else "default")
sys.exit(pytest.main(["--collect-only", "-q", "-m", "slow or not slow", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Tiers()]))
"""


def collected(files: list[str]) -> dict[str, str]:
    """pytest's collection of `files`: node id -> "default" or "slow" (`make test` skips the slow tier)."""
    out = subprocess.run([sys.executable, "-c", _COLLECT, *files], cwd=ROOT, capture_output=True, text=True)
    return dict(line.split()[1:3] for line in out.stdout.splitlines() if line.startswith("@@ "))


def tiers_of(tests: list[str], items: dict[str, str]) -> dict[str, str]:
    """test -> "default" (`make test` runs it or, for a function, some of its parameters), "slow" (only `make
    test-slow` does) or "not collected"; `items`: collected node id -> tier."""

    def tiers(test: str) -> set[str]:
        return {tier for node, tier in items.items() if node == test or node.startswith(test + "[")}

    return {t: "default" if "default" in tiers(t) else "slow" if tiers(t) else "not collected" for t in tests}


def collected_tiers(tests: list[str]) -> dict[str, str]:
    return tiers_of(tests, collected(sorted({t.split("::")[0] for t in tests})))


def render(matrix: dict) -> str:
    """The markdown block: one row per engine x stage, a cell "yes (n, m)" / "slow (n)" naming the numbered tests
    below it ("slow": only the slow tier runs them), or the cell's "no"/"n/a" reason."""
    tests, tiers = named_tests(matrix), matrix["tiers"]
    number = {t: i for i, t in enumerate(tests, 1)}
    features = matrix["features"]
    lines = ["| engine | stage | " + " | ".join(features) + " |", "|---" * (len(features) + 2) + "|"]
    for engine in matrix["engines"]:
        for stage in matrix["stages"]:
            cells = []
            for feature in features:
                cell = matrix["cells"][engine][stage][feature]
                if isinstance(cell, list):
                    word = "yes" if any(tiers.get(t) == "default" for t in cell) else "slow"
                    cells.append(f"{word} ({', '.join(str(number[t]) for t in cell)})")
                else:
                    cells.append("no" if cell == "no: not tested" else cell)
            lines.append(f"| {engine} | {stage} | " + " | ".join(cells) + " |")
    lines.append(f"| any, on GPUs | GRPO, SFT | {matrix['gpu']} |" + " |" * (len(features) - 1))
    lines += ["", "Tests (tier: `default` = `make test`, `slow` = `make test-slow` only):", ""]
    lines += [f"{number[t]}. `{t}` ({tiers.get(t, 'tier not collected yet')})" for t in tests]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    matrix = json.loads(MATRIX.read_text())
    if argv == ["--update"]:
        matrix["tiers"] = collected_tiers(named_tests(matrix))
        MATRIX.write_text(json.dumps(matrix, indent=2) + "\n")
        missing = [t for t, tier in matrix["tiers"].items() if tier == "not collected"]
        print(f"{MATRIX.relative_to(ROOT)}: {len(matrix['tiers'])} tests" + (f"; NOT COLLECTED: {missing}" if missing else ""))
        return 1 if missing else 0
    sys.stdout.write(render(matrix))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
