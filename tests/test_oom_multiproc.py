"""Out-of-memory on one process of several: every process agrees on the new size (or, where a redo is impossible, all
stop with one message), so no process waits forever in a collective another one never reaches.

Tiers: the agreement loop against fake processes (threads with a barrier all-reduce, no torch.distributed); DDP's own
gradient averaging against `average_gradients` on two gloo processes; whole 2-process `vlmrl train` runs (gloo, an
OOM injected on one rank through VLMRL_INJECT_OOM) started without torchrun, so nothing but vlmrl ends a stuck process:
a hang fails the test by its timeout instead of blocking.
"""

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from vlmrl import oom
from vlmrl.oom import OutOfMemoryAbort, OutOfMemoryGaveUp, Peers, parse_injection, retry_on_oom
from vlmrl.tasks import make_count_task

LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"


# ---------------------------------------------------------------- the agreement loop, fake processes
class FakeGroup:
    """W threads standing for processes: `who` is an all-reduce (every thread must call it; all get the same list)."""

    def __init__(self, world: int):
        self.world, self.flags = world, [False] * world
        self.barrier = threading.Barrier(world, timeout=10)

    def peers(self, rank: int, notes: list) -> Peers:
        def who(flag: bool) -> list[int]:
            self.flags[rank] = flag
            self.barrier.wait()
            out = [r for r, f in enumerate(self.flags) if f]
            self.barrier.wait()  # nobody overwrites a flag before everyone has read them
            return out

        return Peers(who=who, note=notes.append, rank=rank, world_size=self.world)


def _run_ranks(world: int, attempt, peers_for, start: int = 8):
    """retry_on_oom on `world` threads; attempt(rank, size) is each one's work. Returns {rank: (size, calls, zeroed, error)}."""
    out = {}

    def one(rank: int) -> None:
        calls, zeroed = [], []

        def fn(size: int) -> int:
            calls.append(size)
            attempt(rank, size)
            return size

        try:
            _, size = retry_on_oom(fn, start, "update", lambda m: None, on_oom=lambda: zeroed.append(1), peers=peers_for(rank))
            out[rank] = (size, calls, len(zeroed), None)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[rank] = (None, calls, len(zeroed), e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a process is still waiting"
    return out


def _oom_above(limit: int, on_rank: int):
    def attempt(rank: int, size: int) -> None:
        if rank == on_rank and size > limit:
            raise torch.OutOfMemoryError(f"fake OOM at {size}")

    return attempt


def test_an_oom_on_one_process_halves_every_process_to_the_same_size():
    group, notes = FakeGroup(3), {r: [] for r in range(3)}
    out = _run_ranks(3, _oom_above(2, on_rank=1), lambda r: group.peers(r, notes[r]))
    for rank in range(3):
        size, calls, zeroed, error = out[rank]
        assert error is None and size == 2 and calls == [8, 4, 2]  # processes without an OOM redo too
        assert zeroed == 2  # and drop their partial work (gradients) each time
        assert "on process 1 of 3" in notes[rank][0] and "at size 4 on every process" in notes[rank][0]


def test_without_agreement_the_sizes_drift_apart():
    """What the agreement prevents: each process alone keeps its own size (DDP would then wait in a collective)."""
    out = _run_ranks(2, _oom_above(2, on_rank=1), lambda r: oom.ALONE)
    assert out[0][0] == 8 and out[1][0] == 2


def test_an_oom_at_size_one_on_one_process_stops_every_process():
    group = FakeGroup(2)
    out = _run_ranks(2, _oom_above(0, on_rank=1), lambda r: group.peers(r, []), start=2)
    for rank in range(2):
        assert isinstance(out[rank][3], OutOfMemoryGaveUp) and "even at size 1" in str(out[rank][3])
    assert "process 1 ran out of memory" in str(out[0][3])


def test_an_engine_that_cannot_redo_aborts_instead_of_halving():
    aborted = []

    def abort(message):
        aborted.append(message)
        raise OutOfMemoryAbort(message)

    peers = Peers(who=lambda flag: pytest.fail("no agreement when a redo is impossible"), can_redo=False, abort=abort, rank=1, world_size=2)
    with pytest.raises(OutOfMemoryAbort, match="on process 1 of 2"):
        retry_on_oom(lambda s: _oom_above(0, 0)(0, s), 4, "scoring", print, peers=peers)
    assert len(aborted) == 1 and "every process stops" in aborted[0] and "gradient_checkpointing" in aborted[0]


def test_other_errors_are_not_agreed_on():
    def fn(size):
        raise ValueError("not memory")

    with pytest.raises(ValueError):
        retry_on_oom(fn, 4, "update", print, peers=Peers(who=lambda f: pytest.fail("agreement on a non-OOM error")))


def test_injection_spec_for_launched_processes():
    spec = "rank=1,phase=update,above=2; rank=0,phase=eval,above=1;phase=scoring,call=3"
    assert parse_injection(spec, 1) == ({"update": 2}, {"scoring": 3})
    assert parse_injection(spec, 0) == ({"eval": 1}, {"scoring": 3})


def test_injection_from_the_environment_follows_rank(monkeypatch):
    monkeypatch.setenv(oom.INJECT_ENV, "rank=1,phase=update,above=2")
    monkeypatch.setenv("RANK", "0")
    oom.maybe_inject_oom("update", 4)  # not this rank
    monkeypatch.setenv("RANK", "1")
    oom.maybe_inject_oom("update", 2)
    with pytest.raises(torch.OutOfMemoryError, match="injected OOM in update: 4 rows > 2"):
        oom.maybe_inject_oom("update", 4)
