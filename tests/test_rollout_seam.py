"""The rollout seam (rollout/base.py): the loops, their skeleton and the evaluation reach a decoder only through a
RolloutBackend. A module outside rollout/ that imported a decoder entry point (models/rollout.generate, the
shared-prefix loop, the continuous decoder, the multi-turn engine, tool rollouts) would sample around the backend the
run chose (e.g. in-process while rollout.backend=vllm), so it fails here. At run time too: a GRPO step and its
evaluation with every decoder (and HF generate) wrapped, each call must come from a rollout/ backend method (catches
a decoder reached through importlib, an attribute or HF generate on the model, which no import shows)."""

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


# ---------------------------------------------------------------- at run time: every decoder call inside a backend
ROLLOUT_DIR = str(SRC / "rollout")


EVALUATE = str(SRC / "evaluate.py")


def callers(frame) -> tuple[bool, bool]:
    """(a frame of a rollout/ module, i.e. a RolloutBackend's method, is on the stack below `frame`; evaluate.py is)."""
    files = []
    while frame is not None:
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    return any(f.startswith(ROLLOUT_DIR) for f in files), EVALUATE in files


@pytest.fixture
def decoder_calls(monkeypatch):
    """Every decoder entry point (DECODERS, wherever a module bound it by name, and HF's GenerationMixin.generate)
    replaced by a wrapper that records (name, called inside a backend, called by the evaluation)."""
    import sys

    import vlmrl.evaluate  # noqa: F401 - the loops, the evaluation and what they import bind their names first
    import vlmrl.sft  # noqa: F401
    import vlmrl.train  # noqa: F401

    from transformers.generation.utils import GenerationMixin

    calls = []

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            calls.append((name, *callers(sys._getframe(1))))
            return fn(*args, **kwargs)

        return recorded

    import importlib

    originals = {getattr(importlib.import_module(m), n): f"{m}.{n}" for m, names in DECODERS.items() for n in names}
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("vlmrl")]:
        for attr, value in list(vars(module).items()):
            if callable(value) and value in originals:
                monkeypatch.setattr(module, attr, wrap(originals[value], value))
    monkeypatch.setattr(GenerationMixin, "generate", wrap("GenerationMixin.generate", GenerationMixin.generate))
    return calls


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    from vlmrl.data.tasks import make_count_task

    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=2, seed=0, image_size=56)


@pytest.mark.integration
@pytest.mark.parametrize(
    "engine",
    [
        ["rollout.engine=loop"],  # the shared-prefix loop
        ["rollout.engine=continuous"],
        ["memory.shared_prefix=false"],  # HF generate
    ],
    ids=["loop", "continuous", "hf"],
)
def test_a_grpo_step_and_its_evaluation_decode_only_inside_the_backend(tiny_qwen25vl, count_data, tmp_path, decoder_calls, engine):
    """One GRPO step and the evaluation at its end on the tiny Qwen2.5-VL: every decoder call (the loop's rollout and
    the evaluation's greedy decoding) comes from a rollout/ backend method; a loop or an evaluation that called a
    decoder directly (or HF generate on the model) would add a call made outside it."""
    from vlmrl.config import load_config
    from vlmrl.train import train

    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_qwen25vl}",
            f"data.train_path={count_data['train']}",
            f"data.eval_path={count_data['test']}",
            f"training.output_dir={tmp_path / 'out'}",
            "training.max_steps=1",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=2",
            "rollout.generation_batch_size=2",
            "rollout.max_completion_length=4",
            "training.save_final_model=false",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            *engine,
        ],
    )
    train(cfg, log=lambda *_: None)
    assert {evaluation for _, _, evaluation in decoder_calls} == {False, True}  # the rollout and the evaluation decoded
    outside = [name for name, inside, _ in decoder_calls if not inside]
    assert outside == []


def test_the_run_time_check_sees_a_decoder_called_outside_a_backend(decoder_calls):
    """The guard's own check: a decoder called from here (not from rollout/) is recorded as outside."""
    from vlmrl.models import prefix

    with pytest.raises(Exception):  # noqa: B017 - no model: only the record before the call matters
        prefix.sample_with_shared_prefix(None, {}, num_generations=1, max_new_tokens=1, eos_ids=[0], pad_id=0, suppress_ids=[])
    assert decoder_calls == [("vlmrl.models.prefix.sample_with_shared_prefix", False, False)]
