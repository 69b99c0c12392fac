"""The README's source map, generated from the package layout: each subpackage's docstring, then each module's
first docstring line. `scripts/update_reference.py` writes it; tests/test_readme_figures.py fails when it drifts."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "vlmrl"


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|") if doc else ""


def source_map() -> str:
    lines = ["| where | what |", "|---|---|"]
    top = sorted(p for p in SRC.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    for path in top:
        lines.append(f"| `{path.relative_to(SRC.parent)}` | {_first_line(path)} |")
    for package in sorted(p.parent for p in SRC.rglob("__init__.py") if p.parent != SRC):  # subpackages get a row too
        names = [m.stem for m in package.glob("*.py") if m.name != "__init__.py"]
        names += [f"{d.name}/" for d in package.iterdir() if (d / "__init__.py").exists()]  # a subpackage (run/convert/)
        modules = ", ".join(f"`{n}`" for n in sorted(names))
        lines.append(f"| `{package.relative_to(SRC.parent)}/` ({modules}) | {_first_line(package / '__init__.py')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(source_map(), end="")
