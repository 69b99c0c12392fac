"""output_dir rules: a complete run is reported complete (exit 0, nothing retrained) unless
training.overwrite_output_dir=true, which deletes only what vlmrl wrote; resume is announced with its step; `vlmrl sft`
follows the same rules; `vlmrl check` says what a run would do with the folder."""

import json
import os

import pytest

from vlmrl import cli
from vlmrl.config import load_config
from vlmrl.run.overwrite import OverwriteRefused, entries_to_delete, foreign_entries, is_run_entry, plan_overwrite, remove_entries
from vlmrl.checkpoints.run_manifest import MANIFEST_FILE, record
from vlmrl.run.rundir import COMPLETE_FILE, LOCK_FILE, RunAlreadyComplete, describe_output_dir
from vlmrl.sft import sft
from vlmrl.data.tasks import make_count_task
from vlmrl.train import train


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=4, seed=0, image_size=56)


def args(model, data, out, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        f"data.eval_path={data['test']}",
        f"training.output_dir={out}",
        "training.max_steps=2",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=4",
        "rollout.max_completion_length=3",
        "sft.projector_steps=0",
        "sft.steps=2",
        "sft.batch_size=4",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        *extra,
    ]


def snapshot(folder):
    """Every file under `folder`: its bytes and modification time."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


RUN_NAMES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "samples.jsonl", "report.png", COMPLETE_FILE)


def fake_run(out, *names):
    """A run folder as vlmrl leaves it (contents are placeholders, its manifest lists them), plus `names`."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (*RUN_NAMES, *names):
        (out / name).write_text("{}")
    for name in ("final", "checkpoint-2", "tb", "data/count/images"):
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "x").write_text("x")
    record(out, [*RUN_NAMES, "final", "checkpoint-2", "tb", "data"])
    return out


def cfg_for(out, *extra):
    return load_config(None, [f"training.output_dir={out}", "training.overwrite_output_dir=true", "model.defaults=pretrained", *extra])


# ---------------------------------------------------------------- which folders an overwrite may empty (no model)
def test_only_vlmrl_entries_count_as_a_run(tmp_path):
    out = fake_run(tmp_path / "run", ".metrics.jsonl.tmp", LOCK_FILE)
    (out / ".tmp-checkpoint-3").mkdir()
    (out / ".old-final").mkdir()
    assert foreign_entries(out) == []
    (out / "notes.txt").write_text("mine")
    (out / "checkpoint-best").mkdir()  # not checkpoint-<step>
    os.symlink(tmp_path, out / "wandb-link")
    assert foreign_entries(out) == ["checkpoint-best", "notes.txt", "wandb-link"]
    os.symlink(tmp_path, out / "final-link")
    assert not is_run_entry(out / "final-link")


def test_overwrite_refuses_a_folder_with_foreign_files_and_touches_nothing(tmp_path):
    out = fake_run(tmp_path / "run", "thesis.tex")
    before = snapshot(out)
    with pytest.raises(OverwriteRefused, match=r"holds files no vlmrl run writes \(thesis.tex\)"):
        plan_overwrite(cfg_for(out))
    assert snapshot(out) == before


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path):
    out = tmp_path / "mine"
    (out / "tb").mkdir(parents=True)  # a name vlmrl writes, but no run: config.yaml, metrics.jsonl or a checkpoint
    with pytest.raises(OverwriteRefused, match="is not a vlmrl run folder"):
        plan_overwrite(cfg_for(out))
    assert (out / "tb").is_dir()
    assert plan_overwrite(cfg_for(tmp_path / "absent")) == []
    (tmp_path / "empty").mkdir()
    assert plan_overwrite(cfg_for(tmp_path / "empty")) == []


@pytest.mark.parametrize("key, inside", [("model.name_or_path", "final"), ("data.train_path", "checkpoint-2/x"), ("training.resume", "checkpoint-2")])
def test_overwrite_refuses_to_delete_the_runs_own_inputs(tmp_path, key, inside):
    out = fake_run(tmp_path / "run")
    before = snapshot(out)
    with pytest.raises(OverwriteRefused, match=rf"would delete {out / inside.split('/')[0]}, which {key}="):
        plan_overwrite(cfg_for(out, f"{key}={out / inside}"))
    assert snapshot(out) == before


