"""Out-of-memory recovery: redo the same work in smaller pieces instead of dying.

The trainer wraps each unit of work (a generation call, a scoring pass, one optimizer step's
accumulation, an evaluation batch) in `retry_on_oom`. On out-of-memory (`is_out_of_memory`) the partial work is discarded (the
caller's `on_oom` zeroes partial gradients), the piece size is halved, and the same data is redone.
Because an optimizer step's loss normaliser is computed from the whole step (losses.step_normaliser),
smaller micro-batches give the same effective batch and the same update.
"""

from __future__ import annotations

import gc
import re
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

# Test hook: phase -> largest piece (rows) that "fits". A larger piece raises a real torch.OutOfMemoryError
# before any work is done, as an allocator would. Empty in normal runs.
INJECT_OOM_ABOVE: dict[str, int] = {}
# Test hook: phase -> n: the n-th piece of that phase raises once (after earlier pieces did their work,
# e.g. a backward that left partial gradients).
INJECT_OOM_ON_CALL: dict[str, int] = {}
_calls: dict[str, int] = {}

KNOBS = (
    "model.gradient_checkpointing=true",
    "training.bf16=true (and model.dtype=bfloat16)",
    "model.use_lora=true",
    "rollout.max_completion_length",
    "data.max_pixels",
    "memory.ref_placement=cpu (with beta > 0)",
    "rollout.num_generations",
)


class OutOfMemoryGaveUp(RuntimeError):
    """Out of memory even at a piece size of 1."""


# What CUDA / ROCm allocators and libraries say when memory runs out but raise as a plain RuntimeError (cuBLAS handle
# creation, some kernels' workspaces): matched exactly, so other RuntimeErrors still surface.
_OOM_MESSAGE = re.compile(
    r"(CUDA|HIP|XPU) (error: )?out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|"
    r"CUSOLVER_STATUS_ALLOC_FAILED|MPS backend out of memory"
)


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, or a RuntimeError whose message is an allocator's / library's out-of-memory."""
    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError) and bool(_OOM_MESSAGE.search(str(error))))


def maybe_inject_oom(phase: str, rows: int) -> None:
    limit = INJECT_OOM_ABOVE.get(phase)
    if limit is not None and rows > limit:
        raise torch.OutOfMemoryError(f"injected OOM in {phase}: {rows} rows > {limit}")
    if phase in INJECT_OOM_ON_CALL:
        _calls[phase] = _calls.get(phase, 0) + 1
        if _calls[phase] == INJECT_OOM_ON_CALL[phase]:
            raise torch.OutOfMemoryError(f"injected OOM in {phase} on piece {_calls[phase]}")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def retry_on_oom(
    fn: Callable[[int], T], size: int, what: str, warn: Callable[[str], None], on_oom: Callable[[], None] | None = None, enabled: bool = True
) -> tuple[T, int]:
    """Run fn(size); on OOM halve size and run it again on the same data. Returns (result, size that worked)."""
    while True:
        try:
            return fn(size), size
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not enabled or not is_out_of_memory(e):
                raise
            if on_oom is not None:
                on_oom()
            free_memory()
            if size <= 1:
                raise OutOfMemoryGaveUp(f"out of memory in {what} even at size 1 ({e}). Settings that lower memory: " + "; ".join(KNOBS)) from e
            new = max(1, size // 2)
            warn(
                f"WARNING: out of memory in {what} at size {size}; redoing the same work at size {new} "
                "(effective batch unchanged). The smaller size is kept for the rest of the run."
            )
            size = new
