"""constraints.txt: `make`'s installs are exact (the demo record does not depend on the day's newest releases) while
`pip install vlmrl` keeps pyproject's ranges."""

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[1]


def name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            spec, _, marker = line.partition(";")
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", spec.strip()), line  # exact versions only
            assert marker.strip() == 'python_version == "3.11"', line
            out[name(spec)] = spec.split("==")[1]
    return out


def test_make_installs_every_dependency_at_a_pinned_version_but_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]} - {"torch"}
    pinned = pins()
    assert not wanted - pinned.keys(), f"not pinned in constraints.txt: {sorted(wanted - pinned.keys())}"
    assert pinned["transformers"] == "5.23.0"  # the demo record's (benchmarks/results/demo_cpu.json)
    assert "torch" not in pinned  # the Makefile's TORCH_CPU, or the GPU user's own build
    makefile = (ROOT / "Makefile").read_text()
    assert "CONSTRAINTS ?= constraints.txt" in makefile
    assert '$(PY) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test]"' in makefile


def test_pip_install_vlmrl_keeps_ranges():
    """A user's `pip install vlmrl` is never forced onto one release of a core dependency."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [r for r in project["dependencies"] if "==" in r]
