"""Every generated block of the documentation, by name, and the pages that may hold them (README.md, docs/*.md)."""

from __future__ import annotations

import json
from pathlib import Path

from engine_matrix import MATRIX as ENGINE_MATRIX
from engine_matrix import render as engine_matrix
from readme_figures import rendered
from source_map import source_map

from vlmrl.config import reference_markdown
from vlmrl.demo import figures_markdown

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE_CONFIG = ROOT / "configs" / "grpo_qwen2.5-vl-3b_lora.yaml"


def config_example() -> str:
    return f"`{EXAMPLE_CONFIG.relative_to(ROOT)}`:\n\n```yaml\n{EXAMPLE_CONFIG.read_text().rstrip()}\n```\n"


def all_blocks() -> dict[str, str]:
    blocks = {"config-reference": reference_markdown(), "source-map": source_map(), "config-example": config_example(), **rendered()}
    blocks["engine-matrix"] = engine_matrix(json.loads(ENGINE_MATRIX.read_text()))
    demo_result = ROOT / "benchmarks/results/demo_cpu.json"
    if demo_result.exists():
        blocks["demo-figures"] = figures_markdown(json.loads(demo_result.read_text()))
    return blocks
