"""Out-of-memory recovery: redo the same work in smaller pieces instead of dying.

The trainer wraps each unit of work (a generation call, a scoring pass, one optimizer step's
accumulation, an evaluation batch) in `retry_on_oom`. On out-of-memory (`is_out_of_memory`) the partial work is discarded (the
caller's `on_oom` zeroes partial gradients), the piece size is halved, and the same data is redone.
Because an optimizer step's loss normaliser is computed from the whole step (losses.step_normaliser),
smaller micro-batches give the same effective batch and the same update.

Several processes (`Peers`): every process attempts its own piece, then all of them settle the outcome with one
all-reduce (`Peers.who`), so an OOM on one process only makes every process halve to the same size and redo, and no
process waits in a collective another one never reaches. That is safe only where the attempt itself holds no
collective (one process; DDP, whose update syncs gradients after the agreement). Where forward and backward hold
collectives (FSDP2, DeepSpeed) a process that runs out of memory cannot redo alone: it stops every process with one
message instead (`Peers.can_redo` False, `Peers.abort`).
"""

from __future__ import annotations

import gc
import os
import re
from dataclasses import dataclass
from typing import Callable, NoReturn, TypeVar

import torch

T = TypeVar("T")

# Test hook: phase -> largest piece (rows) that "fits". A larger piece raises a real torch.OutOfMemoryError
# before any work is done, as an allocator would. Empty in normal runs.
INJECT_OOM_ABOVE: dict[str, int] = {}
# Test hook: phase -> n: the n-th piece of that phase raises once (after earlier pieces did their work,
# e.g. a backward that left partial gradients).
INJECT_OOM_ON_CALL: dict[str, int] = {}
_calls: dict[str, int] = {}
# The same hooks for processes a test launches (torchrun workers): `VLMRL_INJECT_OOM="rank=1,phase=update,above=2"`
# (several separated by ";"; `call=n` instead of `above=n`). Read only when the variable is set.
INJECT_ENV = "VLMRL_INJECT_OOM"

KNOBS = (
    "model.gradient_checkpointing=true",
    "training.bf16=true (and model.dtype=bfloat16)",
    "model.use_lora=true",
    "rollout.max_completion_length",
    "data.max_pixels",
    "memory.ref_placement=cpu (with beta > 0)",
    "rollout.num_generations",
)

# The setting behind each phase's starting size: what to lower when a multi-process run stops instead of halving.
SIZE_SETTINGS = {
    "rollout": "memory.generation_prompts_per_call",
    "scoring": "memory.scoring_micro_batch_size",
    # Not resume-harmless: a smaller update micro-batch needs a new output_dir (a resume keeps the checkpoint's).
    "update": "training.per_device_train_batch_size (gradient_accumulation_steps raised to keep the batch; in a new output_dir)",
    "evaluation": "training.eval_batch_size",
}


class OutOfMemoryGaveUp(RuntimeError):
    """Out of memory even at a piece size of 1."""


class OutOfMemoryAbort(OutOfMemoryGaveUp):
    """Out of memory in a multi-process run whose engine cannot redo one process's work alone (FSDP2, DeepSpeed)."""


@dataclass(frozen=True)
class Peers:
    """The processes an OOM is settled with (one process: `ALONE`).

    who(flag): the ranks whose flag is true, the same list on every process (one all-reduce; every process must call
    it once per attempt). can_redo: whether one process's failed attempt can be redone by all (no collective inside
    an attempt). abort(message): stop every process with `message`; raises on the caller. note(message): show a
    message on this process when `warn` (main process only) does not."""

    who: Callable[[bool], list[int]] = lambda flag: [0] if flag else []  # noqa: E731 - one process: itself or no one
    can_redo: bool = True
    abort: Callable[[str], NoReturn] | None = None
    note: Callable[[str], None] | None = None
    rank: int = 0
    world_size: int = 1


