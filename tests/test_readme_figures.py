"""The README's benchmark figures are rendered from benchmarks/results/ (scripts/readme_figures.py): a figure
edited by hand, or a result file re-measured without `make reference`, fails here."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _figures():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "scripts" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIGURES = _figures()


def _block(readme: str, name: str) -> str:
    found = re.search(rf"<!-- {name}:start -->\n(.*)<!-- {name}:end -->", readme, re.S)
    assert found, f"README.md lost its <!-- {name}:start/end --> markers"
    return found.group(1)


def test_every_benchmark_block_has_its_result_files():
    assert set(FIGURES.rendered()) == set(FIGURES.BLOCKS)


@pytest.mark.parametrize("name", sorted(FIGURES.BLOCKS))
def test_readme_block_equals_what_its_results_render(name):
    readme = (ROOT / "README.md").read_text()
    assert _block(readme, name) == FIGURES.rendered()[name], f"README block {name} is stale or edited by hand: run `make reference`"


def test_a_hand_edited_figure_is_caught():
    readme = (ROOT / "README.md").read_text()
    block = _block(readme, "vs-trl")
    edited = block.replace("**0.18**", "**0.12**")
    assert edited != block
    assert edited != FIGURES.rendered()["vs-trl"]
