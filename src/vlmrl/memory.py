"""Memory statistics, cheap enough to read every step: host RSS (psutil / getrusage) and CUDA peaks."""

from __future__ import annotations

import contextlib
import resource

import torch

GIB = 1024**3


def reset_peaks() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def host_rss() -> float:
    import psutil

    return psutil.Process().memory_info().rss / GIB


def host_peak_rss() -> float:
    """Lifetime peak RSS of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def memory_stats() -> dict[str, float]:
    """`mem/*` in GiB; GPU peaks are since the last reset_peaks(). `gpu/utilization` when NVML is there."""
    out = {"mem/host_rss": host_rss(), "mem/host_peak_rss": host_peak_rss()}
    if torch.cuda.is_available():
        dev = torch.cuda.current_device()
        out["mem/gpu_peak_allocated"] = torch.cuda.max_memory_allocated(dev) / GIB
        out["mem/gpu_peak_reserved"] = torch.cuda.max_memory_reserved(dev) / GIB
        out["mem/gpu_capacity"] = torch.cuda.get_device_properties(dev).total_memory / GIB
        with contextlib.suppress(Exception):  # NVML is optional
            out["gpu/utilization"] = float(torch.cuda.utilization(dev))
    return out


@contextlib.contextmanager
def phase_memory(name: str, into: dict):
    """Record the peaks of one phase (rollout, scoring, update) as `mem/<name>/...` in `into`."""
    reset_peaks()
    yield
    if torch.cuda.is_available():
        into[f"mem/{name}/gpu_peak_allocated"] = torch.cuda.max_memory_allocated() / GIB
        into[f"mem/{name}/gpu_peak_reserved"] = torch.cuda.max_memory_reserved() / GIB
    into[f"mem/{name}/host_rss"] = host_rss()
