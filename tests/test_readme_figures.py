"""Every generated block of README.md and docs/*.md equals what its source renders (scripts/generated_blocks.py:
benchmark figures from benchmarks/results/, the source map from the package layout, the config reference, the
example config): a figure edited by hand, a result file re-measured or a module added without `make reference` fails
here."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import generated_blocks  # noqa: E402
import readme_figures as FIGURES  # noqa: E402

pytestmark = pytest.mark.unit
BLOCKS = generated_blocks.all_blocks()


def _block(name: str) -> str:
    found = [
        m.group(1)
        for page in generated_blocks.PAGES
        for m in re.finditer(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", page.read_text(), re.S)
    ]
    assert len(found) == 1, f"<!-- {name}:start/end --> markers appear {len(found)} times in README.md and docs/ (want exactly once)"
    return found[0]


def test_every_benchmark_block_has_its_result_files():
    assert set(FIGURES.rendered()) == set(FIGURES.BLOCKS)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_generated_block_equals_what_its_source_renders(name):
    assert _block(name) == BLOCKS[name], f"block {name} is stale or edited by hand: run `make reference`"


def test_a_hand_edited_figure_is_caught():
    block = _block("vs-trl")
    figure = re.search(r"\*\*(\d+\.\d+)\*\*", block).group(0)  # the first bold ratio, whatever it is
    edited = block.replace(figure, "**9.99**", 1)
    assert edited != block
    assert edited != FIGURES.rendered()["vs-trl"]


def test_the_source_map_names_every_module():
    block = _block("source-map")
    for path in (ROOT / "src" / "vlmrl").rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            assert f"`{path.stem}`" in block or f"`vlmrl/{path.name}`" in block, path


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
