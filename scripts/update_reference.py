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
for name, body in (("config-reference", reference_markdown()),
                   ("demo-figures", figures_markdown(json.loads((root / "benchmarks/results/demo_cpu.json").read_text())))):
    text = re.sub(rf"<!-- {name}:start -->\n.*<!-- {name}:end -->", lambda _, b=body, n=name: f"<!-- {n}:start -->\n{b}<!-- {n}:end -->",
                  text, flags=re.S)
readme.write_text(text)
