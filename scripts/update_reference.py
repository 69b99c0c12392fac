"""Regenerate every generated block of README.md and docs/*.md: the config reference (from the config's field docs),
the demo figures (from benchmarks/results/demo_cpu.json, written by a `make demo` run: cp outputs/demo/demo_result.json),
the benchmark figures (scripts/readme_figures.py, from benchmarks/results/), the source map (scripts/source_map.py,
from the package layout) and the example config (configs/). Each block lives in exactly one page, between
`<!-- NAME:start -->` and `<!-- NAME:end -->`; tests/test_readme_figures.py fails when one drifts."""

import re
import sys
from pathlib import Path

root = Path(__file__).parents[1]
sys.path.insert(0, str(root / "scripts"))
from generated_blocks import PAGES, all_blocks  # noqa: E402

blocks = all_blocks()
for page in PAGES:
    text = page.read_text()
    for name, body in blocks.items():
        text = re.sub(
            rf"<!-- {name}:start -->\n.*?<!-- {name}:end -->", lambda _, b=body, n=name: f"<!-- {n}:start -->\n{b}<!-- {n}:end -->", text, flags=re.S
        )
    page.write_text(text)
missing = [name for name in blocks if not any(f"<!-- {name}:start -->" in p.read_text() for p in PAGES)]
if missing:
    sys.exit(f"no page has the markers of: {', '.join(missing)}")
