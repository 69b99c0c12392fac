"""Out-of-memory on one process of several: every process agrees on the new size (or, where a redo is impossible, all
stop with one message), so no process waits forever in a collective another one never reaches.

Tiers: the agreement loop against fake processes (threads with a barrier all-reduce, no torch.distributed); DDP's own
gradient averaging against `average_gradients` on two gloo processes; whole 2-process `vlmrl train` runs (gloo, an
OOM injected on one rank through VLMRL_INJECT_OOM) started without torchrun, so nothing but vlmrl ends a stuck process:
a hang fails the test by its timeout instead of blocking.
"""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from multiproc_runs import grpo_args, rendezvous_store, tiny_run_setup, worker_env
from safetensors.torch import load_file

import vlmrl.engine.oom as oom
from vlmrl.engine.oom import OutOfMemoryAbort, OutOfMemoryGaveUp, Peers, parse_injection, retry_on_oom


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
    assert "memory.scoring_micro_batch_size at most 2" in aborted[0]


def _fake_run(rank: int, sent: list, received=None):
    """Just what train.evaluate_run reads; `broadcast` records what this process sends and returns the main's value."""
    from types import SimpleNamespace

    dist = SimpleNamespace(sharded=False, is_main=rank == 0, world_size=2, broadcast=lambda obj: sent.append(obj) or (obj if rank == 0 else received))
    data, logger = SimpleNamespace(eval=[{}]), SimpleNamespace(info=print)
    return SimpleNamespace(dist=dist, model=None, processor=None, data=data, cfg=None, reward_funcs={}, device=None, logger=logger, backend=None)


def test_a_failed_evaluation_on_the_main_process_reaches_the_others(monkeypatch):
    """DDP: the main process evaluates alone while the others wait in a broadcast; if it fails (an OOM at size 1, a
    reward that raises) they must hear of it, not wait forever for metrics that never come."""
    import vlmrl.evaluate
    from vlmrl.train import EvaluationFailed, evaluate_run

    def fails(*args, **kwargs):
        raise OutOfMemoryGaveUp("out of memory in evaluation even at size 1")

    monkeypatch.setattr(vlmrl.evaluate, "evaluate", fails)
    sent0: list = []
    with pytest.raises(OutOfMemoryGaveUp):
        evaluate_run(_fake_run(0, sent0))
    assert sent0 == [(None, "OutOfMemoryGaveUp: out of memory in evaluation even at size 1")]  # sent before raising
    with pytest.raises(EvaluationFailed, match="evaluation on the main process failed: OutOfMemoryGaveUp"):
        evaluate_run(_fake_run(1, [], received=sent0[0]))
    monkeypatch.setattr(vlmrl.evaluate, "evaluate", lambda *a, **k: {"eval/reward": 1.0})
    assert evaluate_run(_fake_run(1, [], received=({"eval/reward": 1.0}, None))) == {"eval/reward": 1.0}


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


# ---------------------------------------------------------------- gradients synced after the agreement == DDP's own
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, use_b: bool):  # b: used on rank 0 only; c: never used
        y = self.a(x).tanh()
        return (y + self.b(x) if use_b else y).pow(2).sum()