def test_remove_keeps_the_lock_and_the_builtin_task_data(tmp_path):
    out = fake_run(tmp_path / "run", LOCK_FILE)
    (out / ".vlmrl-overwritten-1").mkdir()  # left by an overwrite killed half way
    doomed = plan_overwrite(cfg_for(out, f"data.train_path={out / 'data' / 'count' / 'images' / 'x'}"))
    lines = []
    remove_entries(out, doomed, lines.append)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_FILE, LOCK_FILE, "data"] and (out / "data/count/images/x").is_file()
    assert lines == [
        f"training.overwrite_output_dir=true: deleted the earlier run in {out} (checkpoint-2, config.yaml, eval.jsonl, final, "
        f"metrics.jsonl, report.png, run_complete.json, samples.jsonl and 1 more); starting over at step 0"
    ]
    assert entries_to_delete(out) == []


# ---------------------------------------------------------------- the rules on real runs (tiny model)
@pytest.fixture(scope="module")
def done_run(tiny_qwen25vl, count_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("done") / "run"
    train(load_config(None, args(tiny_qwen25vl, count_data, out, "training.save_steps=1")))
    return out


def test_every_file_a_run_writes_is_a_run_entry(tiny_qwen25vl, count_data, tmp_path):
    out = tmp_path / "run"
    extra = ["logging.tensorboard=true", "logging.report=true", "training.save_steps=1", "data.eval_path=", "data.train_path="]
    train(load_config(None, args(tiny_qwen25vl, count_data, out, *extra)))  # built-in task: data/ too
    assert {"final", "checkpoint-2", "tb", "report.png", "data", COMPLETE_FILE} <= {p.name for p in out.iterdir()}
    assert foreign_entries(out) == []
    sft_out = tmp_path / "sft"
    sft(load_config(None, args(tiny_qwen25vl, count_data, sft_out, "logging.tensorboard=true", "logging.report=true")))
    assert (sft_out / "final").is_dir() and foreign_entries(sft_out) == []


def test_a_complete_run_is_reported_complete(done_run, tiny_qwen25vl, count_data, capsys):
    before = snapshot(done_run)
    for extra in ([], ["training.resume=never"]):  # resume=never does not retrain a finished run either
        assert cli.main(["train", *args(tiny_qwen25vl, count_data, done_run, "training.save_steps=1", *extra)]) == 0
        err = capsys.readouterr().err
        assert f"the vlmrl train run in {done_run} is complete (2 steps, final model in" in err and "overwrite_output_dir=true" in err
    assert snapshot(done_run) == before


def test_check_says_what_the_run_would_do(done_run, tiny_qwen25vl, count_data, tmp_path):
    complete = describe_output_dir(load_config(None, args(tiny_qwen25vl, count_data, done_run)))
    assert complete.startswith(f"output_dir {done_run}: the vlmrl train run in {done_run} is complete (2 steps")
    assert describe_output_dir(load_config(None, args(tiny_qwen25vl, count_data, tmp_path / "n"))) == f"output_dir {tmp_path / 'n'}: new run"
    overwrite = describe_output_dir(load_config(None, args(tiny_qwen25vl, count_data, done_run, "training.overwrite_output_dir=true")))
    assert "new run (training.overwrite_output_dir=true deletes the earlier run first" in overwrite


def test_resume_is_announced_with_its_step_and_check_predicts_it(tiny_qwen25vl, count_data, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, args(tiny_qwen25vl, count_data, out, "training.save_steps=1"))
    train(cfg, stop_after=1)
    assert (
        describe_output_dir(cfg)
        == f"output_dir {out}: resumes from checkpoint-1 (step 1: of 2 for vlmrl train, of its stages' steps of 2 for vlmrl sft)"
    )
    lines = []
    train(cfg, log=lines.append)
    assert f"resuming from {out / 'checkpoint-1'} at step 1 of 2 (training.overwrite_output_dir=true starts over instead)" in lines
    assert steps(out / "metrics.jsonl") == [1, 2]


def test_overwrite_deletes_the_earlier_run_and_trains_anew(done_run, tiny_qwen25vl, count_data, tmp_path, capsys):
    out = tmp_path / "copy"
    import shutil

    shutil.copytree(done_run, out)
    old_marker = json.loads((out / COMPLETE_FILE).read_text())
    assert cli.main(["train", *args(tiny_qwen25vl, count_data, out, "training.overwrite_output_dir=true")]) == 0
    out_text = capsys.readouterr().out
    assert "training.overwrite_output_dir=true: deleted the earlier run in" in out_text
    assert not (out / "checkpoint-1").exists() and not (out / "checkpoint-2").exists()  # save_steps=0 now: none written
    assert steps(out / "metrics.jsonl") == [1, 2] and (out / "final").is_dir()
    assert json.loads((out / COMPLETE_FILE).read_text())["finished"] > old_marker["finished"]


def test_overwrite_refusals_are_one_line_and_leave_everything(done_run, tiny_qwen25vl, count_data, tmp_path, capsys):
    out = tmp_path / "copy"
    import shutil

    shutil.copytree(done_run, out)
    (out / "my_notes.md").write_text("do not delete")
    before = snapshot(out)
    assert cli.main(["train", *args(tiny_qwen25vl, count_data, out, "training.overwrite_output_dir=true")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("vlmrl train: training.overwrite_output_dir=true: ") and "(my_notes.md)" in line
    (out / "my_notes.md").unlink()
    del before["my_notes.md"]
    # Training again from this folder's own final model: the overwrite would delete the start model.
    assert cli.main(["sft", *args(out / "final", count_data, out, "training.overwrite_output_dir=true")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"would delete {out / 'final'}, which model.name_or_path=" in line
    assert snapshot(out) == before


def test_sft_follows_the_same_rules(tiny_qwen25vl, count_data, tmp_path, capsys):
    out = tmp_path / "sft"
    base = args(tiny_qwen25vl, count_data, out)
    assert cli.main(["sft", *base]) == 0
    assert json.loads((out / COMPLETE_FILE).read_text())["kind"] == "sft" and steps(out / "metrics.jsonl") == [1, 2]
    before = snapshot(out)
    capsys.readouterr()
    assert cli.main(["sft", *base]) == 0
    assert f"the vlmrl sft run in {out} is complete (2 steps" in capsys.readouterr().err
    assert snapshot(out) == before
    with pytest.raises(RunAlreadyComplete):
        sft(load_config(None, base))
    # An unfinished SFT run (killed: no marker) starts over, each step logged once.
    (out / COMPLETE_FILE).unlink()
    sft(load_config(None, base))
    assert steps(out / "metrics.jsonl") == [1, 2]
    lines = []
    sft(load_config(None, [*base, "training.overwrite_output_dir=true"]), log=lines.append)
    assert any(line.startswith("training.overwrite_output_dir=true: deleted the earlier run") for line in lines)
    assert steps(out / "metrics.jsonl") == [1, 2]


def test_train_on_a_finished_sft_runs_folder_is_refused_and_no_eval_prints_no_braces(tiny_qwen25vl, count_data, tmp_path, capsys):
    """Issue 35 (small): `vlmrl train` on a folder holding a finished SFT run said "nothing to do" with exit 0; it is
    refused in one line naming the way on (exit 2). A run without evaluation printed `{}`; it says so instead."""
    out = tmp_path / "sft"
    no_eval = [a for a in args(tiny_qwen25vl, count_data, out) if not a.startswith("data.eval_path=")] + ["data.eval_path="]
    assert cli.main(["sft", *no_eval]) == 0
    captured = capsys.readouterr()
    assert "{}" not in captured.out and "no evaluation ran (data.eval_path is empty)" in captured.err
    before = snapshot(out)
    assert cli.main(["train", *no_eval]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vlmrl train:")]
    assert f"holds a finished vlmrl sft run (2 steps), not a vlmrl train run; to train GRPO from it use model.name_or_path={out / 'final'}" in line
    assert snapshot(out) == before
