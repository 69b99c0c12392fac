"""Cheap per-step memory readings for the metrics log.

Everything here is called once per training step (or per phase of a step), so it reads counters only:
the process RSS, torch's CUDA allocator peaks and, when ``pynvml`` is importable, the NVML utilization
sample. Nothing allocates, synchronizes the device or walks the heap. The module imports without CUDA
and without pynvml; the GPU keys are simply absent when they cannot be read.

All sizes are GiB (floats) so the numbers in ``metrics.jsonl`` are directly readable.

Typical use::

    reset_peaks()                        # start of a step
    with phase_memory("rollout") as m:   # optional: peaks of one phase (or phase_memory("rollout", metrics))
        ...
    metrics = {**memory_stats(), **m}    # keys "mem/..." and "mem/rollout/..."
"""

from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import psutil
import torch

GiB = GIB = float(1 << 30)

# psutil.Process caches the pid and the /proc handle; building one per call would be wasted work.
_PROCESS = psutil.Process()

# The CUDA allocator has a single peak counter. A phase resets it to measure itself, which would lose
# the peak reached earlier in the same step, so the step peak seen so far is carried here across phase
# resets and folded back in by `memory_stats`. `reset_peaks` clears it at the start of each step.
_step_peak_allocated = 0
_step_peak_reserved = 0

# NVML state: None = not tried yet, False = unavailable (never retried: a failing import or init is not
# going to start working mid-run, and retrying every step would cost time), otherwise (pynvml, handle).
_nvml = None
_capacity: float | None = None


def _cuda() -> bool:
    # is_available() is cached by torch after the first call, so this is cheap; is_initialized() avoids
    # creating a CUDA context just to read counters in a process that never used the GPU.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def reset_peaks() -> None:
    """Start a new peak window (call at the start of each step); a no-op without CUDA.

    The host peak is not reset: Linux only exposes the process-lifetime peak RSS via getrusage.
    """
    global _step_peak_allocated, _step_peak_reserved
    _step_peak_allocated = _step_peak_reserved = 0
    if _cuda():
        torch.cuda.reset_peak_memory_stats()


def host_rss() -> float:
    """Current resident set size of this process, GiB."""
    return _PROCESS.memory_info().rss / GiB


def host_peak_rss() -> float:
    """Lifetime peak resident set size of this process, GiB. On Linux VmHWM of /proc/self/status: ru_maxrss
    carries over the parent's size into a process started by fork/vfork + exec (a child of a 2 GiB process
    reports at least 2 GiB), VmHWM belongs to this process's own address space. Elsewhere ru_maxrss (KiB on
    Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak if sys.platform == "darwin" else peak * 1024) / GiB


def _gpu_utilization() -> float | None:
    """Percent of the last NVML sample period in which a kernel ran, or None when NVML is unavailable."""
    global _nvml
    if _nvml is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                # torch maps the CUDA index to the NVML index (they differ under CUDA_VISIBLE_DEVICES).
                index = torch.cuda._get_nvml_device_index(None)
            except Exception:
                index = torch.cuda.current_device()
            _nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
        except Exception:
            _nvml = False
    if not _nvml:
        return None
    pynvml, handle = _nvml
    try:
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:
        return None


def memory_stats() -> dict[str, float]:
    """Memory readings in GiB: ``mem/host_rss``, ``mem/host_peak_rss`` (process lifetime peak), and with
    CUDA ``mem/gpu_peak_allocated``, ``mem/gpu_peak_reserved`` (since the last `reset_peaks`),
    ``mem/gpu_capacity`` and, when pynvml is importable, ``gpu/utilization`` (percent)."""
    global _capacity
    stats = {"mem/host_rss": host_rss(), "mem/host_peak_rss": host_peak_rss()}
    if _cuda():
        stats["mem/gpu_peak_allocated"] = max(_step_peak_allocated, torch.cuda.max_memory_allocated()) / GiB
        stats["mem/gpu_peak_reserved"] = max(_step_peak_reserved, torch.cuda.max_memory_reserved()) / GiB
        if _capacity is None:  # constant for the run; the properties call is not free
            _capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB
        stats["mem/gpu_capacity"] = _capacity
        util = _gpu_utilization()
        if util is not None:
            stats["gpu/utilization"] = util
    return stats


@contextmanager
def phase_memory(name: str, into: dict | None = None) -> Iterator[dict[str, float]]:
    """Measure one phase of a step. Yields a dict that is filled on exit with
    ``mem/<name>/gpu_peak_allocated`` and ``mem/<name>/gpu_peak_reserved`` (peaks inside the phase) with
    CUDA, and ``mem/<name>/host_rss`` (RSS at the end of the phase) always; `into`, when given, is
    updated with the same keys (handy for a metrics dict being built).

    The step-level peak reported by `memory_stats` is preserved across the reset this does.
    """
    global _step_peak_allocated, _step_peak_reserved
    result: dict[str, float] = {}
    cuda = _cuda()
    if cuda:
        # Bank the step peak so far before resetting the counter for this phase.
        _step_peak_allocated = max(_step_peak_allocated, torch.cuda.max_memory_allocated())
        _step_peak_reserved = max(_step_peak_reserved, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
    try:
        yield result
    finally:
        if cuda:
            peak_alloc, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            _step_peak_allocated = max(_step_peak_allocated, peak_alloc)
            _step_peak_reserved = max(_step_peak_reserved, peak_reserved)
            result[f"mem/{name}/gpu_peak_allocated"] = peak_alloc / GiB
            result[f"mem/{name}/gpu_peak_reserved"] = peak_reserved / GiB
        result[f"mem/{name}/host_rss"] = host_rss()
        if into is not None:
            into.update(result)


# The brief names a `PhaseMemory` helper; `phase_memory` is it, under both spellings.
PhaseMemory = phase_memory


def warn_if_near_capacity(metrics: dict, fraction: float, warn) -> None:
    peak, capacity = metrics.get("mem/gpu_peak_reserved"), metrics.get("mem/gpu_capacity")
    if peak is not None and capacity and peak > fraction * capacity:
        warn(
            f"WARNING: GPU peak {peak:.1f} GiB is above {fraction:.0%} of {capacity:.1f} GiB (memory.warn_fraction); "
            "an OOM is close: consider gradient checkpointing, bf16, or a smaller micro-batch"
        )


@contextmanager
def timed_phase(name: str, into: dict) -> Iterator[None]:
    """Time and memory of one phase of a step: time/<name> and mem/<name>/* in `into`."""
    start = time.perf_counter()
    with phase_memory(name, into):
        yield
    into[f"time/{name}"] = time.perf_counter() - start
