"""The memory planner at run time (train.py, sft.py): auto_fit applied and logged, the prediction for the run about
to start (on a CPU run its peak RSS), the data shape read from the rows, and the prediction against what each step
measured (plan/* metrics, a warning on a large miss)."""

from __future__ import annotations

from vlmrl.plan.config import device_memory_bytes, plan_for_config, sft_plans_for_config
from vlmrl.plan.estimate import Plan
from vlmrl.plan.host import HOST_RUNTIME_CPU_BYTES
from vlmrl.plan.search import auto_fit
from vlmrl.plan.spec import GiB, PlanError, Workload

PREDICTION_WARN_FRACTION = 0.25  # a measured GPU peak this far from the prediction is worth a warning


def apply_auto_fit(cfg, log, world_size: int = 1, sharding: str | None = None, deepspeed: dict | None = None):
    """training.auto_fit: the config the planner picks (under the DeepSpeed config in use, if any), every change
    logged. PlanError when nothing fits."""
    new_cfg, changes = auto_fit(cfg, world_size=world_size, sharding=sharding, deepspeed=deepspeed)
    for line in changes or ["auto_fit: the configuration as given is predicted to fit and to be the fastest; nothing changed"]:
        log(line if line.startswith("auto_fit") else f"auto_fit: {line}")
    return new_cfg


def runs_on_cpu(cfg) -> bool:
    """training.device is cpu, or auto on a machine without CUDA."""
    dev = cfg.training.device
    if dev == "cpu":
        return True
    if dev != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def _run_context(cfg, world_size: int = 1) -> tuple[bool, int | None, dict]:
    """(cpu, gpu bytes, workload extras) of the run about to start: on CPU the runtime RSS measured now."""
    cpu = runs_on_cpu(cfg)
    gpu = None
    if not cpu:
        try:
            gpu = device_memory_bytes(cfg)
        except PlanError:
            gpu = None
    extra: dict = {}
    if cpu:
        from vlmrl.engine.memory import host_rss

        # libraries imported later in the run (the model family, tokenizer, data) count from the start
        extra.update(device="cpu", host_runtime_bytes=max(int(host_rss() * GiB), HOST_RUNTIME_CPU_BYTES))
    return cpu, gpu, extra


def _log_prediction(p: Plan, log, what: str = "") -> None:
    if p.workload.get("device") == "cpu":
        log(
            f"planner: {what}CPU run, predicted host peak RSS {p.host['process_peak'] / GiB:.2f} GiB per process "
            f"(tensors {p.peak_allocated / GiB:.2f} GiB, runtime now {p.workload['host_runtime_bytes'] / GiB:.2f} GiB)"
            + (f"; {p.verdict}" if p.workload.get("host_memory_bytes") else "")
        )
    else:
        log(
            f"planner: {what}predicted per-device GPU peak {p.peak_allocated / GiB:.2f} GiB allocated, "
            f"{p.reserved / GiB:.2f} GiB reserved" + (f" ({p.verdict})" if p.gpu_memory_bytes else "")
        )


def predict_for_run(
    cfg, log, world_size: int = 1, sharding: str | None = None, what: str = "", deepspeed: dict | None = None, **data_shape
) -> Plan | None:
    """The planner's prediction for this run, logged once; None (with the reason) when the model cannot be
    planned. Never stops a run: the prediction is advice. `sharding`: the engine's (ddp, fsdp, zero2, zero3);
    `deepspeed`: its DeepSpeed config (ZeRO's buffers are planned from it).
    `data_shape`: Workload fields read from the data (images_per_prompt, video_frames: `data_shape_of`).
    On a CPU run every tensor lives in host RAM: the prediction is this process's peak RSS, from the RSS it has
    now (libraries loaded, measured) plus the planned tensors, loading and buffers (Plan.host["process_peak"])."""
    try:
        _, gpu, extra = _run_context(cfg, world_size)
        if sharding and world_size > 1:
            extra["sharding"] = sharding
        ds = deepspeed if extra.get("sharding") in ("zero1", "zero2", "zero3") else None
        p = plan_for_config(cfg, world_size=world_size, gpu_memory_bytes=gpu, deepspeed=ds, **extra, **data_shape)
    except Exception as e:  # noqa: BLE001 - any model the planner cannot read must not stop training
        log(f"planner: no prediction for this run ({type(e).__name__}: {e})")
        return None
    _log_prediction(p, log, what)
    return p


