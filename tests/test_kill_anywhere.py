"""Fault test: SIGKILL the training process at random moments (saves included), resume each time, and check
that the final weights equal an uninterrupted run. Slow: run with `make test-slow`."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.config import load_config
from vlmrl.train import train

from test_resume import overrides

pytestmark = pytest.mark.slow
KILLS = int(os.environ.get("VLMRL_KILLS", "20"))


def test_sigkill_anywhere_then_resume_equals_uninterrupted(tiny_qwen25vl, tmp_path, tmp_path_factory):
    from vlmrl.data.tasks import make_count_task

    data = make_count_task(tmp_path_factory.mktemp("count"), n_train=12, n_test=0, seed=0, image_size=56)
    extra = [
        "training.max_steps=150",
        "training.save_steps=1",
        "training.save_total_limit=2",
        "algorithm.num_iterations=2",
        "training.per_device_train_batch_size=2",
        "training.gradient_accumulation_steps=2",
    ]
    straight = tmp_path / "straight"
    train(load_config(None, overrides(tiny_qwen25vl, data, straight, *extra)))

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "vlmrl", "train", *overrides(tiny_qwen25vl, data, out, *extra)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    rng = random.Random(1234)
    kills, finished, log, during_saves = 0, False, [], 0
    stderr = tmp_path / "stderr.txt"
    while kills < KILLS:
        tmp_before = {(p.name, p.stat().st_mtime_ns) for p in out.glob(".tmp-checkpoint-*")} if out.exists() else set()
        with stderr.open("w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        delay = rng.uniform(4.5, 9.0)  # start-up takes ~4-6 s here: these kills land in steps, saves or start-up
        try:
            if kills % 2:  # every other kill aims at a save: SIGKILL as soon as a new .tmp checkpoint folder appears
                t0 = time.time()
                while proc.poll() is None and time.time() - t0 < 60:
                    if any((p.name, p.stat().st_mtime_ns) not in tmp_before for p in out.glob(".tmp-checkpoint-*")):
                        raise subprocess.TimeoutExpired(cmd, 0)
                    time.sleep(0.001)
            assert proc.wait(timeout=delay) == 0, stderr.read_text()[-3000:]
            finished = True  # the run completed before this kill
            break
        except (subprocess.TimeoutExpired, FileNotFoundError):  # FileNotFoundError: the .tmp folder was renamed meanwhile
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
            done = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) if out.exists() else []
            # Killed while writing a checkpoint: a .tmp folder this attempt created is left behind.
            mid_save = out.exists() and any((p.name, p.stat().st_mtime_ns) not in tmp_before for p in out.glob(".tmp-checkpoint-*"))
            during_saves += mid_save
            log.append((round(delay, 2), done[-1] if done else None, "mid-save" if mid_save else ""))
    if not finished:
        subprocess.run(
            cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, timeout=3600
        )  # the uninterrupted finish: minutes on a loaded 2-core machine
    print(f"{kills} SIGKILLs, {during_saves} of them while a checkpoint was being written (delay s, newest checkpoint after kill, mid-save): {log}")
    assert kills >= min(KILLS, 20) or finished

    a, b = load_file(straight / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A step logged and then killed before its checkpoint is re-run on resume: both lines must agree.
    by_step: dict[int, set] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], set()).add((row["loss"], row["reward"]))
    assert sorted(by_step) == list(range(1, 151))
    assert all(len(v) == 1 for v in by_step.values()), {k: v for k, v in by_step.items() if len(v) > 1}
    straight_rows = {
        json.loads(x)["step"]: (json.loads(x)["loss"], json.loads(x)["reward"]) for x in (straight / "metrics.jsonl").read_text().splitlines()
    }
    assert {k: next(iter(v)) for k, v in by_step.items()} == straight_rows
