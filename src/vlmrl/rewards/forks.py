"""User code (a reward, a tool) may fork: os.fork(), or a helper process started by hand. A child that leaves the user
function (returns, raises, calls sys.exit) would otherwise unwind through vlmrl's frames as a copy of the run: its
error reporting would print a fatal-sounding message, its cleanup would remove the run's lock while the parent still
trains, and a child that returns would train on beside the parent. The run's cleanup and messages belong to the
process that set them up: `leave_if_forked` ends such a child at the boundary, with os._exit (no unwinding, no atexit
handlers), with the exit code Python would have given it. (multiprocessing's fork start method ends its children with
os._exit itself.) Standard library only."""

from __future__ import annotations

import os
import sys
import traceback


def leave_if_forked(owner: int, what: str, outcome: BaseException | None = None) -> None:
    """In a process other than `owner` (the PID before user code `what` ran): end it now. `outcome`: what the user
    code raised (None: it returned). SystemExit keeps its code; any other exception is printed by the child as its
    own traceback and ends it with 1. Returns only in the owner."""
    if os.getpid() == owner:
        return
    code = 0
    if isinstance(outcome, SystemExit):
        if isinstance(outcome.code, int):
            code = outcome.code
        elif outcome.code is not None:  # sys.exit("message"): Python prints it and exits 1
            print(outcome.code, file=sys.stderr)
            code = 1
    elif outcome is not None:
        print(f"[process {os.getpid()} forked by {what}; the run goes on in process {owner}]", file=sys.stderr)
        traceback.print_exception(outcome)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream: nothing more to say
            pass
    os._exit(code)
