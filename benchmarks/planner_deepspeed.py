"""The memory planner vs real DeepSpeed ZeRO-2/3 runs on this CPU (`planner_accuracy.py deepspeed`).

Each config: `accelerate launch --config_file <configs/accelerate/deepspeed_json.yaml pointing at a DeepSpeed JSON
written for the config> --num_processes 2 -m vlmrl train|sft` for 2 steps on the mid-size tiny Qwen2.5-VL
(planner_accuracy.MID: 8 layers x 1024 hidden, 0.10 B parameters, float32 weights), gloo, DeepSpeed's CPU
accelerator. Measured: each process's lifetime peak RSS (VmHWM), cut in three by this module's wrapper around the
vlmrl CLI (`_child`): up to deepspeed.initialize (loading), inside it (ZeRO's flattening / partitioning), and after it
(training); the process's peak is the largest. Predicted: plan() of the run's own config (its config.yaml) with the
DeepSpeed config's ZeroConfig, the world size, and the runtime RSS the run measured when it predicted
(plan/host_runtime in metrics.jsonl): Plan.host["process_peak"].
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30

# name, command, DeepSpeed zero_optimization section, vlmrl overrides. Bucket sizes in elements (DeepSpeed's unit).
DS_GRID = [
    ("z2-grpo-full-defaults", "train", {"stage": 2}, []),
    ("z2-grpo-full-bucket2e7", "train", {"stage": 2, "reduce_bucket_size": 20_000_000, "allgather_bucket_size": 20_000_000}, []),
    ("z2-grpo-lora-defaults", "train", {"stage": 2}, ["model.use_lora=true", "model.lora_r=16"]),
    ("z2-sft-full-bucket5e6", "sft", {"stage": 2, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}, []),
    ("z3-grpo-full-defaults", "train", {"stage": 3}, []),
    # the same run without the pin (the wrapper turns vlmrl's pin off: glibc's own rising threshold), for the memory it
    # saves and the time it costs, measured back to back (diagnostic row)
    ("z3-grpo-full-defaults-unpinned", "train", {"stage": 3}, [], {"DSPLAN_NO_PIN": "1"}),
    (
        "z3-grpo-full-small",
        "train",
        {
            "stage": 3,
            "reduce_bucket_size": 5_000_000,
            "stage3_prefetch_bucket_size": 5_000_000,
            "stage3_max_live_parameters": 10_000_000,
            "stage3_param_persistence_threshold": 10_000,
        },
        [],
    ),
    ("z3-sft-full-defaults", "sft", {"stage": 3}, []),
    # a ZeRO-2 run with the mmap threshold pinned as ZeRO-3 runs are (the wrapper pins it), for what the pin would
    # change there (diagnostic row, run beside its base row: `--only z2-sft-full-bucket5e6,z2-sft-full-bucket5e6-pinned`)
    (
        "z2-sft-full-bucket5e6-pinned",
        "sft",
        {"stage": 2, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000},
        [],
        {"DSPLAN_PIN": "1"},
    ),
    ("z3-grpo-lora-defaults", "train", {"stage": 3}, ["model.use_lora=true", "model.lora_r=16"]),
    # ZeRO-1 (only the optimizer states partitioned) and ZeRO-2 with the optimizer offloaded to the host (on a CPU run the
    # same memory; DeepSpeed then steps vlmrl's torch AdamW on the host partition: zero_force_ds_cpu_optimizer false)
    ("z1-grpo-full-defaults", "train", {"stage": 1}, []),
    ("z2-grpo-full-offload", "train", {"stage": 2, "offload_optimizer": {"device": "cpu"}}, []),
]

COMMON = [
    "training.device=cpu",
    "training.max_steps=2",
    "rollout.num_generations=4",
    "rollout.generation_batch_size=8",
    "training.per_device_train_batch_size=8",
    "training.gradient_accumulation_steps=1",
    "rollout.max_completion_length=16",
    "sft.batch_size=8",
    "sft.projector_steps=0",
    "sft.steps=2",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.report=false",
    "data.min_pixels=3136",
    "data.max_pixels=3136",
    "training.resume=never",
    "training.overwrite_output_dir=true",
    "training.save_final_model=false",
]

_ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
machine_rank: 0
rdzv_backend: static
same_network: true
use_cpu: false
deepspeed_config:
  deepspeed_config_file: {json}
  zero3_init_flag: false
"""


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _mallinfo():
    """glibc's mallinfo2 (all arenas), or None off glibc."""
    import ctypes

    class MI2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MI2
        return libc.mallinfo2()
    except (OSError, AttributeError):
        return None


