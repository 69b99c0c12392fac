"""Checkpoints: atomic save, validity, exact resume, fallback, rotation, failure handling, safe loading."""

import errno
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import vlmrl.checkpoints.files as ckpt
from vlmrl.checkpoints.files import (
    CheckpointError,
    CheckpointSaveError,
    GracefulStop,
    check_resume_compat,
    config_diff,
    find_resume_checkpoint,
    list_checkpoints,
    load_training_state,
    restore_rng,
    rotate_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from vlmrl.config import load_config, to_dict

CONFIG = {"training": {"seed": 0, "max_steps": 10}, "algorithm": {"beta": 0.0}}


def make_run(seed: int = 0):
    """A tiny model, AdamW and a transformers cosine schedule with warmup."""
    from transformers import get_scheduler

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=10)
    return model, opt, sched


def train_step(model, opt, sched):
    """One step whose data depends on every RNG stream, so a wrong RNG restore shows in the weights."""
    x = torch.randn(5, 4) * (1 + random.random()) + float(np.random.rand())
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def saver(model):
    return lambda folder: save_file(model.state_dict(), str(folder / "model.safetensors"))


def save(out, step, model, opt, sched, **kw):
    kw.setdefault("trainer_state", {"epoch": 0, "samples_consumed": step * 5, "best_metric": None, "best_step": None})
    return save_checkpoint(out, step, save_model=saver(model), optimizer=opt, scheduler=sched, config=CONFIG, **kw)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip_is_bit_exact(tmp_path):
    model, opt, sched = make_run()
    random.seed(1), np.random.seed(1)
    for _ in range(2):
        train_step(model, opt, sched)
    path = save(tmp_path, 2, model, opt, sched)
    assert path == tmp_path / "checkpoint-2"
    assert verify_checkpoint(path) == (True, "ok")
    assert {p.name for p in path.iterdir()} == {
        "model",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state_0.pt",
        "trainer_state.json",
        "config.yaml",
        "manifest.json",
    }
    for _ in range(3):  # the uninterrupted run
        train_step(model, opt, sched)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # A fresh process: different init, disturbed RNG; everything comes from the checkpoint.
    model2, opt2, sched2 = make_run(seed=123)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    model2.load_state_dict(load_file(str(path / "model" / "model.safetensors")))
    state = load_training_state(path, opt2, sched2)
    restore_rng(path)
    assert state["global_step"] == 2 and state["samples_consumed"] == 10 and state["weights_only"] is False
    assert set(state["versions"]) >= {"python", "torch", "transformers", "vlmrl"}
    assert sched2.last_epoch == 2
    for _ in range(3):
        train_step(model2, opt2, sched2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert sched2.get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize("damage", ["flip", "delete_file", "delete_manifest", "bad_manifest"])
def test_invalid_checkpoint_falls_back_with_warning(tmp_path, damage):
    model, opt, sched = make_run()
    save(tmp_path, 1, model, opt, sched)
    newest = save(tmp_path, 2, model, opt, sched)
    if damage == "flip":
        flip_byte(newest / "model" / "model.safetensors")
    elif damage == "delete_file":
        (newest / "optimizer.pt").unlink()
    elif damage == "delete_manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    ok, reason = verify_checkpoint(newest)
    assert not ok and reason
    warnings = []
    assert find_resume_checkpoint(tmp_path, "auto", warn=warnings.append) == tmp_path / "checkpoint-1"
    assert len(warnings) == 1 and str(newest) in warnings[0] and reason in warnings[0]
    with pytest.raises(CheckpointError, match="checkpoint-2"):
        find_resume_checkpoint(tmp_path, str(newest))


def test_verify_reasons(tmp_path):
    model, opt, sched = make_run()
    path = save(tmp_path, 1, model, opt, sched)
    (path / "scheduler.pt").unlink()
    assert verify_checkpoint(path) == (False, "missing file scheduler.pt")
    path = save(tmp_path, 2, model, opt, sched)
    flip_byte(path / "optimizer.pt")
    assert "sha256 mismatch for optimizer.pt" in verify_checkpoint(path)[1]
    with open(path / "config.yaml", "a") as f:
        f.write("x")
    assert "size mismatch for config.yaml" in verify_checkpoint(path)[1]


def test_resume_modes_and_tmp_leftovers(tmp_path):
    assert find_resume_checkpoint(tmp_path / "nothing", "auto") is None
    model, opt, sched = make_run()
    save(tmp_path, 3, model, opt, sched)
    # A save killed half-way: a complete-looking tmp folder, even with a manifest, must be ignored.
    stale = tmp_path / ".tmp-checkpoint-7"
    (stale / "model").mkdir(parents=True)
    (stale / "manifest.json").write_text(json.dumps({"files": {}}))
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint-3"]
    assert find_resume_checkpoint(tmp_path, "auto") == tmp_path / "checkpoint-3"
    assert find_resume_checkpoint(tmp_path, "never") is None
    assert find_resume_checkpoint(tmp_path, str(tmp_path / "checkpoint-3")) == tmp_path / "checkpoint-3"
    with pytest.raises(CheckpointError, match="does not exist"):
        find_resume_checkpoint(tmp_path, str(tmp_path / "checkpoint-99"))
    # Saving the same step again replaces it safely; a new save removes the stale tmp through rotation.
    save(tmp_path, 3, model, opt, sched)
    save(tmp_path, 7, model, opt, sched, save_total_limit=5)
    assert not stale.exists()
    assert [p.name for p in tmp_path.iterdir()] and all(not p.name.startswith(".") for p in tmp_path.iterdir())


def test_interrupted_replacement_is_recovered(tmp_path):
    """Killed between parking the old checkpoint-N and renaming the new one in: the old one comes back."""
    model, opt, sched = make_run()
    save(tmp_path, 4, model, opt, sched)
    os.rename(tmp_path / "checkpoint-4", tmp_path / ".old-checkpoint-4")
    warnings = []
    assert find_resume_checkpoint(tmp_path, "auto", warn=warnings.append) == tmp_path / "checkpoint-4"
    assert verify_checkpoint(tmp_path / "checkpoint-4")[0] and "restored" in warnings[0]


def test_scheduler_state_with_objects_is_stripped(tmp_path):
    """A scheduler whose state holds a non-tensor object still saves, and loads under weights_only."""
    model, opt, sched = make_run()

    class Scale:
        def __call__(self, step):
            return 1.0

    custom = torch.optim.lr_scheduler.LambdaLR(opt, Scale())
    custom.extra = Plain()  # ends up in state_dict(); unloadable under weights_only=True
    path = save(tmp_path, 1, model, opt, custom)
    fresh = torch.optim.lr_scheduler.LambdaLR(make_run()[1], Scale())
    load_training_state(path, None, fresh)
    assert fresh.last_epoch == custom.last_epoch


def test_module_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, vlmrl.checkpoints.files; assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_list_sorts_numerically(tmp_path):
    for step in (10, 9, 100):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-x").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-10", "checkpoint-100"]


