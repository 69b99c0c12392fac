"""No fault in a step loses more than that step: the last good step is checkpointed before the run ends.

A step that raises (a reward error, an image found bad only now, a KeyboardInterrupt, a SystemExit from user code)
has drawn its batch and moved the RNG streams, but until its first optimizer step it has not changed the weights. So
the loop takes a `StepStart` (sampler state, RNG streams, optimizer steps so far: cheap, nothing is copied off the
device) before each step; on an exception `kept_last_good` rewinds the sampler and RNG to it and writes the checkpoint
of the step before (unless one is on disk already), then says in one line which step failed, in which phase, why,
where the last good state is, and what to do. A SystemExit from a step becomes `StepFailed` (exit 1 with that line)
instead of ending the run with its exit code (0 for `sys.exit()`) and no word.

Not done, said in the line instead: with several processes (the others may be blocked inside a collective the failed
process will never join), or when the step had already taken an optimizer step (its weights are no longer the last
good ones), or on step 1 (nothing to keep).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from vlmrl.checkpoints.files import rng_state, set_rng_state
import time


class StepFailed(RuntimeError):
    """A step ended by SystemExit (user code called sys.exit / exit()); the message says where and what was kept."""


@dataclass
class StepStart:
    """What a step changes before its first optimizer step, as it was when the step began."""

    step: int
    sampler: dict
    rng: dict
    optimizer_steps: int  # the scheduler's count: unchanged while the weights are those of the step before

    @classmethod
    def take(cls, step: int, sampler, scheduler) -> "StepStart":

        return cls(step, copy.deepcopy(sampler.state_dict()), rng_state(), scheduler.last_epoch)

    def rewind(self, sampler) -> None:

        sampler.load_state_dict(copy.deepcopy(self.sampler))
        set_rng_state(self.rng)


@contextlib.contextmanager
def kept_last_good(
    step: int, sampler, scheduler, phase: Callable[[], str], save: Callable[[int], None], out: Path, world_size: int, log: Callable[[str], None]
):
    """Run one step; if it raises, checkpoint the step before (see the module docstring), log one line, re-raise
    (SystemExit as StepFailed). `phase()`: the phase the step was in; `save(step)`: writes checkpoint-<step>."""
    start = StepStart.take(step, sampler, scheduler)
    try:
        yield
    except BaseException as e:
        kept = keep(start, sampler, scheduler, save, out, world_size)
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        message = (
            f"ERROR: step {step} failed in {phase()} ({what}); {kept}. Fix the cause (the message names it) and run the same "
            "command again: it resumes from the newest checkpoint (training.resume=auto)"
        )
        log(message)
        if isinstance(e, SystemExit):
            raise StepFailed(message) from e
        raise


def keep(start: StepStart, sampler, scheduler, save: Callable[[int], None], out: Path, world_size: int) -> str:
    """Write checkpoint-<step - 1> if it can be and is not there; returns what was kept, for the error line."""
    good = start.step - 1
    if good < 1:
        return "nothing was trained yet, nothing to keep"
    if (out / f"checkpoint-{good}").is_dir():
        return f"checkpoint-{good} holds the last good step"
    if world_size > 1:
        return f"no checkpoint written (several processes: the others may be waiting in a collective); the newest checkpoint in {out} is intact"
    if scheduler.last_epoch != start.optimizer_steps:
        return f"no checkpoint written: step {start.step} had already changed the weights; the newest checkpoint in {out} is intact"
    start.rewind(sampler)
    try:
        save(good)
    except Exception as e:  # noqa: BLE001 - the original error is what the user must see; say this one too
        return f"writing checkpoint-{good} failed too ({type(e).__name__}: {e})"
    return f"checkpoint-{good} written: it holds the last good step"


def save_due(training, step: int, last: bool, preempted: bool, saved_at: float, dist) -> bool:
    """Whether the end of `step` writes a checkpoint: every training.save_steps steps and after the last; before a
    stop (signal); and when training.save_minutes have passed since the last one (the processes agree: the main
    process's clock decides), so that save_steps=0 still leaves something to resume."""
    if (training.save_steps and (step % training.save_steps == 0 or last)) or (preempted and not last):
        return True
    if not training.save_minutes or last:
        return False

    return bool(dist.broadcast(time.monotonic() - saved_at >= 60 * training.save_minutes))
