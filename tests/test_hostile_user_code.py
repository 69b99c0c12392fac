"""Issue 35, faults and hostile inputs: user code that forks (finding 14) or changes the working directory (16)
cannot take the run's lock, messages or folder with it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.data.tasks import make_count_task

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=4, seed=0, image_size=56)


def run_args(model, data, out, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        "data.eval_path=",
        f"training.output_dir={out}",
        "training.max_steps=2",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=4",
        "rollout.max_completion_length=3",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        *extra,
    ]


def vlmrl(args, cwd=None):
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "vlmrl", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------- 14: a reward's forked child
FORKING_REWARD = """import fcntl, json, os, sys

OUT, REPORT = {out!r}, {report!r}


def lock_state():
    try:
        fd = os.open(os.path.join(OUT, ".vlmrl-run.lock"), os.O_RDWR)
    except FileNotFoundError:
        return "missing"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "held"
    finally:
        os.close(fd)
    return "free"


def forking(completions, **kwargs):
    pid = os.fork()
    if pid == 0:  # the child: {mode}
        {child}
    _, status = os.waitpid(pid, 0)
    with open(REPORT, "a") as f:
        f.write(json.dumps({{"pid": os.getpid(), "child_status": os.waitstatus_to_exitcode(status), "lock": lock_state()}}) + "\\n")
    return [0.0] * len(completions)
"""

CHILD = {
    "exits": "sys.exit(0)",  # e.g. a helper process that is done
    "raises": "raise ValueError('the child failed')",
    "returns": "return [1.0] * len(completions)",  # falls through the reward as a copy of the trainer
}


@pytest.mark.parametrize("mode", sorted(CHILD))
def test_a_rewards_forked_child_leaves_the_lock_and_the_messages_to_the_run(tiny_qwen25vl, count_data, tmp_path, mode):
    out, report = tmp_path / "out", tmp_path / "report.jsonl"
    (tmp_path / "r.py").write_text(FORKING_REWARD.format(out=str(out), report=str(report), mode=mode, child=CHILD[mode]))
    done = vlmrl(["train", *run_args(tiny_qwen25vl, count_data, out, f"algorithm.reward_funcs=['{tmp_path / 'r.py'}:forking']")])
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    # Preflight calls the reward before the lock is taken; every call during training finds it held by the parent.
    assert {line["pid"] for line in lines} == {lines[0]["pid"]}, "a forked child went on running the run"
    assert all(line["lock"] == "held" for line in lines[1:]) and len(lines) >= 3, lines
    assert {line["child_status"] for line in lines} == {1 if mode == "raises" else 0}
    assert "vlmrl train:" not in done.stderr and "called sys.exit" not in done.stderr  # no fatal-sounding line from a child
    if mode == "raises":
        assert "ValueError: the child failed" in done.stderr and "the run goes on in process" in done.stderr
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (out / ".vlmrl-run.lock").exists()  # the parent removed it at its end


def test_the_lock_is_removed_only_by_the_process_that_took_it(tmp_path):
    from vlmrl.run.rundir import LOCK_FILE, RunLock

    lock = RunLock(tmp_path, log=lambda _: None)
    lock.acquire()
    pid = os.fork()
    if pid == 0:  # a copy of the run (forked by user code) that unwinds through the run's `with RunLock`
        lock.release()
        os._exit(0)
    os.waitpid(pid, 0)
    assert (tmp_path / LOCK_FILE).exists()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


# ---------------------------------------------------------------- 16: a reward that changes the working directory
CHDIR_REWARD = """import os

ELSEWHERE = {elsewhere!r}


def chdirs(completions, **kwargs):
    os.makedirs(ELSEWHERE, exist_ok=True)
    os.chdir(ELSEWHERE)  # e.g. a reward that runs a grader inside its own folder
    return [0.0] * len(completions)
"""


def test_relative_paths_stay_where_the_command_ran_when_a_reward_chdirs(tiny_qwen25vl, count_data, tmp_path):
    import shutil

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    shutil.copytree(os.path.dirname(count_data["train"]), work / "data")
    (work / "r.py").write_text(CHDIR_REWARD.format(elsewhere=str(elsewhere)))
    relative = {"train": "data/" + os.path.basename(count_data["train"])}
    extra = ["algorithm.reward_funcs=['r.py:chdirs']", "training.save_steps=1"]
    done = vlmrl(["train", *run_args(tiny_qwen25vl, relative, "out", *extra)], cwd=work)
    assert done.returncode == 0, done.stderr
    out = work / "out"
    assert (out / "final").is_dir() and (out / "config.yaml").is_file() and (out / "checkpoint-2").is_dir()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in elsewhere.iterdir()) == []  # nothing of the run followed the reward
    # the same command again, from the same folder, finds its finished run there
    again = vlmrl(["train", *run_args(tiny_qwen25vl, relative, "out", *extra)], cwd=work)
    assert again.returncode == 0 and f"the vlmrl train run in {out} is complete" in again.stderr, again.stderr
