"""Stopping every process of a multi-process run together, when one process cannot go on while the others may be
blocked inside a collective it will never join (an FSDP2 all-gather of a forward it left after running out of memory).

The failing process writes its message into the run's rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT that
torchrun's agent, or rank 0, hosts) and waits a few seconds at most until the others have seen it, then raises; every
other process runs a watcher thread (`watch_for_abort`) that polls the store, prints the message on stderr and exits
with code 2 (os._exit: its main thread may be blocked in a collective that never returns). Without the store (it is
gone or unreachable) the launcher is left to end the others, as it does when any process exits.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import NoReturn
import atexit

POLL_S = 0.5  # how often a watcher looks
ACK_WAIT_S = 10.0  # how long the failing process waits for the others to have seen its message
EXIT_CODE = 2

_aborting = threading.Event()  # this process posted the message: its own watcher must not exit before it raises


def _keys() -> tuple[str, str]:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted group must not see an old message
    return f"vlmrl/abort/{attempt}", f"vlmrl/abort_seen/{attempt}"


def _store():
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)


def abort_everyone(message: str, world_size: int, error_type: type[BaseException]) -> NoReturn:
    """Tell every other process to stop with `message` (which names the process), wait (at most ACK_WAIT_S) until they have seen it, then raise
    error_type(message) here."""
    _aborting.set()
    key, seen = _keys()
    try:
        store = _store()
        store.set(key, message)
        deadline = time.monotonic() + ACK_WAIT_S
        while store.add(seen, 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - no store: the launcher ends the others once this process exits
        pass
    raise error_type(message)


def watch_for_abort(rank: int) -> threading.Thread:
    """A daemon thread that ends this process (exit code 2, the message on stderr) once another process has called
    `abort_everyone`; it stops watching quietly when the store goes away (the run is ending), and at interpreter exit
    (atexit): a thread left inside the store's C++ client while Python shuts down aborts the process
    ("terminate called without an active exception", exit -6) after a run that finished."""

    stop = threading.Event()

    def watch() -> None:
        key, seen = _keys()
        try:
            store = _store()
            while not store.check([key]):
                if stop.wait(POLL_S):
                    del store  # closed here, in this thread, while the interpreter is still whole
                    return
            if _aborting.is_set():
                return
            message = store.get(key).decode()
            store.add(seen, 1)
        except Exception:  # noqa: BLE001 - the store is gone: nothing to watch
            return
        sys.stdout.flush()
        print(f"vlmrl train: {message} (process {rank} stops too)", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    thread = threading.Thread(target=watch, name="vlmrl-abort-watch", daemon=True)
    thread.start()

    def stop_watching() -> None:
        stop.set()
        thread.join(timeout=5 * POLL_S)

    atexit.register(stop_watching)
    return thread
