"""Regenerate the README's generated parts: the config reference (from the config's field docs), the demo
figures (from benchmarks/results/demo_cpu.json, written by a `make demo` run: cp outputs/demo/demo_result.json)
and the benchmark figures (scripts/readme_figures.py, from benchmarks/results/)."""

import json
import re
import sys
from pathlib import Path

from vlmrl.config import reference_markdown
from vlmrl.demo import figures_markdown

root = Path(__file__).parents[1]
sys.path.insert(0, str(root / "scripts"))
from readme_figures import rendered  # noqa: E402

readme = root / "README.md"
text = readme.read_text()
parts = {"config-reference": reference_markdown(), **rendered()}
demo_result = root / "benchmarks/results/demo_cpu.json"
if demo_result.exists():
    parts["demo-figures"] = figures_markdown(json.loads(demo_result.read_text()))
for name, body in parts.items():
    if f"<!-- {name}:start -->" not in text:
        sys.exit(f"README.md has no <!-- {name}:start --> marker")
    text = re.sub(
        rf"<!-- {name}:start -->\n.*<!-- {name}:end -->", lambda _, b=body, n=name: f"<!-- {n}:start -->\n{b}<!-- {n}:end -->", text, flags=re.S
    )
readme.write_text(text)
