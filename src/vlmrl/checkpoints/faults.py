"""Fault points for the kill-anywhere tests: a signal delivered at a named moment of a run, never by chance.

`VLMRL_SIGNAL_AT=<point>[@<n>]:<SIGNAL>` (e.g. `final-save:SIGKILL`, `checkpoint-save@2:SIGTERM`) makes this process
send itself that signal the n-th time (default first) it reaches `point`. Unset (always, outside tests) nothing happens.
Points: `step` (end of a step, before its checkpoint), `checkpoint-save` (a checkpoint written, not yet renamed into
place), `final-save` (the final model written, not yet renamed), `final-eval` (the final evaluation started), `report`
(before the report), `complete` (before the completion marker).
"""

from __future__ import annotations

import os
import signal

ENV = "VLMRL_SIGNAL_AT"
_seen: dict[str, int] = {}


def maybe_signal(point: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    where, _, name = spec.partition(":")
    wanted, _, nth = where.partition("@")
    if wanted != point:
        return
    _seen[point] = _seen.get(point, 0) + 1
    if _seen[point] == int(nth or 1):
        os.kill(os.getpid(), getattr(signal, name or "SIGKILL"))
