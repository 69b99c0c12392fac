#!/usr/bin/env python
"""GPU memory and step time of GRPO on real Qwen-VL shapes (random weights, no downloads).

    python benchmarks/gpu_memory.py --preset qwen2.5-vl-3b --out benchmarks/results --steps 3
    python benchmarks/gpu_memory.py --quick --out /tmp/gm                 # smoke test, embedded tiny model
    python benchmarks/gpu_memory.py --quick --allow-cpu --steps 2 --out /tmp/gm   # CPU smoke test

The preset model folder (vlmrl.plan.presets.build_preset_model) is built once under --model-root
(default /tmp) and reused. Each configuration of the grid then runs as its own
`python -m vlmrl train ...` subprocess, so CUDA caching-allocator state and peaks never leak from one
configuration into the next. From each run's metrics.jsonl the script keeps: the max over steps of
`mem/gpu_peak_allocated` / `mem/gpu_peak_reserved` (GiB), the medians of `time/step`, `time/rollout`,
`time/update`, and completion tokens trained per second. Step 1 (optimizer-state creation, CUDA /
cuBLAS warm-up) is left out when --steps >= 3. A configuration that runs out of memory is recorded as
{"oom": true, "error": <last log lines>}. Results go to OUT/gpu_memory_<preset>.json, rewritten after
every configuration so a cut-off run keeps what it measured.

This script imports no CUDA-only package; torch is only imported inside subprocesses.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TINY_MODEL = "embedded:tiny-qwen2.5-vl"


# ---------------------------------------------------------------- the grid


def base_overrides(steps: int, device: str) -> list[str]:
    """Shared by every full-size configuration: bf16 weights + autocast, sdpa, 448x448 images (256
    image tokens per prompt), 64-token completions, accuracy reward only, no eval / report / save."""
    return [
        "model.dtype=bfloat16",
        "training.bf16=true",
        "model.attn_implementation=sdpa",
        "data.task=count",
        "data.task_image_size=448",
        f"data.min_pixels={448 * 448}",
        f"data.max_pixels={448 * 448}",
        "data.task_train_size=64",
        "data.task_test_size=0",
        "rollout.max_completion_length=64",
        "algorithm.reward_funcs=[accuracy]",
        f"training.max_steps={steps}",
        f"training.device={device}",
        "training.seed=0",
        "training.resume=never",
        "training.overwrite_output_dir=true",
        "training.save_final_model=false",
        "training.save_steps=0",
        "optim.learning_rate=1e-6",
        "logging.report=false",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "logging.log_completions=1",
    ]


def batch_overrides(G: int, prompts: int = 2, accumulation: int = 4) -> list[str]:
    """prompts x G completions per rollout, micro-batches of G*prompts/accumulation, one optimizer step."""
    gen = prompts * G
    mb = gen // accumulation
    assert mb * accumulation == gen, (G, prompts, accumulation)
    return [
        f"rollout.num_generations={G}",
        f"rollout.generation_batch_size={gen}",
        f"training.per_device_train_batch_size={mb}",
        f"training.gradient_accumulation_steps={accumulation}",
    ]


def grid() -> list[dict]:
    configs = []
    for G in (4, 8):
        for gc in (False, True):
            configs.append(
                {"name": f"full-G{G}" + ("-gc" if gc else ""), "overrides": batch_overrides(G) + [f"model.gradient_checkpointing={str(gc).lower()}"]}
            )
    configs.append(
        {
            "name": "lora-r16-G8",
            "overrides": batch_overrides(8) + ["model.gradient_checkpointing=false", "model.use_lora=true", "model.lora_r=16", "model.lora_alpha=32"],
        }
    )
    return configs


def quick_config(steps: int, device: str) -> dict:
    """One tiny configuration on the embedded tiny Qwen2.5-VL (smoke test of the whole pipeline)."""
    cuda = device == "cuda"
    dtype = ["model.dtype=bfloat16", "training.bf16=true"] if cuda else ["model.dtype=float32", "training.bf16=false"]
    return {
        "name": "quick-tiny-G4",
        "overrides": dtype
        + [
            "model.attn_implementation=sdpa",
            "data.task=count",
            "data.task_image_size=56",
            f"data.min_pixels={56 * 56}",
            f"data.max_pixels={56 * 56}",
            "data.task_train_size=16",
            "data.task_test_size=0",
            "rollout.max_completion_length=8",
            "algorithm.reward_funcs=[accuracy]",
            f"training.max_steps={steps}",
            f"training.device={device}",
            "training.seed=0",
            "training.resume=never",
            "training.overwrite_output_dir=true",
            "training.save_final_model=false",
            "training.save_steps=0",
            "optim.learning_rate=1e-6",
            "logging.report=false",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "logging.log_completions=1",
            *batch_overrides(4, prompts=2, accumulation=2),
            "model.gradient_checkpointing=false",
        ],
    }


# ---------------------------------------------------------------- subprocess helpers


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


PROBE = r"""
import json, platform, torch, transformers
d = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
     "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    d.update(device=torch.cuda.get_device_name(0), gpu_total_memory_gib=round(p.total_memory / 2**30, 2),
             device_count=torch.cuda.device_count())
