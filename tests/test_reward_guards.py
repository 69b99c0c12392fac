"""A reward cannot end, hang or silently stop the run (issue 26 part 3, reward side): sys.exit() in a reward is an
error of that reward, algorithm.reward_timeout_s bounds each call, SIGTERM during a hung reward stops it, and a
reward that fails only on a batch names the step and the batch's rows."""

import os
import signal
import threading
import time

import pytest

from vlmrl.checkpoints.files import GracefulStop
from vlmrl.cli import main
from vlmrl.rewards.guard import RewardError, RewardStopped
from vlmrl.rewards.combine import compute_rewards
from vlmrl.rewards.loading import load_reward

USER_REWARDS = """import sys
import time


def exits(completions, **kwargs):
    sys.exit(0)  # a reward that runs the completion as a program, and the program exits


def calls_exit(completions, **kwargs):
    exit()


def hangs(completions, **kwargs):
    time.sleep(60)
    return [0.0] * len(completions)


def needs_two_rows(completions, solution, **kwargs):
    # fails on any batch holding solution "7" together with others: no single row fails alone
    if "7" in solution and len(solution) > 1:
        raise ValueError("cannot normalise this batch")
    return [1.0] * len(completions)


async def exits_async(completions, **kwargs):
    sys.exit(3)
"""


@pytest.fixture
def rewards(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return lambda name: load_reward(f"{path}:{name}")


def call(fn, n=2, **kw):
    cols = {"solution": [str(i + 6) for i in range(n)]}
    return compute_rewards({"r": fn}, {"r": 1.0}, ["p"] * n, ["c"] * n, cols, when="step 5", sources=[f"d.jsonl:{i + 1}" for i in range(n)], **kw)


@pytest.mark.parametrize("name, code", [("exits", "0"), ("calls_exit", "None"), ("exits_async", "3")])
def test_a_rewards_sys_exit_is_an_error_of_that_reward(rewards, name, code):
    with pytest.raises(RewardError, match=rf"reward 'r' called sys.exit\({code}\) at step 5 \(rows d.jsonl:1, d.jsonl:2\).*not end the process"):
        call(rewards(name))


def test_check_reports_a_rewards_sys_exit_instead_of_exiting_0(tmp_path, capsys):
    (tmp_path / "r.py").write_text(USER_REWARDS)
    code = main(
        [
            "check",
            f"training.output_dir={tmp_path / 'out'}",
            "data.task_train_size=4",
            "data.task_test_size=0",
            f"algorithm.reward_funcs=['{tmp_path / 'r.py'}:exits']",
        ]
    )
    assert code == 2
    assert "reward 'exits' called sys.exit(0)" in capsys.readouterr().err


def test_reward_timeout_is_a_clear_error(rewards):
    t0 = time.perf_counter()
    with pytest.raises(RewardStopped, match=r"reward 'r' ran longer than algorithm.reward_timeout_s=0.3 s at step 5"):
        call(rewards("hangs"), timeout_s=0.3)
    assert time.perf_counter() - t0 < 10  # not re-run sample by sample
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None) or not callable(signal.getsignal(signal.SIGALRM))


def test_sigterm_during_a_hung_reward_stops_it_and_records_the_stop(rewards, monkeypatch):
    import vlmrl.rewards.guard

    monkeypatch.setattr(vlmrl.rewards.guard, "STOP_GRACE_S", 0.5)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    with GracefulStop() as stop:
        timer.start()
        t0 = time.perf_counter()
        with pytest.raises(RewardStopped, match="stopped by SIGTERM: reward 'r' was still running at step 5 .* 0.5 s later and was abandoned"):
            call(rewards("hangs"))  # no timeout: only the signal ends it
        assert time.perf_counter() - t0 < 10 and stop.requested
        handler = signal.getsignal(signal.SIGTERM)
        # A second SIGTERM abandons the reward at once.
        timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGTERM)) for t in (0.2, 0.4)]
        monkeypatch.setattr(vlmrl.rewards.guard, "STOP_GRACE_S", 60)
        for t in timers:
            t.start()
        t0 = time.perf_counter()
        with pytest.raises(RewardStopped, match="stopped by a second SIGTERM while reward 'r' was running"):
            call(rewards("hangs"))
        assert time.perf_counter() - t0 < 10
    assert handler == stop._handle  # the guard gave the loop's handler back


def test_a_reward_that_returns_after_sigterm_lets_the_step_finish(rewards):
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))

    def slow(completions, **kwargs):
        time.sleep(0.5)
        return [1.0] * len(completions)

    with GracefulStop() as stop:
        timer.start()
        total, _ = call(slow)
        assert total == [1.0, 1.0] and stop.requested  # the loop then checkpoints after this step, as before


def test_a_batch_only_failure_names_the_step_and_rows(rewards):
    with pytest.raises(RewardError) as e:
        call(rewards("needs_two_rows"), n=3)
    msg = str(e.value)
    assert "raised on the batch of 3 at step 5 (rows d.jsonl:1, d.jsonl:2, d.jsonl:3) but on no single sample alone" in msg
    assert "ValueError: cannot normalise this batch" in msg
