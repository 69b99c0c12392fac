"""Chat templates and data.prompt_template are programs (jinja) that come with a model folder or a config: one may loop
until killed (`{% for i in range(100000) %}{% for j in range(100000) %}`) or build a string of gigabytes
(`{{ 'x' * 2000000000 }}`). They render under a budget:

- `probe`: before the data is read (check, and train / sft / eval's start), the template renders on a synthetic
  conversation in a forked child whose address space is capped (RLIMIT_AS: RENDER_MEMORY_BYTES above the parent's)
  and which is killed after RENDER_TIME_S; a template that hangs, bloats or raises there is refused in one line
  naming its file. A fork copies nothing up front, and the cap holds the child only.
- `bounded`: every render in the run's own process (each row's prompt, tool turns, SFT targets) is stopped after
  RENDER_TIME_S (SIGALRM, main thread: jinja's loops are Python code, so the alarm interrupts them) and refused when
  its text passes RENDER_MAX_CHARS. A single huge allocation inside one render cannot be interrupted in-process: a
  template that bloats only on some rows is caught by the probe only when the synthetic conversation triggers it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import signal
import threading
import time
from typing import Any, Callable

from vlmrl.config import ConfigError
import weakref

RENDER_TIME_S = 10.0  # a real chat template renders in milliseconds
RENDER_MEMORY_BYTES = 1 << 30  # address space a probe render may add
RENDER_MAX_CHARS = 16 * 1024 * 1024  # characters of one rendered prompt (a 1M-token context is ~4M characters)


_SOURCES: dict[int, str] = {}  # id(processor) -> where its chat template came from (for messages only)


def remember_source(processor: Any, where: str) -> None:
    """Record where `processor`'s chat template came from (models.processing.load_processor), for template_source."""

    _SOURCES[id(processor)] = where
    try:
        weakref.finalize(processor, _SOURCES.pop, id(processor), None)
    except TypeError:  # not weak-referenceable: the entry stays (a name in a message, never a decision)
        pass


def template_source(processor: Any) -> str:
    """Where `processor`'s chat template came from: `the chat template in <folder>/chat_template.jinja`."""
    return _SOURCES.get(id(processor), "the model's chat template")


class TemplateBudgetError(ConfigError):
    """A template ran past the time or size budget (one line naming the template's file)."""


_active = threading.local()


@contextlib.contextmanager
def bounded(where: str, time_s: float | None = None):
    """Run a render inside: TemplateBudgetError after `time_s` (default RENDER_TIME_S; main thread only; elsewhere,
    and when an interval timer is already running, e.g. a reward's timeout, a no-op). `where` names the template."""
    time_s = RENDER_TIME_S if time_s is None else time_s
    if getattr(_active, "on", False) or threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def on_alarm(signum, frame):
        raise TemplateBudgetError(f"{where} ran longer than {time_s:g} s rendering one prompt; a chat template must not loop that long: fix it")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    _active.on = True
    signal.setitimer(signal.ITIMER_REAL, time_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _active.on = False


def checked_size(text: Any, where: str) -> Any:
    """`text` when it is not longer than RENDER_MAX_CHARS, else TemplateBudgetError."""
    if isinstance(text, str) and len(text) > RENDER_MAX_CHARS:
        raise TemplateBudgetError(f"{where} rendered {len(text):,} characters for one prompt (more than {RENDER_MAX_CHARS:,}): fix it")
    return text


def _address_space() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def probe(render: Callable[[], Any], where: str, time_s: float | None = None, memory_bytes: int = RENDER_MEMORY_BYTES) -> None:
    """Call `render` in a forked child capped at `memory_bytes` more address space and `time_s` seconds; raises
    TemplateBudgetError naming `where` when it hangs, runs out of its memory, or renders more than RENDER_MAX_CHARS.
    An exception `render` raises is re-raised here (a template error is reported where it always was)."""
    if not hasattr(os, "fork"):
        return
    time_s = RENDER_TIME_S if time_s is None else time_s
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, send back the outcome, end without unwinding the parent's frames
        os.close(read_end)
        code = 0
        try:
            base = _address_space()
            if base:
                resource.setrlimit(resource.RLIMIT_AS, (base + memory_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
            text = render()
            outcome = ("big", len(text)) if isinstance(text, str) and len(text) > RENDER_MAX_CHARS else ("ok", None)
        except MemoryError:
            outcome = ("memory", None)
        except BaseException as e:  # noqa: BLE001 - the template's error, handed to the parent
            try:
                outcome = ("error", pickle.dumps(e))
            except Exception:
                outcome = ("error", pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}")))
        try:
            os.write(write_end, pickle.dumps(outcome))
        except BaseException:  # noqa: BLE001 - the parent reads nothing and reports the child's end
            code = 1
        os._exit(code)
    os.close(write_end)
    try:
        outcome = _wait(pid, read_end, time_s)
    finally:
        os.close(read_end)
    _raise_for(outcome, where, time_s, memory_bytes)


def _wait(pid: int, fd: int, time_s: float) -> Any:
    """The child's pickled outcome, ("time", None) when it ran past `time_s` (then killed), ("died", status)."""
    deadline = time.monotonic() + time_s
    chunks = []
    os.set_blocking(fd, False)
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            chunk = None
        if chunk:
            chunks.append(chunk)
            continue
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            while chunk := _read_rest(fd):
                chunks.append(chunk)
            try:
                return pickle.loads(b"".join(chunks))
            except Exception:
                return ("died", status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return ("time", None)
        time.sleep(0.01)


def _read_rest(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""


def _raise_for(outcome: Any, where: str, time_s: float, memory_bytes: int) -> None:
    kind, value = outcome
    if kind == "ok":
        return
    if kind == "error":
        raise pickle.loads(value)
    if kind == "time":
        reason = f"ran longer than {time_s:g} s rendering one short prompt"
    elif kind == "memory":
        reason = f"needed more than {memory_bytes / 2**30:g} GiB of memory rendering one short prompt"
    elif kind == "big":
        reason = f"rendered {value:,} characters for one short prompt (more than {RENDER_MAX_CHARS:,})"
    else:
        reason = f"ended its render process (status {value})"
    raise TemplateBudgetError(f"{where} {reason}; a chat template must render a prompt in milliseconds: fix it")