def test_rotation_keeps_newest_valid_and_best(tmp_path):
    model, opt, sched = make_run()
    for step in (1, 2, 3, 4, 5):
        save(tmp_path, step, model, opt, sched)
    flip_byte(tmp_path / "checkpoint-5" / "optimizer.pt")  # the newest is corrupted
    warnings = []
    rotate_checkpoints(tmp_path, 2, best_step=1, warn=warnings.append)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-4"]
    assert any("checkpoint-5" in w for w in warnings)
    # Through save_checkpoint: limit 1 still keeps the best (from trainer_state) and the newest.
    save(tmp_path, 6, model, opt, sched, save_total_limit=1, trainer_state={"epoch": 0, "best_metric": 0.9, "best_step": 1})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-6"]


@pytest.mark.parametrize("where", ["torch_save", "save_model"])
def test_disk_full_leaves_previous_intact(tmp_path, monkeypatch, where):
    model, opt, sched = make_run()
    good = save(tmp_path, 1, model, opt, sched)
    full = OSError(errno.ENOSPC, "No space left on device")
    callback = saver(model)
    if where == "torch_save":

        def boom(*a, **k):
            raise full

        monkeypatch.setattr(torch, "save", boom)
    else:

        def callback(folder):
            (folder / "model.safetensors").write_bytes(b"partial")
            raise full

    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(tmp_path, 2, save_model=callback, optimizer=opt, scheduler=sched, trainer_state={}, config=CONFIG)
    msg = str(info.value)
    assert str(tmp_path / "checkpoint-2") in msg and "No space left" in msg
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert verify_checkpoint(good) == (True, "ok")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_failed_resave_of_same_step_keeps_old(tmp_path, monkeypatch):
    model, opt, sched = make_run()
    good = save(tmp_path, 1, model, opt, sched)
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(CheckpointSaveError):
        save(tmp_path, 1, model, opt, sched)
    assert verify_checkpoint(good) == (True, "ok")


