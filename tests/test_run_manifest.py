"""vlmrl touches only what it wrote (run_manifest.py): a user's entries in training.output_dir are never replaced or
deleted, the run's inputs inside it are refused before anything is written, by `vlmrl check` too (issue 26 part 1)."""

import json
import os

import pytest
import torch

from vlmrl import cli
from vlmrl.checkpoints.files import CheckpointError, rotate_checkpoints, save_checkpoint, save_folder_atomically
from vlmrl.config import ConfigError, load_config
from vlmrl.run.overwrite import OverwriteRefused, plan_overwrite
from vlmrl.run.rundir import check_output_dir
from vlmrl.checkpoints.run_manifest import MANIFEST_FILE, foreign_names, owned_names, record


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def cfg_for(out, *extra):
    return load_config(None, [f"training.output_dir={out}", "model.defaults=pretrained", *extra])


def user_model(folder):
    """A 'base model' the user keeps in the folder, with notes beside it."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "mine"}')
    (folder / "model.safetensors").write_bytes(b"base weights")
    (folder.parent / "notes.md").write_text("my notes")
    return folder


def save(out, step, limit=None):
    model = torch.nn.Linear(2, 2)
    return save_checkpoint(
        out,
        step,
        save_model=lambda f: torch.save({}, f / "w.pt"),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        trainer_state={"epoch": 0},
        config={"a": 1},
        save_total_limit=limit,
        warn=lambda _: None,
    )


def test_base_model_in_the_output_folder_is_refused_by_check_and_train(tmp_path, capsys):
    proj = tmp_path / "proj"
    user_model(proj / "final")
    before = snapshot(proj)
    for command in ("check", "train", "sft"):
        assert cli.main([command, f"model.name_or_path={proj / 'final'}", f"training.output_dir={proj}"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"model.name_or_path={proj / 'final'} lies inside training.output_dir={proj}" in line
    assert snapshot(proj) == before and sorted(p.name for p in proj.iterdir()) == ["final", "notes.md"]


def test_a_users_final_or_config_under_a_run_name_is_refused(tmp_path, capsys):
    proj = tmp_path / "proj"
    user_model(proj / "final")
    (proj / "config.yaml").write_text("# my hand-written config\ntraining:\n  max_steps: 3\n")
    before = snapshot(proj)
    with pytest.raises(ConfigError, match=r"holds config.yaml, final, which vlmrl did not write but a run would replace"):
        check_output_dir(cfg_for(proj))
    assert cli.main(["train", str(proj / "config.yaml"), f"training.output_dir={proj}"]) == 2
    assert "config.yaml, final, which vlmrl did not write" in capsys.readouterr().err
    assert snapshot(proj) == before


def test_overwrite_never_deletes_a_folder_vlmrl_did_not_write(tmp_path):
    proj = tmp_path / "proj"
    user_model(proj / "final")
    (proj / "notes.md").unlink()
    (proj / "config.yaml").write_text("training:\n  max_steps: 3\n")  # looks like a run folder by its names only
    before = snapshot(proj)
    with pytest.raises(OverwriteRefused, match="is not a vlmrl run folder"):
        plan_overwrite(cfg_for(proj, "training.overwrite_output_dir=true"))
    assert snapshot(proj) == before


def test_rotation_leaves_a_checkpoint_vlmrl_did_not_write(tmp_path):
    out = tmp_path / "out"
    hf = out / "checkpoint-500"  # a Hugging Face Trainer checkpoint: no vlmrl manifest, so "invalid" to vlmrl
    hf.mkdir(parents=True)
    (hf / "trainer_state.json").write_text('{"global_step": 500}')
    (hf / "model.safetensors").write_bytes(b"w")
    for step in (1, 2, 3):
        save(out, step, limit=1)
    assert hf.is_dir() and (hf / "model.safetensors").read_bytes() == b"w"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3", "checkpoint-500"]
    assert owned_names(out) >= {"checkpoint-3"} and "checkpoint-500" in foreign_names(out)
    assert rotate_checkpoints(out, 1) == []
    with pytest.raises(ConfigError, match="holds checkpoint-500, which vlmrl did not write"):
        check_output_dir(cfg_for(out))


def test_final_is_replaced_only_when_vlmrl_wrote_it(tmp_path):
    mine = user_model(tmp_path / "proj" / "final")
    with pytest.raises(CheckpointError, match="refusing to replace .*final: vlmrl did not write it"):
        save_folder_atomically(mine, lambda f: (f / "x").write_text("new"))
    assert (mine / "model.safetensors").read_bytes() == b"base weights"
    ours = save_folder_atomically(tmp_path / "run" / "final", lambda f: (f / "x").write_text("1"))
    save_folder_atomically(ours, lambda f: (f / "x").write_text("2"))
    assert (ours / "x").read_text() == "2" and "final" in owned_names(ours.parent)


@pytest.mark.parametrize("key", ["data.train_path", "data.eval_path", "algorithm.reward_funcs"])
def test_the_runs_inputs_inside_the_output_folder_are_refused(tmp_path, key):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "r.py").write_text("def r(completions, **k):\n    return [0.0] * len(completions)\n")
    value = f"[{out / 'sub' / 'r.py'}:r]" if key == "algorithm.reward_funcs" else str(out / "sub" / "rows.jsonl")
    with pytest.raises(ConfigError, match=rf"{key}(\[0\])?=.* lies inside training.output_dir={out}"):
        check_output_dir(cfg_for(out, f"{key}={value}"))


def test_output_dir_that_is_a_file_or_read_only_fails_check_in_one_line(tmp_path, capsys, monkeypatch):
    f = tmp_path / "out"
    f.write_text("not a folder")
    assert cli.main(["check", f"training.output_dir={f}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"vlmrl check: training.output_dir={f} is a file, not a folder; pick another training.output_dir"
    assert cli.main(["check", f"training.output_dir={f / 'sub'}"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as root, chmod cannot make a folder unwritable
    assert cli.main(["check", f"training.output_dir={ro / 'run'}"]) == 2
    assert f"training.output_dir={ro / 'run'}: {ro} is not writable" in capsys.readouterr().err


def test_legacy_run_folder_without_a_manifest_is_still_vlmrls(tmp_path):
    out = tmp_path / "old"
    save(out, 2)
    (out / MANIFEST_FILE).unlink()  # as a vlmrl before the manifest left it
    (out / "metrics.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    (out / "config.yaml").write_text("{}")
    (out / "checkpoint-7").mkdir()  # not vlmrl's: no config_hash in a trainer_state.json
    (out / "notes.md").write_text("mine")
    assert owned_names(out) == {"checkpoint-2", "metrics.jsonl", "config.yaml"}
    assert foreign_names(out) == ["checkpoint-7", "notes.md"]
    record(out, ["final"])
    assert owned_names(out) == {"checkpoint-2", "metrics.jsonl", "config.yaml", "final"}


@pytest.mark.parametrize("what", ["checkpoint", "final"])
def test_a_kill_right_after_the_rename_leaves_a_folder_vlmrl_owns(tmp_path, monkeypatch, what):
    """A SIGKILL between moving a checkpoint (or final/) into place and recording it in the run's manifest left a
    folder vlmrl had written but did not own: the resumed run refused it ("vlmrl did not write"; met killing a
    server-mode run once checkpoint-2 appeared). The name is claimed before the rename now."""
    import vlmrl.checkpoints.files as files

    class Killed(BaseException):
        pass

    def rename_then_die(real):
        def wrapped(src, dst):
            real(src, dst)
            if os.path.basename(dst) in ("checkpoint-2", "final"):
                raise Killed  # the process ends here: nothing after the rename runs

        return wrapped

    record(tmp_path, ["config.yaml"])  # a run's folder: its manifest lists what the run wrote so far
    monkeypatch.setattr(files.os, "rename", rename_then_die(os.rename))
    with pytest.raises(Killed):
        save(tmp_path, 2) if what == "checkpoint" else save_folder_atomically(tmp_path / "final", lambda f: (f / "w").write_text("w"))
    name = "checkpoint-2" if what == "checkpoint" else "final"
    assert (tmp_path / name).is_dir() and name in owned_names(tmp_path) and foreign_names(tmp_path) == []
