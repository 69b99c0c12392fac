"""The rollout seam (rollout/base.py): the loops, their skeleton and the evaluation reach a decoder only through a
RolloutBackend. A module outside rollout/ that imported a decoder entry point (models/rollout.generate, the
shared-prefix loop, the continuous engine, the multi-turn engine, tool rollouts) would sample around the backend the
run chose (e.g. in-process while rollout.backend=vllm), so it fails here."""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

SRC = pathlib.Path(__file__).parents[1] / "src" / "vlmrl"
DECODERS = {
    "vlmrl.models.rollout": {"generate"},
    "vlmrl.models.prefix": {"sample_with_shared_prefix"},
    "vlmrl.models.continuous": {"sample_continuous"},
    "vlmrl.models.multiturn": {"sample_multiturn"},
    "vlmrl.run.tool_rollout": {"sample_with_tools"},
}
# Where decoders live and call each other (the engines themselves), and the backends that wrap them.
ENGINE_MODULES = {"vlmrl.models.rollout", "vlmrl.models.prefix", "vlmrl.models.continuous", "vlmrl.models.multiturn", "vlmrl.run.tool_rollout"}


def module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts)


def decoder_imports(path: pathlib.Path) -> list[str]:
    """'module.name' of every decoder entry point `path` imports (at the top or inside functions), or reaches as an
    attribute of an imported engine module."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in DECODERS:
            found += [f"{node.module}.{a.name}" for a in node.names if a.name in DECODERS[node.module]]
        if isinstance(node, ast.Attribute) and node.attr in set().union(*DECODERS.values()):
            base = ast.unparse(node.value)
            if any(base.endswith(m.rsplit(".", 1)[1]) for m in DECODERS):
                found.append(f"{base}.{node.attr}")
    return found


def outside_the_seam() -> dict[str, list[str]]:
    out = {}
    for path in SRC.rglob("*.py"):
        name = module_name(path)
        if name.startswith("vlmrl.rollout.") or name in ENGINE_MODULES:
            continue
        hits = decoder_imports(path)
        if hits:
            out[name] = hits
    return out


def test_only_rollout_backends_reach_a_decoder():
    assert outside_the_seam() == {}


def test_the_check_sees_a_decoder_imported_by_the_loop(tmp_path, monkeypatch):
    """The guard's own check: the loop importing generate again is found."""
    planted = SRC / "train.py"
    source = planted.read_text()
    assert "from vlmrl.models.rollout import generate" not in source
    fake = tmp_path / "train.py"
    fake.write_text(source + "\nfrom vlmrl.models.rollout import generate  # noqa\n")
    assert decoder_imports(fake) == ["vlmrl.models.rollout.generate"]


def test_the_loop_and_the_evaluation_sample_through_the_backend():
    """train.sample calls run.backend.sample; evaluate decodes with the run's backend's evaluator (the in-process one
    where none is given) and calls its greedy; the loop hands its backend to the evaluation."""
    train = ast.parse((SRC / "train.py").read_text())
    sample = next(n for n in train.body if isinstance(n, ast.FunctionDef) and n.name == "sample")
    assert "run.backend.sample(request)" in ast.unparse(sample)
    evaluate = (SRC / "evaluate.py").read_text()
    assert "InProcessRollout(" in evaluate and "backend.evaluator(model, opts)" in evaluate and "evaluator.greedy(" in evaluate
    evaluate_run = next(n for n in train.body if isinstance(n, ast.FunctionDef) and n.name == "evaluate_run")
    assert "backend=run.backend" in ast.unparse(evaluate_run)