def _live_cpu_tensor_kib() -> int:
    """Bytes of the distinct CPU storages the live tensors (Python objects) hold, KiB."""
    import gc

    import torch

    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                st = o.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.device.type == "cpu" and st.data_ptr() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total // 1024


def snapshot() -> dict:
    """Where the process's memory is now (KiB): resident (anonymous / file pages), peak since the last reset, glibc's
    heap (in use / free inside it) and its mmapped blocks, and the live CPU tensors' storages."""
    out = {k: _status_kib(f) for k, f in (("rss", "VmRSS"), ("hwm", "VmHWM"), ("anon", "RssAnon"), ("file", "RssFile"))}
    mi = _mallinfo()
    if mi is not None:
        out.update(heap=mi.arena // 1024, heap_in_use=mi.uordblks // 1024, heap_free=mi.fordblks // 1024, mmapped=mi.hblkhd // 1024)
    out["tensors"] = _live_cpu_tensor_kib()
    return out


# ZeRO-3's optimizer step, part by part (deepspeed/runtime/zero/stage3.py): a snapshot as each returns (the VmHWM
# since the step began says which part peaked)
_STAGE3_STEP_PARTS = (
    "_pre_step",
    "_partition_all_parameters",
    "_prepare_sub_group",
    "unscale_and_clip_grads",
    "_optimizer_step",
    "_reassign_or_swap_out_partitioned_parameters",
    "_release_sub_group",
    "_post_step",
)


def _watch_gathered(stage3, seg: dict) -> None:
    """Diagnostic runs (DSPLAN_DIAG=1): as ZeRO-3 takes each gradient in backward, the parameters gathered at that
    moment (a partitioned parameter's data is empty) and the resident set; the largest of each kept in `gathered`."""
    real = stage3.reduce_ready_partitions_and_remove_grads
    out = seg.setdefault("gathered", {"max_elements": 0, "rss_kib_then": 0, "max_rss_kib": 0, "elements_then": 0, "calls": 0})

    def wrapped(self, param, *a, **k):
        elements = sum(p.data.numel() for g in self.fp16_groups for p in g)
        rss = _status_kib("VmRSS")
        out["calls"] += 1
        if elements > out["max_elements"]:
            out.update(max_elements=elements, rss_kib_then=rss)
        if rss > out["max_rss_kib"]:
            out.update(max_rss_kib=rss, elements_then=elements)
        return real(self, param, *a, **k)

    stage3.reduce_ready_partitions_and_remove_grads = wrapped


def child(argv: list[str]) -> None:
    """Run the vlmrl CLI in this process with VmHWM read and reset at the edges of deepspeed.initialize and of each
    DeepSpeed backward and optimizer step: the exact peak of each segment (loading, initialize, backward, step, other:
    forward passes, rollout, scoring, saving). At each edge, and as each part of a ZeRO-3 optimizer step returns, a
    snapshot (`probes`): resident, heap and live-tensor bytes, for attributing a peak."""
    import atexit
    import runpy

    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    trace = Path(os.environ["DSPLAN_TRACE"])
    rank = os.environ.get("RANK", "0")
    seg: dict = {"probes": []}
    label = ["loading"]
    steps = [0]

    def cut(next_label: str) -> None:
        key = f"{label[0]}_kib"
        seg[key] = max(seg.get(key, 0), _status_kib("VmHWM"))
        # what the process holds as the segment ends: anonymous memory (tensors, heap) vs mapped file pages
        files = seg.setdefault("file_pages_at_end", {})
        files[label[0]] = max(files.get(label[0], 0), _status_kib("RssFile"))
        seg["probes"].append([f"end of {label[0]}", snapshot()])
        _reset_peak()
        label[0] = next_label

    def write():
        cut("end")
        kib = [v for k, v in seg.items() if k.endswith("_kib") and k not in ("loading_kib", "initialize_kib")]
        seg["training_kib"] = max(kib)
        (trace / f"rank{rank}.json").write_text(json.dumps(seg))

    def around(fn, name):
        def wrapped(*a, **k):
            cut(name)
            try:
                return fn(*a, **k)
            finally:
                cut("other")

        return wrapped

    def probed(fn, name):
        def wrapped(*a, **k):
            try:
                return fn(*a, **k)
            finally:
                seg["probes"].append([f"step {steps[0]}: {name}", snapshot()])

        return wrapped

    def counted(fn):
        def wrapped(*a, **k):
            steps[0] += 1
            return fn(*a, **k)

        return wrapped

    from vlmrl.engine import host_alloc

    if os.environ.get("DSPLAN_NO_PIN") == "1":  # the diagnostic rows without vlmrl's pin (engine/host_alloc.py)
        host_alloc.pin_mmap_threshold = lambda *a, **k: False
    if os.environ.get("DSPLAN_PIN") == "1":  # diagnostic rows of a ZeRO-1/2 run with the pin vlmrl gives ZeRO-3 runs
        host_alloc.pin_mmap_threshold()
    if os.environ.get("DSPLAN_DIAG") == "1":
        _watch_gathered(DeepSpeedZeroOptimizer_Stage3, seg)
    deepspeed.initialize = around(deepspeed.initialize, "initialize")
    DeepSpeedEngine.backward = around(DeepSpeedEngine.backward, "backward")
    DeepSpeedEngine.step = around(counted(DeepSpeedEngine.step), "step")
    for part in _STAGE3_STEP_PARTS:
        setattr(DeepSpeedZeroOptimizer_Stage3, part, probed(getattr(DeepSpeedZeroOptimizer_Stage3, part), part))
    atexit.register(write)
    sys.argv = ["vlmrl", *argv]
    runpy.run_module("vlmrl", run_name="__main__")


def ds_run(name: str, command: str, zero: dict, overrides: list[str], work: Path, port: int, malloc: dict | None = None) -> dict:
    """One 2-process DeepSpeed run; its measured segments per rank and what the run logged."""
    from planner_accuracy import MID

    from vlmrl.data.tasks import make_count_task
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    model, data = work / "model-mid", work / "count"
    if not (model / "config.json").exists():
        build_tiny_qwen25vl(model, **MID)
    if not (data / "train.jsonl").exists():
        make_count_task(data, n_train=32, n_test=8, seed=0, image_size=56)
    ds = {
        "zero_optimization": zero,
        "gradient_clipping": "auto",
        "gradient_accumulation_steps": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    if "offload_optimizer" in zero:  # DeepSpeed's CPU Adam otherwise (a JIT-built op); vlmrl's torch AdamW steps the host partition
        ds["zero_force_ds_cpu_optimizer"] = False
    cfg_json, cfg_yaml, out, trace = work / f"{name}.json", work / f"{name}.yaml", work / name, work / f"{name}-trace"
    cfg_json.write_text(json.dumps(ds))
    cfg_yaml.write_text(_ACCELERATE_YAML.format(json=cfg_json))
    trace.mkdir(exist_ok=True)
    args = [f"model.name_or_path={model}", f"data.train_path={data / 'train.jsonl'}", "data.eval_path=", f"training.output_dir={out}"]
    args += COMMON + overrides
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DSPLAN_TRACE=str(trace), **(malloc or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg_yaml), "--num_processes", "2"]
    launch += ["--main_process_port", str(port), str(Path(__file__)), "_child", command, *args]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(launch, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}: {proc.stdout[-1500:]} {proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "plan/host_runtime" in r][-1]
    ranks = {}
    for r in (0, 1):
        seg = json.loads((trace / f"rank{r}.json").read_text())
        files = seg.pop("file_pages_at_end", {})
        probes = seg.pop("probes", [])
        gathered = seg.pop("gathered", None)
        ranks[r] = {k.replace("_kib", "_gib"): round(v / 2**20, 4) for k, v in seg.items()}
        ranks[r]["file_pages_at_end_gib"] = {k: round(v / 2**20, 4) for k, v in files.items()}
        ranks[r]["probes"] = [[where, {k: round(v / 2**20, 4) for k, v in snap.items()}] for where, snap in probes]
        ranks[r]["logged_peak_gib"] = round(last[f"mem/host_peak_rss/rank{r}"], 4)
        if gathered is not None:
            ranks[r]["gathered_in_backward"] = gathered
        ranks[r]["peak_gib"] = max(ranks[r]["loading_gib"], ranks[r]["initialize_gib"], ranks[r]["training_gib"])
    return {
        "name": name,
        "command": command,
        "deepspeed_config": ds,
        "overrides": overrides,
        "malloc_env": malloc or {},
        "output_dir": str(out),
        "runtime_at_prediction_gib": round(last["plan/host_runtime"], 4),
        "logged_prediction_gib": round(last["plan/host_peak_rss"], 4),
        "ranks": ranks,
        "seconds": round(time.perf_counter() - t0, 1),
        # the run's own line when it pinned glibc's mmap threshold (engine/host_alloc.py: ZeRO-3 runs)
        "mmap_threshold_pinned": "glibc's mmap threshold pinned" in proc.stdout + proc.stderr,
        "step_times_s": [{k: round(v, 3) for k, v in r.items() if k.startswith("time/")} for r in rows if any(k.startswith("time/") for k in r)],
        "load_at_start": round(load, 2),
        "load_at_end": round(os.getloadavg()[0], 2),
    }


def measure(work: Path, only: str = "", log=print) -> list[dict]:
    """Every DS_GRID run (or the comma-separated `only`), one after another."""
    runs = []
    for i, (name, command, zero, overrides, *malloc) in enumerate(DS_GRID):
        if only and name not in only.split(","):
            continue
        try:
            r = ds_run(name, command, zero, overrides, work, 29731 + i, *malloc)
        except RuntimeError as e:  # one failed config does not lose the others' measurements
            log(f"{name:<26} FAILED: {' '.join(str(e).split())[-600:]}")
            continue
        runs.append(r)
        peaks = " / ".join(f"{r['ranks'][k]['peak_gib']:.3f}" for k in (0, 1))
        log(f"{name:<26} peak RSS rank 0 / 1: {peaks} GiB ({r['seconds']} s, load {r['load_at_start']})")
    return runs


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "_child":
    child(sys.argv[2:])


_MID_MODEL: list = []


def _mid_model() -> Path:
    """The grid's model rebuilt (deterministic) in a folder kept for this process: the planner reads its config."""
    import tempfile

    from planner_accuracy import MID

    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    if not _MID_MODEL:
        folder = Path(tempfile.mkdtemp(prefix="dsplan-model-")) / "model-mid"
        build_tiny_qwen25vl(folder, **MID)
        _MID_MODEL.append(folder)
    return _MID_MODEL[0]


def predict(run: dict) -> dict:
    """plan() of the run's own config.yaml on 2 processes under its DeepSpeed config, with the runtime RSS the run
    measured when it predicted; the prediction next to each rank's measured peak."""
    from vlmrl.config import load_config
    from vlmrl.plan.config import plan_for_config, sft_plans_for_config

    if "config" in run:  # the config.yaml the run wrote, kept in the results file
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(run["config"])
            cfg = load_config(Path(tmp) / "config.yaml")
    else:
        cfg = load_config(Path(run["output_dir"]) / "config.yaml")
    if not (Path(cfg.model.name_or_path) / "config.json").exists():  # the run's model was in its (deleted) work folder
        from vlmrl.config import replace

        cfg = replace(cfg, model__name_or_path=str(_mid_model()))
    ds = run["deepspeed_config"]
    sharding = f"zero{ds['zero_optimization']['stage']}"
    extra = {"device": "cpu", "host_runtime_bytes": int(run["runtime_at_prediction_gib"] * GiB), "sharding": sharding}
    if run["command"] == "sft":
        p = max(sft_plans_for_config(cfg, None, None, world_size=2, deepspeed=ds, **extra).values(), key=lambda p: p.host["process_peak"])
    else:
        p = plan_for_config(cfg, world_size=2, deepspeed=ds, **extra)
    # the runs save nothing (training.save_final_model=false, no checkpoints): the planner's saving moment (rank 0
    # gathering the whole model) is left out; loading and training are what the run does. On a CPU run every host term
    # but the save is per process (x 2 on this node): one process's peak is half the node's
    predicted = max(p.host["peak_loading"], p.host["peak_training"]) / 2 / GiB
    top = max(run["ranks"].values(), key=lambda r: r["peak_gib"])
    measured = top["peak_gib"]
    segments = [k for k in top if k.endswith("_gib") and k not in ("peak_gib", "logged_peak_gib", "training_gib", "file_pages_at_end_gib")]
    shown = ("gradients", "optimizer_states", "optimizer_step_temporary", "gathered_parameters")
    zero_keys = [k for k in p.terms if k.startswith("zero") or k in shown]
    return {
        "predicted_peak_rss_gib": round(predicted, 4),
        "measured_peak_rss_gib": round(measured, 4),
        "difference_pct": round(100 * (predicted / measured - 1), 2),
        "peak_segment": max(segments, key=top.get).removesuffix("_gib"),
        "predicted_phases_gib": {k: round(v / GiB, 4) for k, v in p.phases.items()},
        "predicted_host_gib": {k: round(v / GiB, 4) for k, v in p.host.items() if v},
        "zero_terms_gib": {k: round(p.terms[k] / GiB, 4) for k in zero_keys},
    }


def markdown(data: dict) -> str:
    """The results page: what was run and how, then the table docs/planner.md shows (scripts/readme_figures.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from readme_figures import planner_deepspeed_table

    rows = data["rows"]
    loads = [r["load_at_start"] for r in rows if r.get("load_at_start") is not None]
    lines = [
        f"# Planner vs DeepSpeed ZeRO on 2 CPU processes ({data['date']}, {data['machine']})",
        "",
        "Each row: `accelerate launch` with a DeepSpeed JSON (its zero_optimization section below; every key not written takes "
        "DeepSpeed 0.19.8's default), 2 processes over gloo, `vlmrl train` (GRPO) or `vlmrl sft` (stage 2) for 2 steps on the mid "
        "tiny Qwen2.5-VL (8 layers x 1024 hidden, 0.10 B parameters, float32), count task, 56 px images, G=4, 16 completion "
        "tokens (`python benchmarks/planner_accuracy.py deepspeed`). Measured: each process's lifetime peak RSS (VmHWM), cut at "
        "deepspeed.initialize and at each DeepSpeed backward / optimizer step (`peak in`: the segment of the larger rank's peak; "
        "`other` is the rollout, scoring and forward passes). Predicted: plan() of the run's config.yaml with the DeepSpeed config "
        "and the runtime RSS the run measured when it predicted (Plan.host process_peak). Peak RSS counts bytes, not time: the "
        f"machine's load (1-minute load average {min(loads):.0f}-{max(loads):.0f} "
        "at the runs' starts, on 2 cores shared with other jobs) changes run times only.",
        "",
        planner_deepspeed_table(rows),
        "Per rank (GiB): " + "; ".join(f"{r['name']} {r['ranks']['0']['peak_gib']:.3f} / {r['ranks']['1']['peak_gib']:.3f}" for r in rows) + ".",
    ]
    for r in rows:
        if r.get("pass"):
            lines.append(f"\n{r['name']}: measured in {r['pass']}.")
    for r in data.get("exploratory", []):
        peaks = " / ".join(f"{r['ranks'][k]['peak_gib']:.3f}" for k in ("0", "1"))
        lines.append(f"\nExploratory run (not in the table): {r['name']}, peak RSS rank 0 / 1 {peaks} GiB; {r['why']}")
    lines += _time_lines(rows + data.get("exploratory", []))  # the table's pinned/unpinned pair, and any exploratory one
    if data.get("compare"):
        lines += ["", *_compare_lines(data["compare"], rows)]
    if data.get("note"):
        lines.append("\n" + data["note"])
    return "\n".join(lines) + "\n"


def _mean_times(r: dict) -> dict:
    """Mean seconds per phase over the run's steps after the first (the first builds caches and JIT-compiles)."""
    steps = r.get("step_times_s") or []
    steps = steps[1:] or steps
    keys = sorted({k for s in steps for k in s})
    return {k.removeprefix("time/"): sum(s.get(k, 0) for s in steps) / len(steps) for k in keys} if steps else {}


def _time_lines(rows: list[dict]) -> list[str]:
    """Each diagnostic row's step times beside its base row's (the two run back to back)."""
    by_name = {r["name"]: r for r in rows}
    out = []
    for r in rows:
        base = by_name.get(r["name"].replace("-unpinned", "")) if "-unpinned" in r["name"] else None
        if base is None or not _mean_times(r) or not _mean_times(base):
            continue
        a, b = _mean_times(base), _mean_times(r)
        phases = ", ".join(f"{k} {a[k]:.2f} vs {b[k]:.2f}" for k in a if k in b)
        out.append(
            f"\nStep time after the first step, pinned ({base['name']}) vs unpinned ({r['name']}), seconds: {phases} "
            f"(whole runs {base['seconds']} vs {r['seconds']} s; 1-minute load {base['load_at_start']} / {r['load_at_start']} at their starts)."
        )
    return out


def _cells(r: dict | None) -> str:
    if r is None:
        return "- | - | - | -"
    return f"{r['measured_peak_rss_gib']:.2f} | {r['peak_segment']} | {r['predicted_peak_rss_gib']:.2f} | {r['difference_pct']:+.1f}%"


def _compare_lines(before: dict, rows: list[dict]) -> list[str]:
    """The configs of an earlier results file beside this one's (its own measured peaks and predictions as recorded)."""
    now = {r["name"]: r for r in rows}
    lines = [
        f"Earlier measurement of the same grid (`{before['file']}`, {before['date']}: ZeRO-3 runs without the pinned mmap threshold; "
        "the predictions by the planner of then):",
        "",
        "| config | then: measured GiB | peak in | predicted | error | now: measured GiB | peak in | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, b in before["rows"].items():
        env = " ".join(f"{k}={v}" for k, v in (b.get("malloc_env") or {}).items())
        r = now.get(name)
        cells = " | ".join(_cells(x) for x in (b, r))
        lines.append(f"| {name}{' (' + env + ', diagnostic)' if env else ''} | {cells} |")
    return lines
