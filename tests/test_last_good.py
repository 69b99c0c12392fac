"""An exception in a step (a reward that raises, user code calling sys.exit) keeps the last good step: the checkpoint
of the step before is written even at save_steps=0, one line names the step and the phase, and the same command
again resumes from it to the uninterrupted run's weights. Time-based checkpoints (training.save_minutes)."""

import json

import pytest
import torch
from safetensors.torch import load_file

import vlmrl.train
from vlmrl.config import load_config
from vlmrl.run.last_good import StepFailed, save_due
from vlmrl.data.tasks import make_count_task
from vlmrl.train import train

from test_resume import overrides

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=12, n_test=0, seed=0, image_size=56)


@pytest.fixture(scope="module")
def straight(tiny_qwen25vl, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    train(load_config(None, overrides(tiny_qwen25vl, data, out)))
    return out


def _failing_at(step_to_fail: int, error: BaseException):
    real = vlmrl.train.reward_and_advantages

    def rewards(run, samples, step):
        if step == step_to_fail:
            raise error
        return real(run, samples, step)

    return rewards


@pytest.mark.parametrize("error", [ValueError("reward 'mine' cannot score row 3"), SystemExit(0)], ids=["reward-error", "sys-exit"])
def test_a_step_that_raises_keeps_the_step_before_and_resumes_exactly(tiny_qwen25vl, data, straight, tmp_path, monkeypatch, capsys, error):
    out = tmp_path / "run"
    cfg = load_config(None, overrides(tiny_qwen25vl, data, out))  # save_steps=0: no checkpoint would be written
    monkeypatch.setattr(vlmrl.train, "reward_and_advantages", _failing_at(3, error))
    lines: list[str] = []
    with pytest.raises(StepFailed if isinstance(error, SystemExit) else ValueError):
        train(cfg, log=lines.append)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ERROR: step 3 failed")]
    assert len(said) == 1 and "in phase rewards" in said[0] and "checkpoint-2 written" in said[0], said
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["samples_consumed"] == 2 * cfg.prompts_per_step
    monkeypatch.undo()
    train(cfg, log=lines.append)
    assert any("resumed from" in line and "checkpoint-2" in line for line in lines)
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_failure_in_step_one_has_nothing_to_keep(tiny_qwen25vl, data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setattr(vlmrl.train, "reward_and_advantages", _failing_at(1, KeyError("solution")))
    lines: list[str] = []
    with pytest.raises(KeyError):
        train(load_config(None, overrides(tiny_qwen25vl, data, out)), log=lines.append)
    said = capsys.readouterr().out
    assert "ERROR: step 1 failed in phase rewards" in said and "nothing was trained yet, nothing to keep" in said, said
    assert not list(out.glob("checkpoint-*"))


class _Training:
    save_steps, save_minutes = 0, 0.5


class _Dist:
    @staticmethod
    def broadcast(value):
        return value


def test_save_minutes_writes_a_checkpoint_once_that_long_has_passed():
    import time

    now = time.monotonic()
    assert not save_due(_Training, 5, False, False, now, _Dist)
    assert save_due(_Training, 5, False, False, now - 31, _Dist)
    assert not save_due(_Training, 5, True, False, now - 31, _Dist)  # the last step ends in the final model instead
    off = type("Off", (), {"save_steps": 0, "save_minutes": 0})
    assert not save_due(off, 5, False, False, now - 10_000, _Dist)
    assert save_due(off, 5, False, True, now, _Dist)  # a stop always checkpoints
