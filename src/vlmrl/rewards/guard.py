"""Running a reward under a guard: a time limit (algorithm.reward_timeout_s), a stop signal that abandons a hung reward
after a grace period, and SystemExit turned into a RewardError naming the reward."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from vlmrl.rewards.forks import leave_if_forked
from vlmrl.rewards.diagnostics import raised_at
from vlmrl.rewards.protocol import RewardFn


class RewardError(RuntimeError):
    """A reward function could not be loaded, raised, or returned something unusable."""


class RewardStopped(RewardError):
    """A reward ran past algorithm.reward_timeout_s, or a SIGTERM / SIGINT came while it ran: the reward is abandoned
    (never re-run sample by sample to locate anything)."""


# After a stop signal, how long a running reward may still take before it is abandoned (a second signal: at once).
STOP_GRACE_S = 30.0


@contextlib.contextmanager
def reward_guard(name: str, timeout_s: float, at: str = ""):
    """Runs reward `name` under _signal_guard; a process the reward forked that leaves it (returns, raises, exits)
    ends here (forks.leave_if_forked): the run's error messages and cleanup (its lock) stay the parent's."""
    owner = os.getpid()
    try:
        with _signal_guard(name, timeout_s, at):
            yield
    except BaseException as e:
        leave_if_forked(owner, f"reward {name!r}", e)
        raise
    leave_if_forked(owner, f"reward {name!r}")


@contextlib.contextmanager
def _signal_guard(name: str, timeout_s: float, at: str = ""):
    """While reward `name` runs in the main thread: SIGALRM after `timeout_s` (0: none) raises RewardStopped inside
    it. SIGTERM / SIGINT first reach the handler that was installed (the loop's GracefulStop records the stop, so a
    reward that returns lets the step finish and checkpoint as usual); a reward still running STOP_GRACE_S later,
    or a second signal, raises RewardStopped, so a hung reward never keeps the run from stopping. Elsewhere (a
    helper thread) a no-op: handlers can only be set in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stops: list[str] = []

    def on_alarm(signum, frame):
        if stops:
            raise RewardStopped(
                f"stopped by {stops[0]}: reward {name!r} was still running{at} {STOP_GRACE_S:g} s later and was abandoned; the step was not finished"
            )
        raise RewardStopped(
            f"reward {name!r} ran longer than algorithm.reward_timeout_s={timeout_s:g} s{at}; make it faster or return "
            "None for samples it cannot score in time, or raise algorithm.reward_timeout_s (0: no limit)"
        )

    def on_stop(signum, frame):
        before = previous.get(signum)
        if callable(before):
            before(signum, frame)  # GracefulStop: the stop is requested; default_int_handler: KeyboardInterrupt
        stops.append(signal.Signals(signum).name)
        if len(stops) > 1:
            raise RewardStopped(f"stopped by a second {stops[-1]} while reward {name!r} was running{at}; the step was not finished")
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        signal.setitimer(signal.ITIMER_REAL, min(remaining, STOP_GRACE_S) if remaining > 0 else STOP_GRACE_S)

    old_alarm = signal.signal(signal.SIGALRM, on_alarm)
    for s in previous:
        signal.signal(s, on_stop)
    if timeout_s > 0:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_error(name: str, e: SystemExit, fn: "RewardFn", at: str) -> RewardError:
    """A reward that called sys.exit() / exit(): an error of that reward, never the end of the run with its code."""
    return RewardError(
        f"reward {name!r} called sys.exit({e.code!r}){at}{raised_at(fn, e)}; a reward must return one value per completion "
        "(None for one it cannot score), not end the process"
    )