def describe_data_shape(shape: dict) -> str:
    """'2 images per prompt, a 16-frame video' for a data_shape_of result."""
    parts = [f"{shape.get('images_per_prompt', 1)} images per prompt"]
    if shape.get("prompt_text_tokens"):
        parts.append(f"prompts of up to {shape['prompt_text_tokens']:,} text tokens")
    if shape.get("video_frames"):
        parts.append(f"a {shape['video_frames']}-frame video")
    return ", ".join(parts)


def data_shape_of(rows: list[dict], limit_images: int | None, max_frames: int, prompt_text_tokens: int | None = None) -> dict:
    """Workload fields the config cannot tell and the training rows can: the most images of a row (within
    limit_images), when rows have videos one video of max_frames frames per prompt, and the text tokens of the
    longest prompt (`prompt_text_tokens`, measured by prompt_budget) when over the planner's default. {} when the rows
    match the planner's defaults (one image, no video, short prompts)."""
    most = max((len(r.get("images") or []) for r in rows), default=1)
    most = min(most, limit_images) if limit_images else most
    shape = {"images_per_prompt": most} if most != 1 else {}
    if prompt_text_tokens and prompt_text_tokens > Workload.prompt_text_tokens:
        shape["prompt_text_tokens"] = prompt_text_tokens
    if any(r.get("videos") for r in rows):
        shape["video_frames"] = max_frames
    return shape


def predict_for_sft(
    cfg, log, target_tokens: int | None = None, world_size: int = 1, sharding: str | None = None, deepspeed: dict | None = None
) -> Plan | None:
    """`predict_for_run` for `vlmrl sft`: each configured stage planned and logged; returns the larger one."""
    try:
        _, gpu, extra = _run_context(cfg, world_size)
        if sharding and world_size > 1:
            extra["sharding"] = sharding
        ds = deepspeed if extra.get("sharding") in ("zero1", "zero2", "zero3") else None
        plans = sft_plans_for_config(cfg, gpu, target_tokens, world_size=world_size, deepspeed=ds, **extra)
    except Exception as e:  # noqa: BLE001 - advice only
        log(f"planner: no prediction for this run ({type(e).__name__}: {e})")
        return None
    for stage, p in plans.items():
        _log_prediction(p, log, f"SFT stage {stage}: ")
    return max(plans.values(), key=lambda p: (p.host["process_peak"], p.peak_allocated)) if plans else None


def measured_vs_predicted(p: Plan | None, warn) -> dict:
    """memory_stats() now plus the plan/* comparison (for loops that do not collect memory metrics themselves)."""
    if p is None:
        return {}
    from vlmrl.engine.memory import memory_stats

    stats = memory_stats()
    return {**stats, **prediction_vs_measured(p, stats, warn)}


def prediction_vs_measured(p: Plan | None, metrics: dict, warn) -> dict:
    """plan/* keys for metrics.jsonl: the prediction and its error against what the step measured: on CUDA the
    reserved peak (mem/gpu_peak_reserved, GiB), on a CPU run this process's peak RSS (mem/host_peak_rss, GiB);
    warns (once per plan) when the miss is over PREDICTION_WARN_FRACTION."""
    if p is None:
        return {}
    if p.workload.get("device") == "cpu":
        predicted = p.host["process_peak"] / GiB
        out = {
            "plan/host_peak_rss": predicted,
            "plan/peak_allocated": p.peak_allocated / GiB,
            "plan/host_runtime": p.workload["host_runtime_bytes"] / GiB,
        }
        measured, key, what = metrics.get("mem/host_peak_rss"), "plan/error_host_rss", "GiB host peak RSS"
    else:
        predicted = p.reserved / GiB
        out = {"plan/peak_allocated": p.peak_allocated / GiB, "plan/peak_reserved": predicted}
        measured, key, what = metrics.get("mem/gpu_peak_reserved"), "plan/error_reserved", "GiB reserved"
    if measured:
        error = (predicted - measured) / measured
        out[key] = error
        if abs(error) > PREDICTION_WARN_FRACTION and not getattr(p, "miss_reported", False):
            p.miss_reported = True  # once per run: the same miss every step says nothing new
            warn(
                f"WARNING: planner predicted {predicted:.2f} {what}, measured {measured:.2f} GiB "
                f"({error:+.0%}); please report the config (vlmrl plan --json) so the planner can learn from it"
            )
    return out
