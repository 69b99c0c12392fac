"""Kill-anywhere over the whole run, phase by phase: SIGKILL or SIGTERM delivered at a named moment of GRPO and SFT
(mid-step, mid-checkpoint, while the final model is written, as the final evaluation starts, before the report, before
the completion marker: checkpoints/faults.py), then the same command again until it exits 0. The result must be the uninterrupted
run: bit-identical final weights, each step logged once with the same values, one final evaluation, the completion
marker. SIGTERM is answered with exit 0 and one line (the step loop: a checkpoint; the ending: the rerun finishes it).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.config import load_config
from vlmrl.sft import sft
from vlmrl.data.tasks import make_count_task
from vlmrl.train import train

from test_resume import overrides

pytestmark = pytest.mark.slow  # two to three launches per case, ~10-60 s each here

POINTS = ["step@2", "checkpoint-save@2", "final-save", "final-eval", "report", "complete"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=12, n_test=4, seed=0, image_size=56)


def _args(kind, model, data, out):
    common = [f"data.eval_path={data['test']}", "training.save_steps=1", "training.eval_batch_size=2", "logging.report=true"]
    if kind == "train":
        return [*overrides(model, data, out, "training.max_steps=3"), *common]
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        f"training.output_dir={out}",
        "sft.projector_steps=1",
        "sft.steps=2",
        "sft.batch_size=4",
        "sft.learning_rate=1e-3",
        "rollout.max_completion_length=4",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "training.device=cpu",
        *common,
    ]


@pytest.fixture(scope="module")
def straight(tiny_qwen25vl, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    train(load_config(None, _args("train", tiny_qwen25vl, data, root / "train")))
    sft(load_config(None, _args("sft", tiny_qwen25vl, data, root / "sft")))
    return root


def _rows(path):
    skip = ("time/", "mem/", "plan/")
    return [{k: v for k, v in json.loads(x).items() if k != "time" and not k.startswith(skip)} for x in path.read_text().splitlines()]


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("kind", ["train", "sft"])
def test_a_signal_at_any_phase_loses_nothing(tiny_qwen25vl, data, straight, tmp_path, kind, point, signal_name):
    out = tmp_path / kind
    cmd = [sys.executable, "-m", "vlmrl", kind, *_args(kind, tiny_qwen25vl, data, out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, env={**env, "VLMRL_SIGNAL_AT": f"{point}:{signal_name}"}, timeout=600)
    if signal_name == "SIGKILL":
        assert first.returncode == -9, first.stderr[-3000:]
    else:  # the step finishes and a checkpoint is written, or the ending stops between phases: one line, exit 0
        assert first.returncode == 0, first.stderr[-3000:]
        said = first.stdout + first.stderr
        assert point in ("report", "complete") or "stopped by SIGTERM" in said, said[-3000:]
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    ref = straight / kind
    a, b = load_file(ref / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(out / "metrics.jsonl") == _rows(ref / "metrics.jsonl")
    assert _rows(out / "eval.jsonl") == _rows(ref / "eval.jsonl")  # the final evaluation once, with the same numbers
    assert (out / "run_complete.json").exists() and not (out / "run_ending.json").exists() and (out / "report.png").exists()
    assert not list(out.glob(".tmp-*"))
