"""The package's shape, guarded: subpackages in layers (a package imports only from the layers below it and itself),
no import cycles between vlmrl modules (lazy imports inside functions count too), and the training loop has no
engine branches."""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

SRC = pathlib.Path(__file__).parents[1] / "src" / "vlmrl"

# Bottom to top. A module may import from its own layer's packages and from the layers below, never above.
LAYERS = (
    ("algo", "_torchvision"),  # pure tensor math; the torchvision import shim vlmrl/__init__.py runs first
    ("config", "defaults"),  # the typed config and the model-aware defaults
    ("data",),  # rows, images, videos, built-in tasks
    ("rewards",),
    ("tools",),  # tool functions, tool-call parsing, environments, trajectories
    ("processors", "tiny_models"),  # processor stand-ins (no torchvision); offline tiny builders
    ("families",),  # one Family per VLM family, the registry and the generic fallback
    ("models",),  # loading, processors, log-probs, prefix, rollout decoders
    ("checkpoints",),
    ("engine",),  # processes, engines, OOM, memory readings
    ("plan",),
    ("run", "rollout"),  # datasets, run folder, preflight, tracking, report, export; the rollout backends (vLLM)
    ("train", "sft", "skeleton", "ending", "evaluate", "demo", "cli", "__main__"),  # the loops, their skeleton and ending, the command line
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layering unit of a module: its subpackage, or the top-level module's own name."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """vlmrl modules `path` imports, at the top or inside functions; relative imports are resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(f): f for f in SRC.rglob("*.py")}
    modules = set(files)
    return {m: imports(f, modules) - {m} for m, f in files.items()}


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if unit_of(module) == "vlmrl" or unit_of(dep) == "vlmrl":  # the package root (version only)
                continue
            if LAYER_OF[unit_of(dep)] > LAYER_OF[unit_of(module)]:
                out.append(f"{module} imports {dep} (layer {unit_of(dep)} is above {unit_of(module)})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_every_package_and_top_level_module_has_a_layer():
    units = {unit_of(m) for m in import_graph()} - {"vlmrl"}
    assert units <= set(LAYER_OF), f"give these a layer in LAYERS: {sorted(units - set(LAYER_OF))}"


def test_no_package_imports_a_higher_layer():
    assert layering_violations(import_graph()) == []


def test_layering_check_catches_a_planted_upward_import():
    graph = import_graph()
    graph["vlmrl.algo.losses"] = graph["vlmrl.algo.losses"] | {"vlmrl.train"}
    graph["vlmrl.models.loading"] = graph["vlmrl.models.loading"] | {"vlmrl.run.datasets"}
    assert layering_violations(graph) == [
        "vlmrl.algo.losses imports vlmrl.train (layer train is above algo)",
        "vlmrl.models.loading imports vlmrl.run.datasets (layer run is above models)",
    ]


def test_imports_resolve_relative_and_lazy_ones(tmp_path):
    pkg = tmp_path / "vlmrl" / "models"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("from .loading import a\n\ndef g():\n    from vlmrl.run import datasets\n")
    global SRC
    saved, SRC = SRC, tmp_path / "vlmrl"
    try:
        assert imports(f, {"vlmrl.models.loading", "vlmrl.run.datasets", "vlmrl.run"}) == {"vlmrl.models.loading", "vlmrl.run", "vlmrl.run.datasets"}
    finally:
        SRC = saved


def test_the_loop_has_no_engine_branches():
    text = (SRC / "train.py").read_text()
    assert "engine ==" not in text and "engine !=" not in text and "world_size ==" not in text
