"""The host allocator's mmap threshold, pinned for a training process (glibc only).

glibc serves an allocation at or above its mmap threshold (128 KiB at start) with its own mmap, returned to the
system on free. Each time such a chunk is freed the threshold rises to its size (up to 32 MiB), so from then on
torch's CPU tensors of a few MiB come from the brk heap instead; when their sizes change from step to step (GRPO
rollouts of varying length, multi-turn rows paused and resumed) the freed pieces do not fit the next step's tensors
and the heap, so the resident set, grows step after step. Measured on multi-turn GRPO of the tiny model on the CPU
(32 completions a step): bytes in use flat at 0.16 GiB while the heap's free bytes went 0.16 -> 0.31 GiB in 12 steps and
the peak RSS 0.57 -> 0.81 GiB in 20; pinned, the free bytes stay ~0.02 GiB and the peak ~0.64 GiB from step 3 on.
Setting the threshold through mallopt turns that rise off. Cost there: every tensor over 128 KiB gets fresh pages, the
update phase took 2.1-2.2 s a step instead of 1.2-1.4 s, so train.py pins it only for multi-turn runs (single-turn
runs of the same model stayed flat without it).

DeepSpeed ZeRO-3 runs are pinned too (train.py and sft.py, before any model loads): ZeRO-3 gathers each module's
parameters into fresh tensors before it runs and frees them after (rollout, every forward and backward), and the heap
kept those blocks. 2-process CPU GRPO of a 0.10 B-parameter model (benchmarks/results/planner_deepspeed_cpu_2026-11-27.md):
peak RSS 3.75-3.93 GiB unpinned, 2.80 pinned; the cost there: each gathered block is mapped and faulted in afresh,
a step took 24.9 s instead of 11.9 in one pinned/unpinned pair and 21.2 instead of 16.7 in another (loads 5.5-7.4 on
2 cores). On a GPU
the gathers are device memory (the caching allocator), so the pin changes little there. ZeRO-1/2 runs gather nothing
and are left to glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
DEFAULT_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value
# Any of these set in the environment is the user's choice (and already turned the adjustment off): left alone.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_settings() -> list[str]:
    """glibc malloc settings the environment makes (names): the user's, which win over the pin."""
    names = [k for k in _USER_SETTINGS if k in os.environ]
    return names + (["GLIBC_TUNABLES"] if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") else [])


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None
    except OSError:
        return None


def pin_mmap_threshold(size: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `size` bytes (no rise after frees); True when set. False (nothing done) off
    glibc (macOS, musl) or when the environment already sets glibc's malloc tunables (MALLOC_*_, GLIBC_TUNABLES)."""
    if user_settings():
        return False
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, int(size)) == 1)


def pin_for_run(reasons: list[str | None], log) -> bool:
    """pin_mmap_threshold when any of `reasons` (why this run needs it: multi-turn rollouts, ZeRO-3's gathers; None:
    not this one) is given, with one line in the run's log saying so, or that the environment's malloc settings were
    kept; True when pinned. No reasons: nothing done, nothing logged."""
    reasons = [r for r in reasons if r]
    if not reasons:
        return False
    why = " and ".join(reasons)
    if user_settings():
        log(f"host allocator: {why} would pin glibc's mmap threshold; the environment's {', '.join(user_settings())} kept instead")
        return False
    pinned = pin_mmap_threshold()
    if pinned:
        log(f"host allocator: glibc's mmap threshold pinned at {DEFAULT_MMAP_THRESHOLD // 1024} KiB for {why} (engine/host_alloc.py)")
    return pinned
