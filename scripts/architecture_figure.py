"""docs/architecture.png: the seams of vlmrl as its imports draw them (python scripts/architecture_figure.py).

Each box is a group of modules; an arrow A -> B says modules of A import modules of B, labelled with how many
(module, module) imports there are. Read from the source with ast, nothing run; the boxes and their places are
fixed here, the arrows and counts come from the code.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "vlmrl"
OUT = ROOT / "docs" / "architecture.png"

# box name -> (module prefixes, (x, y) centre)
BOXES = {
    "run skeleton\n(skeleton, train, sft, ending)": (("vlmrl.skeleton", "vlmrl.train", "vlmrl.sft", "vlmrl.ending"), (0.5, 0.9)),
    "rollout backends\n(rollout/: inprocess, vllm)": (("vlmrl.rollout",), (0.13, 0.6)),
    "training engines\n(engine/: DDP, FSDP2, ZeRO)": (("vlmrl.engine",), (0.5, 0.6)),
    "algo\n(pure tensor math)": (("vlmrl.algo",), (0.87, 0.6)),
    "models\n(decoders, log-probs)": (("vlmrl.models",), (0.22, 0.32)),
    "families\n(one file per family)": (("vlmrl.families",), (0.55, 0.18)),
    "planner\n(plan/)": (("vlmrl.plan",), (0.88, 0.32)),
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: pathlib.Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {n for n in [node.module] + [f"{node.module}.{a.name}" for a in node.names] if n in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found


def box_of(module: str) -> str | None:
    for name, (prefixes, _) in BOXES.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return None


def edges() -> dict[tuple[str, str], int]:
    files = {module_name(f): f for f in SRC.rglob("*.py")}
    counts: dict[tuple[str, str], int] = {}
    for module, path in files.items():
        a = box_of(module)
        for dep in imported(path, set(files)) - {module}:
            b = box_of(dep)
            if a and b and a != b:
                counts[(a, b)] = counts.get((a, b), 0) + 1
    return counts


def draw(counts: dict[tuple[str, str], int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 6.5))
    ax.set_xlim(0, 1)
    ax.set_ylim(0.08, 1.02)
    ax.axis("off")
    for name, (_, (x, y)) in BOXES.items():
        present = any(box_of(module_name(f)) == name for f in SRC.rglob("*.py"))
        ax.text(
            x,
            y,
            name if present else name + "\n(not yet)",
            ha="center",
            va="center",
            fontsize=10,
            bbox=dict(boxstyle="round,pad=0.5", fc="#e8f0fe" if present else "#eeeeee", ec="#3b5b92"),
        )
    for (a, b), n in sorted(counts.items()):
        (xa, ya), (xb, yb) = BOXES[a][1], BOXES[b][1]
        ax.annotate(
            "",
            xy=(xb, yb + 0.05 if yb < ya else yb),
            xytext=(xa, ya - 0.05 if yb < ya else ya),
            arrowprops=dict(arrowstyle="->", color="#555555", lw=0.6 + 0.15 * min(n, 12), connectionstyle="arc3,rad=0.08"),
        )
        ax.text(0.6 * xa + 0.4 * xb, 0.6 * ya + 0.4 * yb, str(n), fontsize=8, color="#a33", ha="center", backgroundcolor="white")
    ax.set_title("vlmrl's seams: an arrow A -> B = modules of A import modules of B (count); from scripts/architecture_figure.py", fontsize=9)
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)


def main() -> int:
    counts = edges()
    draw(counts)
    for (a, b), n in sorted(counts.items()):
        print(f"{a.splitlines()[0]} -> {b.splitlines()[0]}: {n}")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