def _ddp_worker(rank: int, world: int, port: int, queue) -> None:
    import contextlib
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vlmrl.engine.collectives import average_gradients

    os.environ.update(worker_env(rank, world, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = _Net()
    native = DDP(copy.deepcopy(net), find_unused_parameters=True, broadcast_buffers=False)
    deferred = DDP(copy.deepcopy(net), find_unused_parameters=True, broadcast_buffers=False)
    torch.manual_seed(1 + rank)
    xs = [torch.randn(3, 4) for _ in range(3)]
    for k, x in enumerate(xs):  # DDP's way: synced in the last micro-batch's backward (loss x W as Engine.backward does)
        with native.no_sync() if k < len(xs) - 1 else contextlib.nullcontext():
            (native(x, rank == 0) * world).backward()
    for x in xs:  # the deferred way: every micro-batch local, then average_gradients
        with deferred.no_sync():
            (deferred(x, rank == 0) * world).backward()
    average_gradients([p for p in deferred.parameters() if p.requires_grad], world)
    same = [
        (n, None if a.grad is None else a.grad.tolist(), None if b.grad is None else b.grad.tolist())
        for (n, a), b in zip(native.named_parameters(), deferred.parameters())
    ]
    queue.put((rank, same))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: the 1/W scale is not a power of two
def test_average_gradients_equals_ddp_on_gloo(world):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = rendezvous_store()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(r, world, store.port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, params in results.items():
        for name, native, deferred in params:
            assert native == deferred, (rank, name)  # bit for bit, None where DDP leaves None
        grads = {name: native for name, native, _ in params}
        assert grads["module.c.weight"] is None and grads["module.b.weight"] is not None  # unused everywhere / on one rank
    assert results[0] == results[world - 1]  # the same averaged gradients everywhere


# ---------------------------------------------------------------- whole 2-process runs (gloo), no torchrun
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_setup(tmp_path_factory, "oom-multiproc", n_test=4)


def _args(setup, out, *extra):
    # 8 prompts x G=2 per step (4 prompts, 8 rows per process); optimizer steps of 8 rows (4 per process) in
    # micro-batches of 4; 4 held-out rows evaluated at the end (main process).
    return grpo_args(setup, out, *extra, steps=1, micro_batch=4, generation_batch=16, completion_tokens=4, held_out=True)


# The same run configured at the sizes the injected OOMs lead to.
SMALL = (
    "training.per_device_train_batch_size=2",
    "training.gradient_accumulation_steps=4",
    "memory.generation_prompts_per_call=2",
    "memory.scoring_micro_batch_size=2",
    "training.eval_batch_size=2",
)


def _launch(setup, out, *extra, env: dict | None = None, world: int = 2, timeout: int = 150) -> list[tuple[int, str]]:
    """`vlmrl train` on `world` processes joined by a store this test hosts: no launcher ends a stuck process, so a
    hang is a timeout here. Returns [(exit code, output)] per rank."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", oom.INJECT_ENV)}
    base.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    store = rendezvous_store()
    logs = [out.parent / f"{out.name}.rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "w") as f:
            cmd = [sys.executable, "-m", "vlmrl", "train", *_args(setup, out, *extra)]
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**base, **worker_env(r, world, store.port)}))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a process was still running after {timeout} s (hang):\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


def _metrics(out, name="metrics.jsonl"):
    return [json.loads(x) for x in (out / name).read_text().splitlines()]


def _same_weights(a, b) -> bool:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def small(setup):
    out = setup[0] / "small"
    assert all(code == 0 for code, _ in _launch(setup, out, *SMALL))
    return out


def test_two_process_ddp_oom_on_one_rank_agrees_in_every_phase(setup, small):
    """Rank 1 runs out of memory in generation, scoring and the update (4 > 2), rank 0 in the final evaluation (the
    main process evaluates alone under DDP): the run finishes, both processes hold the same halved sizes, and it is the
    run configured at those sizes from the start, bit for bit."""
    out = setup[0] / "injected"
    inject = "rank=1,phase=rollout,above=2;rank=1,phase=scoring,above=2;rank=1,phase=update,above=2;rank=0,phase=eval,above=2"
    (code0, log0), (code1, log1) = _launch(setup, out, env={oom.INJECT_ENV: inject})
    assert code0 == 0 and code1 == 0, log0[-3000:] + log1[-3000:]
    for what in ("rollout", "scoring", "update"):
        line = f"out of memory in {what} at size 4 on process 1 of 2; redoing the same work at size 2 on every process"
        assert line in log0 and line in log1, what  # rank 0 (main, logged) and rank 1 (its own note) say the same
    assert "out of memory in evaluation at size 4; redoing the same work at size 2" in log0
    a, b = _metrics(out), _metrics(small)
    assert [r["micro_batch_size"] for r in a] == [2]  # equal on both processes (a disagreement would average)
    keys = ("reward", "loss", "kl", "grad_norm")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    (ea,), (eb,) = _metrics(out, "eval.jsonl"), _metrics(small, "eval.jsonl")
    assert {k: v for k, v in ea.items() if k != "time"} == {k: v for k, v in eb.items() if k != "time"}  # same greedy results
    assert _same_weights(out, small)
    saved = json.loads(sorted(out.glob("checkpoint-*/trainer_state.json"))[-1].read_text()) if list(out.glob("checkpoint-*")) else None
    assert saved is None or saved["sizes"] == {"generation": 2, "scoring": 2, "update": 2}


@pytest.mark.slow  # ~35-40 s here (two processes loading a model on a shared CPU); the DDP test above runs by default
def test_two_process_fsdp2_oom_on_one_rank_stops_every_process_with_one_message(setup):
    """FSDP2's forward and backward hold all-gathers / reduce-scatters: rank 0 is inside one when rank 1 runs out of
    memory before joining it, so no redo can line them up again. Both processes end with exit code 2 and the message
    (rank 0 through the store watcher, before rank 1 has even exited), instead of waiting forever."""
    out = setup[0] / "fsdp2"
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", oom.INJECT_ENV: "rank=1,phase=update,above=2"}
    (code0, log0), (code1, log1) = _launch(setup, out, "training.save_final_model=false", "data.eval_path=", env=env, timeout=120)
    message = "out of memory in update at size 4 on process 1 of 2: the engine's forward and backward hold collectives"
    assert code1 == 2 and f"vlmrl train: {message}" in log1 and "Traceback" not in log1, log1[-3000:]
    assert code0 == 2 and f"vlmrl train: {message}" in log0 and "(process 0 stops too)" in log0, log0[-3000:]
    assert "Traceback" not in log0


def test_a_resume_can_start_below_the_checkpoints_sizes():
    """After every process stopped on an OOM (FSDP2), the restart resumes from the last checkpoint: a generation /
    scoring size configured smaller then wins over the checkpoint's; otherwise the checkpoint's (shrunk) sizes stay."""
    from vlmrl.config import load_config
    from vlmrl.run.step_records import Sizes

    saved = {"generation": None, "scoring": 4, "update": 2}
    assert Sizes.initial(load_config(None, []), saved) == Sizes(None, 4, 2)
    smaller = load_config(None, ["memory.generation_prompts_per_call=2", "memory.scoring_micro_batch_size=2"])
    assert Sizes.initial(smaller, saved) == Sizes(2, 2, 2)
    larger = load_config(None, ["memory.generation_prompts_per_call=8", "memory.scoring_micro_batch_size=8"])
    assert Sizes.initial(larger, {"generation": 3, "scoring": 1, "update": 2}) == Sizes(3, 1, 2)
    assert Sizes.initial(load_config(None, []), {"train": 3}) == Sizes(None, 3, 3)  # old checkpoints: one shared size