ALONE = Peers()


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, or a RuntimeError whose message is an allocator's / library's out-of-memory."""
    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError) and bool(_OOM_MESSAGE.search(str(error))))


# What CUDA / ROCm allocators and libraries say when memory runs out but raise as a plain RuntimeError (cuBLAS handle
# creation, some kernels' workspaces): matched exactly, so other RuntimeErrors still surface.
_OOM_MESSAGE = re.compile(
    r"(CUDA|HIP|XPU) (error: )?out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|"
    r"CUSOLVER_STATUS_ALLOC_FAILED|MPS backend out of memory"
)


def parse_injection(spec: str, rank: int) -> tuple[dict[str, int], dict[str, int]]:
    """`VLMRL_INJECT_OOM` for process `rank` -> (phase -> above, phase -> call). Specs without `rank=` apply to all."""
    above: dict[str, int] = {}
    on_call: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fields = dict(kv.split("=", 1) for kv in part.split(","))
        if int(fields.get("rank", rank)) != rank:
            continue
        if "above" in fields:
            above[fields["phase"]] = int(fields["above"])
        if "call" in fields:
            on_call[fields["phase"]] = int(fields["call"])
    return above, on_call


def _injected() -> tuple[dict[str, int], dict[str, int]]:
    spec = os.environ.get(INJECT_ENV)
    if not spec:
        return INJECT_OOM_ABOVE, INJECT_OOM_ON_CALL
    above, on_call = parse_injection(spec, int(os.environ.get("RANK", "0")))
    return {**INJECT_OOM_ABOVE, **above}, {**INJECT_OOM_ON_CALL, **on_call}


def maybe_inject_oom(phase: str, rows: int) -> None:
    above, on_call = _injected()
    limit = above.get(phase)
    if limit is not None and rows > limit:
        raise torch.OutOfMemoryError(f"injected OOM in {phase}: {rows} rows > {limit}")
    if phase in on_call:
        _calls[phase] = _calls.get(phase, 0) + 1
        if _calls[phase] == on_call[phase]:
            raise torch.OutOfMemoryError(f"injected OOM in {phase} on piece {_calls[phase]}")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _where(ranks: list[int], peers: Peers) -> str:
    if peers.world_size == 1:
        return ""
    return f" on process{'es' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {peers.world_size}"


def retry_on_oom(
    fn: Callable[[int], T],
    size: int,
    what: str,
    warn: Callable[[str], None],
    on_oom: Callable[[], None] | None = None,
    enabled: bool = True,
    peers: Peers = ALONE,
) -> tuple[T, int]:
    """Run fn(size); on OOM halve size and run it again on the same data. Returns (result, size that worked).

    With several processes every one of them calls this with the same size: each attempts, then all agree (`peers.who`)
    whether any ran out of memory; if one did, all discard their attempt (`on_oom`), halve and redo, so the sizes stay
    equal everywhere. `fn` must hold no collective (peers.can_redo), otherwise an OOM ends every process. Without
    recovery (`enabled` false) fn runs once and nothing is agreed: an OOM ends this process (the launcher the others)."""
    if not enabled:
        return fn(size), size
    while True:
        result, error = None, None
        try:
            result = fn(size)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(e):
                raise
            if not peers.can_redo:
                peers.abort(
                    f"out of memory in {what} at size {size}{_where([peers.rank], peers)}: the engine's forward "
                    "and backward hold collectives, so one process cannot redo its work alone; every process stops. "
                    f"Restart with {SIZE_SETTINGS.get(what, 'a smaller size')} at most {max(1, size // 2)}, or lower memory: "
                    f"{'; '.join(KNOBS)} ({e})"
                )
            error = e
        failed = peers.who(error is not None)  # every process gets here, whether its attempt ran out of memory or not
        if not failed:
            return result, size
        result = None
        if on_oom is not None:
            on_oom()
        if size <= 1:
            cause = str(error) if error is not None else f"process {failed[0]} ran out of memory"
            raise OutOfMemoryGaveUp(f"out of memory in {what} even at size 1 ({cause}). Settings that lower memory: " + "; ".join(KNOBS)) from error
        if error is not None:
            error.__traceback__ = None  # its frames hold the failed attempt's tensors
        error = None
        free_memory()
        new = max(1, size // 2)
        message = (
            f"WARNING: out of memory in {what} at size {size}{_where(failed, peers)}; redoing the same work at size {new} "
            f"{'on every process ' if peers.world_size > 1 else ''}(effective batch unchanged). The smaller size is kept for the rest of the run."
        )
        warn(message)
        if peers.note is not None:
            peers.note(message)
        size = new
