"""Regenerate the README's generated parts: the config reference (from the config's field docs) and the demo
figures (from benchmarks/results/demo_cpu.json, written by a `make demo` run: cp outputs/demo/demo_result.json)."""

import json
import re
from pathlib import Path

from vlmrl.config import reference_markdown
from vlmrl.demo import figures_markdown

root = Path(__file__).parents[1]
readme = root / "README.md"
text = readme.read_text()
parts = {"config-reference": reference_markdown()}
demo_result = root / "benchmarks/results/demo_cpu.json"
if demo_result.exists():
    parts["demo-figures"] = figures_markdown(json.loads(demo_result.read_text()))
for name, body in parts.items():
    text = re.sub(
        rf"<!-- {name}:start -->\n.*<!-- {name}:end -->", lambda _, b=body, n=name: f"<!-- {n}:start -->\n{b}<!-- {n}:end -->", text, flags=re.S
    )
readme.write_text(text)
