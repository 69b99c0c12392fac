"""The shape figures issue 33 asks for, read from the source with ast (python scripts/structure_metrics.py [SRC]):
largest files, longest functions, imports inside functions (all; and those of vlmrl's own modules, which are never
optional dependencies), private names imported across modules (`from vlmrl.x import _name` in another module), and
how far the whole Config reaches from train(): the modules train.py reaches by imports (top-level or lazy) that
have a function taking it (a parameter named `cfg` or annotated `Config`), and those functions.
Cyclomatic complexity is radon's (`pip install radon; radon cc -s -n D src/vlmrl`), not computed here."""

from __future__ import annotations

import ast
import json
import pathlib
import sys


def module_name(path: pathlib.Path, src: pathlib.Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def inner_imports(tree: ast.AST) -> list[ast.AST]:
    """Import statements inside a function body (at any depth)."""
    found = []
    for fn in functions(tree):
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in found:
                found.append(node)
    return found


def imported_modules(node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    return [a.name for a in node.names]


def own_imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """vlmrl modules a module imports, at the top or inside functions (`from vlmrl.x import y`: vlmrl.x.y if a module)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlmrl"):
            found |= {n for n in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if n in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found


def takes_config(fn: ast.AST) -> bool:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return any(a.arg == "cfg" or (a.annotation is not None and ast.unparse(a.annotation) == "Config") for a in args)


def config_reach(trees: dict[str, ast.AST], start: str = "vlmrl.train") -> tuple[list[str], int]:
    """(modules reached from `start` by imports with a function taking the whole Config, how many such functions)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen and name in trees:
            seen.add(name)
            todo += own_imports(trees[name], set(trees))
    counts = {name: sum(1 for fn in functions(trees[name]) if takes_config(fn)) for name in seen}
    return sorted(name for name, n in counts.items() if n), sum(counts.values())


# One family's transformers classes per builder / stand-in function, imported when that family is built or loaded (a
# `vlmrl tiny --family X` would otherwise import every family's model code); counted apart, as the CLI's lazy start-up.
BUILDER_DIRS = ("fixtures", "tiny_models", "processors")
BUILDER_FILES = ("plan/presets.py",)


def measure(src: pathlib.Path) -> dict:
    files = sorted(src.rglob("*.py"))
    lines, longest, inner, inner_own, private, trees = [], [], 0, 0, [], {}
    inner_builders = inner_cli = 0
    for path in files:
        text = path.read_text()
        tree = ast.parse(text)
        trees[module_name(path, src)] = tree
        rel = str(path.relative_to(src.parent))
        lines.append((len(text.splitlines()), rel))
        for fn in functions(tree):
            longest.append((fn.end_lineno - fn.lineno + 1, f"{rel}:{fn.name}"))
        nodes = inner_imports(tree)
        inner += len(nodes)
        parts = path.relative_to(src).parts
        if parts[0] in BUILDER_DIRS or "/".join(parts) in BUILDER_FILES:
            inner_builders += len(nodes)
        elif parts == ("cli.py",):
            inner_cli += len(nodes)
        inner_own += sum(1 for n in nodes if any(m.startswith("vlmrl") for m in imported_modules(n)))
        me = module_name(path, src)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlmrl") and node.module != me:
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                private += [f"{rel}: from {node.module} import {name}" for name in names]
    reach = config_reach(trees)
    return {
        "files": len(files),
        "largest_files": sorted(lines, reverse=True)[:6],
        "files_over_900_lines": [f for n, f in lines if n > 900],
        "longest_functions": sorted(longest, reverse=True)[:6],
        "functions_over_150_lines": [f for n, f in longest if n > 150],
        "imports_inside_functions": inner,
        "of_which_vlmrl_modules": inner_own,
        "of_which_in_tiny_builders_stand_ins_presets": inner_builders,
        "of_which_in_cli": inner_cli,
        "imports_inside_functions_elsewhere": inner - inner_builders - inner_cli,
        "private_cross_module_imports": len(private),
        "private_imports": private,
        "modules_taking_the_whole_config_from_train": len(reach[0]),
        "functions_taking_the_whole_config_from_train": reach[1],
    }


def main() -> int:
    src = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1] / "src" / "vlmrl")
    for key, value in measure(src).items():
        print(f"{key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