def test_weights_only_checkpoint(tmp_path):
    model, opt, sched = make_run()
    path = save(tmp_path, 4, model, opt, sched, weights_only=True)
    assert verify_checkpoint(path)[0]
    assert not (path / "optimizer.pt").exists() and not (path / "rng_state_0.pt").exists()
    assert ckpt.is_weights_only(path)
    with pytest.raises(CheckpointError, match="resume_weights_only=true"):
        load_training_state(path, opt, sched)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class Plain:
    pass


@pytest.mark.parametrize("payload", [Evil(), Plain()])
def test_loader_refuses_pickled_objects(tmp_path, payload):
    model, opt, sched = make_run()
    path = save(tmp_path, 1, model, opt, sched)
    torch.save({"state": {}, "param_groups": [], "x": payload}, path / "optimizer.pt")
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_training_state(path, opt, sched)
    torch.save({"python": payload}, path / "rng_state_0.pt")
    with pytest.raises(CheckpointError, match="refusing to load"):
        restore_rng(path)


def test_config_diff_classification():
    old = to_dict(load_config(overrides=["model.defaults=pretrained"]))
    new = to_dict(
        load_config(
            overrides=[
                "model.defaults=pretrained",
                "algorithm.beta=0.04",
                "training.max_steps=500",
                "logging.report=false",
                "rollout.num_generations=2",
                "training.save_steps=10",
            ]
        )
    )
    breaking, harmless = config_diff(old, new)
    assert breaking == ["algorithm.beta: 0.0 -> 0.04", "rollout.num_generations: 4 -> 2"]
    assert harmless == ["logging.report: true -> false", "training.max_steps: 100 -> 500", "training.save_steps: 0 -> 10"]
    assert config_diff(old, old) == ([], [])
    with pytest.raises(CheckpointError, match="algorithm.beta: 0.0 -> 0.04"):
        check_resume_compat(old, new, force=False, warn=lambda m: None)
    warnings = []
    check_resume_compat(old, new, force=True, warn=warnings.append)
    assert any("algorithm.beta" in w for w in warnings) and any("training.max_steps" in w for w in warnings)
    warnings.clear()
    check_resume_compat(old, to_dict(load_config(overrides=["model.defaults=pretrained", "training.device=cpu"])), warn=warnings.append)
    assert warnings == ["config changes since the checkpoint (harmless for resuming):\n  training.device: 'auto' -> 'cpu'"]


def test_config_diff_settings_newer_than_the_checkpoint():
    """A checkpoint written before a setting existed: absent there and at its default now is harmless;
    absent there and set to something else is not."""
    defaults = to_dict(load_config())
    old = to_dict(load_config())
    del old["rollout"]["sampling_seed"]
    breaking, harmless = config_diff(old, defaults, defaults)
    assert breaking == [] and harmless == ["rollout.sampling_seed: <absent> -> 'auto' (a setting newer than the checkpoint, at its default)"]
    changed = to_dict(load_config(overrides=["rollout.sampling_seed=prompt"]))
    breaking, _ = config_diff(old, changed, defaults)
    assert breaking == ["rollout.sampling_seed: <absent> -> 'prompt'"]
    assert config_diff(old, defaults)[0] == ["rollout.sampling_seed: <absent> -> 'auto'"]  # without defaults: breaking
    check_resume_compat(old, defaults, warn=lambda m: None, defaults=defaults)  # resumes without resume_force


def test_checkpoint_config_round_trips(tmp_path):
    model, opt, sched = make_run()
    cfg = to_dict(load_config())
    path = save_checkpoint(tmp_path, 1, save_model=saver(model), optimizer=opt, scheduler=sched, trainer_state={}, config=cfg)
    assert ckpt.read_checkpoint_config(path) == cfg
    from vlmrl.config import config_hash

    assert ckpt.read_trainer_state(path)["config_hash"] == config_hash(load_config())


def test_graceful_stop_sigterm_and_double_sigint():
    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
