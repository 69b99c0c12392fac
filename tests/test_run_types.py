"""One return type per function of a run's start, and typed run records (issue 33, part 3): `start_run` / `start_sft`
return the run (training done, only the ending left: rundir.EndingLeft is raised, like RunAlreadyComplete), and no
field of Run, SFTRun, RunBase, Ending or InProcessRollout is typed `object` or an unparametrised dict / list."""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

SRC = pathlib.Path(__file__).parents[1] / "src" / "vlmrl"
RECORDS = {
    "train.py": ["Run"],
    "sft.py": ["SFTRun"],
    "skeleton.py": ["RunBase"],
    "ending.py": ["Ending"],
    "rollout/inprocess.py": ["InProcessRollout"],
}
STARTS = {
    "train.py": {"start_run": "Run"},
    "sft.py": {"start_sft": "SFTRun", "prepare_sft": "Path | None"},
    "run/rundir.py": {"prepare_run": "Optional[Path]"},
}


def top(path: str, kind, name: str):
    tree = ast.parse((SRC / path).read_text())
    return next(n for n in tree.body if isinstance(n, kind) and n.name == name)


def loose_fields(path: str, name: str) -> list[str]:
    cls = top(path, ast.ClassDef, name)
    fields = [n for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert fields, name
    return [
        f"{name}.{ast.unparse(f.target)}: {ast.unparse(f.annotation)}"
        for f in fields
        if ast.unparse(f.annotation) in ("object", "dict", "list", "Any")
    ]


def test_run_records_have_no_untyped_fields():
    assert [f for path, names in RECORDS.items() for name in names for f in loose_fields(path, name)] == []


def test_a_run_start_returns_one_type():
    got = {path: {name: ast.unparse(top(path, ast.FunctionDef, name).returns) for name in names} for path, names in STARTS.items()}
    assert got == STARTS


def test_the_check_sees_a_loose_field(tmp_path, monkeypatch):
    """The guard's own check: a field typed `object` is found."""
    (tmp_path / "x.py").write_text("class R:\n    a: int\n    b: object  # anything\n    c: dict\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    assert loose_fields("x.py", "R") == ["R.b: object", "R.c: dict"]


def test_ending_left_is_raised_on_every_process_and_carries_what_the_ending_needs(monkeypatch):
    """prepare_run on the main process finds only the ending left: every process raises EndingLeft with the step
    and the evaluation done before the stop (none is returned in place of a checkpoint)."""
    from vlmrl.run import rundir

    def only_the_ending(cfg, log, total, kind):
        raise rundir.EndingLeft(total, evaluated={"eval/reward": 1.0})

    monkeypatch.setattr(rundir, "_prepare", only_the_ending)

    class Dist:
        world_size, is_main = 2, True
        sent = None

        def broadcast(self, value):  # the main process's value reaches every process
            if self.is_main:
                Dist.sent = value
            return Dist.sent

    with pytest.raises(rundir.EndingLeft) as left:
        rundir.prepare_run(None, print, Dist(), total_steps=7)
    assert (left.value.step, left.value.evaluated) == (7, {"eval/reward": 1.0})
    assert Dist.sent == ("ending", (7, {"eval/reward": 1.0}))  # what the other processes raise from
    Dist.is_main = False
    with pytest.raises(rundir.EndingLeft) as other:
        rundir.prepare_run(None, print, Dist(), total_steps=7)
    assert (other.value.step, other.value.evaluated) == (7, {"eval/reward": 1.0})
