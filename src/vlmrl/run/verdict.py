"""The planner's verdict in `vlmrl check`: will the run fit the device it would use? Read from config.json only (no
weights load), in well under a second.

GPU run: the predicted per-device total (reserved peak + CUDA context) against the device's memory
(training.auto_fit_gpu_memory_gib, else the CUDA device's capacity). CPU run: the predicted host peak RSS of the
process against the host's memory (training.auto_fit_host_memory_gib, else this machine's RAM or its cgroup limit,
whichever is smaller). Both the GRPO step (`vlmrl train`) and the larger SFT stage (`vlmrl sft`) are planned; the
verdict is for the larger. A config the planner cannot read gives a "no verdict" line, never an error: the
planner is advice.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from vlmrl.plan.planner import GiB, Plan, _run_context, describe_data_shape, plan_for_config, sft_plans_for_config
from vlmrl.defaults import describe
from vlmrl.plan.planner import FIT_FRACTION
from vlmrl.run.rundir import describe_output_dir

CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclasses.dataclass
class Verdict:
    fits: bool | None  # None: no verdict (the planner could not plan this config, or no device size is known)
    line: str  # the one-line verdict
    summary: str  # the plan in one line: where the memory goes


def host_memory_bytes() -> int:
    """This machine's RAM, or the cgroup's memory limit when that is lower (containers, CI runners)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name in CGROUP_LIMITS:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _need(p: Plan, cpu: bool) -> int:
    return p.host["process_peak"] if cpu else p.total


def _summary(p: Plan, cpu: bool) -> str:
    terms = sorted(((k, v) for k, v in p.terms.items() if v and not (cpu and k == "cuda_context")), key=lambda kv: -kv[1])[:4]
    phases = ", ".join(f"{k} {v / GiB:.2f}" for k, v in p.phases.items())
    head = (
        f"plan: tensors {p.peak_allocated / GiB:.2f} GiB at the peak (largest: {', '.join(f'{k} {v / GiB:.2f}' for k, v in terms)}); "
        f"peak per phase {phases} GiB"
    )
    if cpu:
        return head + f"; runtime {p.workload['host_runtime_bytes'] / GiB:.2f} GiB (measured now). Every term: vlmrl plan --config ..."
    return head + f"; reserved {p.reserved / GiB:.2f} GiB, with the CUDA context {p.total / GiB:.2f} GiB. Every term: vlmrl plan --config ..."


def planner_verdict(cfg, data_shape: dict | None = None) -> Verdict:
    """The verdict for the device `cfg` would run on (see the module docstring). data_shape: Workload fields read from
    the training rows (planner.data_shape_of: images per prompt, video frames)."""

    try:
        cpu, gpu, extra = _run_context(cfg)
        if cpu:
            given = cfg.training.auto_fit_host_memory_gib
            extra["host_memory_bytes"] = int(given * GiB) if given else host_memory_bytes()
        extra.update(data_shape or {})
        plans = {"vlmrl train (GRPO step)": plan_for_config(cfg, gpu_memory_bytes=gpu, **extra)}
        plans.update({f"vlmrl sft (stage {k})": p for k, p in sft_plans_for_config(cfg, gpu, **extra).items()})
    except Exception as e:  # noqa: BLE001 - advice only: a model the planner cannot read must not fail the check
        return Verdict(None, f"planner: no verdict ({type(e).__name__}: {e})", "")
    what, worst = max(plans.items(), key=lambda kv: _need(kv[1], cpu))
    need = _need(worst, cpu)
    others = "; ".join(f"{k} {_need(p, cpu) / GiB:.2f} GiB" for k, p in plans.items() if k != what)
    if cpu:
        size = extra["host_memory_bytes"]
        where = "host memory (training.auto_fit_host_memory_gib)" if cfg.training.auto_fit_host_memory_gib else "host memory (this machine)"
        needed = f"predicted host peak RSS {need / GiB:.2f} GiB per process"
    elif gpu:
        size, where = gpu, "GPU memory"
        needed = f"predicted GPU total {need / GiB:.2f} GiB per device"
    else:
        return Verdict(None, f"planner: {what} needs {need / GiB:.2f} GiB per device; no verdict (no device size known)", _summary(worst, cpu))
    fits = need <= FIT_FRACTION * size
    state = "fits" if fits else "does NOT fit"
    line = f"planner: {state} on this {'CPU' if cpu else 'GPU'}: {needed} ({what}) of {size / GiB:.2f} GiB {where}"
    line += f", planned from the data ({describe_data_shape(data_shape)})" if data_shape else ""
    line += f"; {others}" if others else ""
    if not fits:
        line += ". Lower rollout.max_completion_length, the batch sizes or data.max_pixels, or let training.auto_fit=true pick a config"
    return Verdict(fits, line, _summary(worst, cpu))


def finish_check(cfg, log, data_shape: dict | None = None) -> int:
    """The end of `vlmrl check`, after every other check passed: what the run would do with output_dir, the
    planner's verdict and plan, and the last line. Exit status 0, or 1 when the planner predicts it does not fit."""

    log(describe(cfg))
    log(describe_output_dir(cfg))
    verdict = planner_verdict(cfg, data_shape)
    log(verdict.line)
    if verdict.summary:
        log(verdict.summary)
    if verdict.fits is False:
        log(f"vlmrl check: every check passed, but the run is predicted NOT to fit ({cfg.model.name_or_path})")
        return 1
    log(f"vlmrl check: OK ({cfg.model.name_or_path})")
    return 0