else:
    d.update(device="cpu", gpu_total_memory_gib=None)
try:
    import peft; d["peft"] = peft.__version__
except Exception:
    d["peft"] = None
print("PROBE" + json.dumps(d))
"""

BUILD = r"""
import json, sys, time
from pathlib import Path
t = time.perf_counter()
from vlmrl.plan.presets import build_preset_model, count_parameters_meta
name, out, device = sys.argv[1], sys.argv[2], sys.argv[3]
build_preset_model(name, out, device=device)
info = {"preset": name, "parameters": count_parameters_meta(name), "build_seconds": round(time.perf_counter() - t, 1)}
(Path(out) / "preset.json").write_text(json.dumps(info))
print("BUILD" + json.dumps(info))
"""


def probe() -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=_env())
    for line in r.stdout.splitlines():
        if line.startswith("PROBE"):
            return json.loads(line[5:])
    raise SystemExit(f"gpu_memory: could not query torch (exit {r.returncode}):\n{r.stderr[-2000:]}")


def build_model(preset: str, root: Path, device: str) -> tuple[Path, dict]:
    """The preset folder under root, built once (in a temporary sibling renamed into place)."""
    final = root / f"vlmrl-preset-{preset}"
    info_file = final / "preset.json"
    if info_file.is_file():
        info = json.loads(info_file.read_text())
        print(f"[gpu_memory] reusing {final}")
        return final, {**info, "reused": True}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".vlmrl-preset-{preset}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"[gpu_memory] building {preset} (random bf16 weights) on {device} into {final} ...", flush=True)
    r = subprocess.run([sys.executable, "-c", BUILD, preset, str(tmp), device], capture_output=True, text=True, env=_env())
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"gpu_memory: building {preset} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    info = json.loads(info_file.read_text())
    print(f"[gpu_memory] built in {info['build_seconds']} s ({info['parameters'] / 1e9:.2f} B parameters)")
    return final, {**info, "reused": False}


OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a crash
    return rows


def summarize(rows: list[dict], steps: int, completions_per_step: int, max_len: int) -> dict:
    """Peaks: max over kept steps; times: medians over kept steps (step 1 dropped when steps >= 3)."""
    kept = [r for r in rows if r.get("step", 0) > 1] if steps >= 3 and len(rows) >= 2 else rows

    def col(key):
        return [r[key] for r in kept if isinstance(r.get(key), (int, float))]

    def peak(key):
        v = col(key)
        return round(max(v), 3) if v else None

    def median(key, nd=3):
        v = col(key)
        return round(statistics.median(v), nd) if v else None

    out = {
        "steps_logged": len(rows),
        "steps_used": [r.get("step") for r in kept],
        "gpu_peak_allocated_gib": peak("mem/gpu_peak_allocated"),
        "gpu_peak_reserved_gib": peak("mem/gpu_peak_reserved"),
        "host_peak_rss_gib": peak("mem/host_peak_rss"),
        "time_step_s": median("time/step"),
        "time_rollout_s": median("time/rollout"),
        "time_scoring_s": median("time/scoring"),
        "time_update_s": median("time/update"),
        "completion_mean_length": median("completions/mean_length", 2),
        "completions_per_step": completions_per_step,
    }
    # Completion tokens trained per second. Generation runs to max_completion_length (random weights
    # over the full vocabulary practically never sample eos); the measured mean length is used, and
    # full_length records whether it indeed equalled max_completion_length.
    if out["time_step_s"] and out["completion_mean_length"] is not None:
        out["tokens_per_s"] = round(completions_per_step * out["completion_mean_length"] / out["time_step_s"], 1)
        out["full_length"] = abs(out["completion_mean_length"] - max_len) < 1e-6
    return out


def _value(overrides: list[str], key: str, default=None):
    for o in overrides:
        if o.startswith(key + "="):
            return o.split("=", 1)[1]
    return default


def run_config(cfg: dict, model: str, run_dir: Path, steps: int, timeout: int) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    overrides = [f"model.name_or_path={model}", *cfg["overrides"], f"training.output_dir={run_dir}"]
    cmd = [sys.executable, "-m", "vlmrl", cfg.get("command", "train"), *overrides]  # the GPU suite also runs `vlmrl sft`
    log_path = run_dir.parent / f"{run_dir.name}.train.log"  # beside the run folder: vlmrl refuses folders holding foreign files
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    wall = round(time.perf_counter() - t0, 1)
    text = log_path.read_text(errors="replace")
    tail = "\n".join(text.strip().splitlines()[-15:])
    record = {"name": cfg["name"], "overrides": cfg["overrides"], "returncode": rc, "wall_s": wall}
    gen = int(_value(cfg["overrides"], "rollout.generation_batch_size", _value(cfg["overrides"], "sft.batch_size", 0)))
    max_len = int(_value(cfg["overrides"], "rollout.max_completion_length", _value(base_overrides(1, "x"), "rollout.max_completion_length")))
    rows = read_metrics(run_dir / "metrics.jsonl")
    if rc == 0 and rows:
        record.update(oom=False, **summarize(rows, steps, gen, max_len))
    else:
        oom = any(m in text for m in OOM_MARKERS)
        record.update(oom=oom, timed_out=timed_out, error=tail)
        if rows:  # steps finished before the failure
            record["partial"] = summarize(rows, steps, gen, max_len)
    return record


# ---------------------------------------------------------------- output


def table(records: list[dict]) -> str:
    head = f"{'config':<16} {'alloc GiB':>9} {'resv GiB':>9} {'step s':>7} {'rollout s':>9} {'update s':>8} {'tok/s':>8}  note"
    lines = [head, "-" * len(head)]

    def f(v, nd=2):
        return "-" if v is None else f"{v:.{nd}f}"

    for r in records:
        if r.get("oom"):
            lines.append(f"{r['name']:<16} {'OOM':>9}")
            continue
        if r.get("returncode") != 0:
            lines.append(f"{r['name']:<16} {'FAILED':>9}  " + ("timeout" if r.get("timed_out") else f"exit {r.get('returncode')}"))
            continue
        note = "" if r.get("full_length", True) else f"mean len {r.get('completion_mean_length')}"
        lines.append(
            f"{r['name']:<16} {f(r['gpu_peak_allocated_gib']):>9} {f(r['gpu_peak_reserved_gib']):>9} "
            f"{f(r['time_step_s']):>7} {f(r['time_rollout_s']):>9} {f(r['time_update_s']):>8} "
            f"{f(r.get('tokens_per_s'), 0):>8}  {note}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-vl-3b", help="one of vlmrl.plan.presets.PRESETS (ignored with --quick)")
    p.add_argument("--out", default="benchmarks/results", help="folder for gpu_memory_<preset>.json and runs/")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per configuration (step 1 is dropped when >= 3)")
    p.add_argument("--quick", action="store_true", help="one tiny configuration on the embedded tiny model")
    p.add_argument("--allow-cpu", action="store_true", help="with --quick: run on the CPU when no GPU is present")
    p.add_argument("--model-root", default="/tmp", help="where the preset model folder is built (once) and reused")
    p.add_argument("--only", default="", help="comma-separated config names to run (default: the whole grid)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per configuration before it is killed")
    p.add_argument("--delete-model", action="store_true", help="delete the preset model folder at the end (default: keep it for reuse)")
    args = p.parse_args(argv)

    if args.allow_cpu and not args.quick:
        p.error("--allow-cpu is only for the CPU smoke test: use it together with --quick")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    info = probe()
    if info["cuda_available"]:
        device = "cuda"
    elif args.allow_cpu:
        device = "cpu"
        print("[gpu_memory] no CUDA device: CPU smoke test (no GPU memory figures)")
    else:
        print(
            "gpu_memory: no CUDA GPU is visible to torch (torch.cuda.is_available() is False, "
            f"torch {info['torch']}, CUDA build {info['cuda']}); this benchmark measures GPU memory and needs one. "
            "For a pipeline smoke test on the CPU use --quick --allow-cpu.",
            file=sys.stderr,
        )
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        label, model, build = "quick", TINY_MODEL, {"preset": "embedded:tiny-qwen2.5-vl"}
        configs = [quick_config(args.steps, device)]
    else:
        from_presets = _preset_names()
        if args.preset not in from_presets:
            p.error(f"unknown preset {args.preset!r}; choose one of {', '.join(from_presets)}")
        label = args.preset
        folder, build = build_model(args.preset, Path(args.model_root), device)
        model = str(folder)
        base = base_overrides(args.steps, device)
        configs = [{"name": c["name"], "overrides": base + c["overrides"]} for c in grid()]
        if args.only:
            wanted = {s.strip() for s in args.only.split(",") if s.strip()}
            unknown = wanted - {c["name"] for c in configs}
            if unknown:
                p.error(f"--only: unknown config(s) {sorted(unknown)}; known: {[c['name'] for c in configs]}")
            configs = [c for c in configs if c["name"] in wanted]

    result_path = out / f"gpu_memory_{label}.json"
    result = {
        "preset": label,
        "model": model,
        "build": build,
        "device": info["device"],
        "gpu_total_memory_gib": info["gpu_total_memory_gib"],
        "torch": info["torch"],
        "transformers": info["transformers"],
        "peft": info.get("peft"),
        "cuda": info["cuda"],
        "python": info["python"],
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "steps": args.steps,
        "warmup_dropped": args.steps >= 3,
        "records": [],
    }
    for i, cfg in enumerate(configs, 1):
        print(f"[gpu_memory] ({i}/{len(configs)}) {cfg['name']} ...", flush=True)
        rec = run_config(cfg, model, out / "runs" / label / cfg["name"], args.steps, args.timeout)
        result["records"].append(rec)
        result_path.write_text(json.dumps(result, indent=2))
        status = "OOM" if rec.get("oom") else ("ok" if rec["returncode"] == 0 else "FAILED")
        print(
            f"[gpu_memory]   {status} in {rec['wall_s']} s"
            + (
                f": peak allocated {rec['gpu_peak_allocated_gib']} GiB, step {rec['time_step_s']} s"
                if status == "ok" and rec.get("gpu_peak_allocated_gib") is not None
                else ""
            )
            + ("" if status == "ok" else "\n" + rec.get("error", "")[-1500:]),
            flush=True,
        )

    if args.delete_model and not args.quick:
        shutil.rmtree(model, ignore_errors=True)
    print()
    print(
        f"{label} on {info['device']} ({info['gpu_total_memory_gib']} GiB), {args.steps} steps, "
        f"torch {info['torch']}, transformers {info['transformers']}"
    )
    print(table(result["records"]))
    print(f"\n[gpu_memory] wrote {result_path}")
    failed = [r for r in result["records"] if r["returncode"] != 0 and not r.get("oom")]
    return 1 if failed else 0


def _preset_names() -> list[str]:
    """Preset names without importing torch in this process (the subprocesses do the real work)."""
    sys.path.insert(0, str(SRC))
    try:
        import ast

        tree = ast.parse((SRC / "vlmrl" / "presets.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "PRESETS":
                return [k.value for k in node.value.keys]
    finally:
        sys.path.pop(0)
    return []


if __name__ == "__main__":
    sys.exit(main())
