"""The memory engine part by part: peak memory and step time of whole GRPO steps with each part on/off.

    python benchmarks/memory_engine.py                       # CPU, writes benchmarks/results/memory_engine_<device>_<date>.*
    python benchmarks/memory_engine.py --device cuda         # on a GPU (peak = torch.cuda.max_memory_allocated)
    python benchmarks/memory_engine.py --quick               # small sizes, checks the harness in a minute
    python benchmarks/memory_engine.py --family qwen3-vl     # tiny Qwen3-VL (DeepStack, patch 16: 196 tokens per 448px image)
    python benchmarks/memory_engine.py --video 16            # one 16-frame video per prompt instead of an image (mp4, PyAV)

Workload (issue 4, part 8): tiny Qwen2.5-VL with a Qwen-size vocabulary (151,936), image-heavy prompts
(448x448 images -> 256 image tokens each), completions forced to 64 tokens (rollout.min_completion_length),
G = 8, 2 prompts per step (16 completions), fp32, GRPO with beta = 0 and num_iterations = 1.

Each row is one configuration, run in its own subprocess (so each has its own process peak): the
first row has every part off, each next row switches one more part on:
  1. chunked log-probs (memory.logprob_chunk_tokens 0 -> 128)
  2. one vision encode per prompt in scoring/update (memory.group_vision)
  3. shared prompt prefix in rollout and update (memory.shared_prefix)
  4. micro-batches of 4 rows x 4 accumulation steps instead of all 16 rows at once (same effective batch)
  5. the continuous rollout engine (rollout.engine=continuous: preallocated KV slots, finished rows replaced)
Measured: median step time over the measured steps (after warm-up), the split rollout/update, the
process peak (CPU: peak RSS from getrusage; GPU: max_memory_allocated), the peak increase over the
loaded-model baseline, and vision-tower calls and images per step (a forward pre-hook on the tower).

The machine's load (1-minute load average) is recorded before the first and after every configuration. Peaks do not
depend on it; step times do: when some other job ran beside the benchmark (load above the benchmark's own threads
+ 0.5 at any reading, or above 0.5 before it started) the step-time ratio is flagged as not a quiet-machine figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ROWS = [
    ("all off", dict(logprob_chunk_tokens=0, group_vision=False, shared_prefix=False, micro=16)),
    ("+ chunked log-probs", dict(logprob_chunk_tokens=128, group_vision=False, shared_prefix=False, micro=16)),
    ("+ one vision encode per prompt", dict(logprob_chunk_tokens=128, group_vision=True, shared_prefix=False, micro=16)),
    ("+ shared prompt prefix", dict(logprob_chunk_tokens=128, group_vision=True, shared_prefix=True, micro=16)),
    ("+ micro-batch 4 x accumulation 4", dict(logprob_chunk_tokens=128, group_vision=True, shared_prefix=True, micro=4)),
    ("+ continuous rollout engine (all on)", dict(logprob_chunk_tokens=128, group_vision=True, shared_prefix=True, micro=4, engine="continuous")),
]


FAMILIES = {
    "qwen2.5-vl": "Qwen2.5-VL",
    "qwen3-vl": "Qwen3-VL",
    "qwen3-vl-moe": "Qwen3-VL-MoE (4 experts, top-2)",
    "llava-onevision": "LLaVA-OneVision (anyres: 28 px SigLIP tiles, up to 3x3 + base)",
}


def build_model(folder: Path, vocab: int, quick: bool, family: str = "qwen2.5-vl") -> Path:
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl
    from vlmrl.tiny_models.tiny_families import build_tiny_llava_onevision, build_tiny_qwen3vl, build_tiny_qwen3vl_moe

    builder = {
        "qwen2.5-vl": build_tiny_qwen25vl,
        "qwen3-vl": build_tiny_qwen3vl,
        "qwen3-vl-moe": build_tiny_qwen3vl_moe,
        "llava-onevision": build_tiny_llava_onevision,
    }[family]
    if not (folder / "config.json").exists():
        builder(folder, vocab_size=vocab, max_pixels=448 * 448 if not quick else 224 * 224)
    return folder


def write_video_rows(folder: Path, frames: int, side: int, rows: int = 8) -> Path:
    """`rows` data rows, each one `frames`-frame side x side mp4 (random colour blocks, 2 frames per second, so
    data.fps=2 keeps every frame) asking for the answer format only; returns the jsonl."""
    import av
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        path = folder / f"clip{i}.mp4"
        if not path.exists():
            rng = np.random.default_rng(i)
            with av.open(str(path), "w") as container:
                stream = container.add_stream("mpeg4", rate=2)
                stream.width = stream.height = side
                stream.pix_fmt = "yuv420p"
                for _ in range(frames):
                    blocks = rng.integers(0, 255, (side // 16, side // 16, 3), dtype=np.uint8)
                    frame = np.kron(blocks, np.ones((16, 16, 1), dtype=np.uint8))
                    for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                        container.mux(packet)
                for packet in stream.encode():
                    container.mux(packet)
        lines.append(json.dumps({"video": str(path), "problem": "What happens in the video?", "solution": "0"}))
    out = folder / "rows.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def video_overrides(args) -> list[str]:
    return [f"data.train_path={args.data}", "data.eval_path=", f"data.max_frames={args.video}", f"data.video_max_pixels={args.side * args.side}"]


def run_one(args) -> dict:
    """Child process: one configuration, `warmup + steps` GRPO steps; prints a JSON line."""
    import torch

    import vlmrl.train as train_mod
    from vlmrl.config import load_config
    from vlmrl.models.logprobs import vision_encode_counter

    flags = json.loads(args.flags)
    micro = flags.pop("micro")
    engine = flags.pop("engine", "loop")
    total = args.warmup + args.steps
    overrides = [
        f"model.name_or_path={args.model}",
        f"training.device={args.device}",
        f"training.output_dir={args.out_dir}",
        f"training.max_steps={total}",
        "training.save_final_model=false",
        "training.resume=never",
        "training.overwrite_output_dir=true",
        f"training.per_device_train_batch_size={micro}",
        f"training.gradient_accumulation_steps={16 // micro}",
        "rollout.generation_batch_size=16",
        f"rollout.num_generations={args.g}",
        f"rollout.engine={engine}",
        f"rollout.max_completion_length={args.completion}",
        f"rollout.min_completion_length={args.completion}",
        "data.task=count",
        f"data.task_image_size={args.side}",
        "data.task_train_size=32",
        "data.task_test_size=0",
        f"data.max_pixels={args.side * args.side}",
        *(video_overrides(args) if args.video else []),
        "algorithm.reward_funcs=[answer_format]",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "logging.log_completions=0",
        "optim.learning_rate=1e-5",
    ] + [f"memory.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in flags.items()]
    cfg = load_config(None, overrides)

    import psutil

    counts, baseline = [], {}
    original_load = train_mod.load_policy

    def load_and_count(*a, **kw):
        model, processor = original_load(*a, **kw)
        counts.append(vision_encode_counter(model).__enter__())
        baseline["rss_gib"] = psutil.Process().memory_info().rss / 2**30  # model loaded, nothing trained yet
        return model, processor

    train_mod.load_policy = load_and_count
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            train_mod.train(cfg, log=lambda *_: None)
        print("RESULT " + json.dumps({"ops": top_ops(prof, total, vocab_rows(args.model))}))
        return {}
    train_mod.train(cfg, log=lambda *_: None)
    lines = [json.loads(x) for x in (Path(args.out_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [m for m in lines if "time/step" in m][args.warmup :]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    out = {
        "step_s": statistics.median(m["time/step"] for m in steps),
        "rollout_s": statistics.median(m["time/rollout"] for m in steps),
        "update_s": statistics.median(m["time/update"] for m in steps),
        "peak_rss_gib": peak_rss,
        "completion_tokens_per_step": statistics.median(m["completions/mean_length"] * 16 for m in steps),
        "vision_calls_per_step": counts[0].calls / total,
        "vision_images_per_step": counts[0].images / total,
        "rss_after_load_gib": baseline["rss_gib"],
        "peak_over_load_gib": peak_rss - baseline["rss_gib"],
    }
    if args.device.startswith("cuda"):
        out["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    print("RESULT " + json.dumps(out))
    return out


def vocab_rows(model: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    return int((config.get("text_config") or config)["vocab_size"])


def top_ops(prof, steps: int, vocab: int, n: int = 12) -> list[dict]:
    """The n ops with the most self CPU time per step (grouped by op and input shapes; every step, warm-up included,
    under the profiler), each flagged when one of its inputs has a vocabulary-sized dimension (the LM head's work)."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        shapes = [list(x) for x in (e.input_shapes or []) if isinstance(x, (list, tuple))]
        rows.append(
            {
                "op": e.key,
                "shapes": shapes,
                "calls_per_step": e.count / steps,
                "self_s_per_step": e.self_cpu_time_total / 1e6 / steps,
                "vocab_sized": any(vocab in s for s in shapes),
            }
        )
    total = sum(r["self_s_per_step"] for r in rows)
    vocab_total = sum(r["self_s_per_step"] for r in rows if r["vocab_sized"])
    rows.sort(key=lambda r: -r["self_s_per_step"])
    return [{"total_self_s_per_step": total, "vocab_sized_self_s_per_step": vocab_total}] + rows[:n]


def profile_rows(a, rows: list[tuple[str, dict]], cmd_for) -> dict[str, list[dict]]:
    """Re-run the given configurations under torch.profiler (apart from the timed runs: the profiler slows them)."""
    out = {}
    for i, (name, flags) in enumerate(rows):
        cmd = cmd_for(flags, f"profile-{i}") + ["--profile"]
        proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"profiling {name!r} failed (exit {proc.returncode})")
        out[name] = json.loads(line[0][7:])["ops"]
    return out


def profile_md(profiles: dict[str, list[dict]]) -> list[str]:
    md = ["", "## Where the time goes (torch.profiler, a separate run of each configuration; self CPU time per step)", ""]
    for name, ops in profiles.items():
        head, rows = ops[0], ops[1:]
        md += [
            f"**{name}**: {head['total_self_s_per_step']:.2f} s of ops per step under the profiler, of which "
            f"{head['vocab_sized_self_s_per_step']:.2f} s ({head['vocab_sized_self_s_per_step'] / head['total_self_s_per_step']:.0%}) in ops "
            "with a vocabulary-sized input (LM head matmuls, log-softmax, sampling, the head's weight gradient and buffers).",
            "",
            "| op | input shapes | calls / step | self s / step | vocab-sized |",
            "|---|---|---|---|---|",
        ]
        md += [
            f"| {r['op']} | {r['shapes']} | {r['calls_per_step']:.1f} | {r['self_s_per_step']:.3f} | {'yes' if r['vocab_sized'] else ''} |"
            for r in rows
        ]
        md.append("")
    return md


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def quiet_verdict(before: float | None, readings: list[float | None], threads: int) -> tuple[bool | None, str]:
    """(quiet, why): quiet when the load was at most 0.5 before the benchmark and at most its own threads + 0.5 at
    every reading after a configuration; None when the OS gives no load average."""
    if before is None or any(r is None for r in readings):
        return None, "load average not available: cannot tell whether other jobs ran beside the benchmark"
    worst = max(readings, default=before)
    if before <= 0.5 and worst <= threads + 0.5:
        return True, f"quiet machine (load {before:.2f} before, at most {worst:.2f} during; the benchmark's own threads: {threads})"
    return False, (
        f"measured beside other jobs (load {before:.2f} before, up to {worst:.2f} during, on {os.cpu_count()} cores; the benchmark's own "
        f"threads: {threads}): the step-time ratio is NOT a quiet-machine figure; the peaks do not depend on the load"
    )


def selected_rows(spec: str) -> list[tuple[str, dict]]:
    """The ROWS picked by --rows: "first,last" (all off, all on: the GPU suite's pair) or indices ("0,2")."""
    if not spec:
        return ROWS
    index = {"first": 0, "last": len(ROWS) - 1}
    return [ROWS[index[k] if k in index else int(k)] for k in spec.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="vocab 20,000, 224px images, completion 16")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--work", default="/tmp/vlmrl-bench-memory-engine")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--flags", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--g", type=int, default=8)
    ap.add_argument("--completion", type=int, default=None, help="forced completion length (default 64; --quick 16)")
    ap.add_argument("--side", type=int, default=None, help="image side in pixels (default 448; --quick 224)")
    ap.add_argument("--rows", default="", help="configurations to run: first,last (all off, all on) or indices (default: every row)")
    ap.add_argument("--family", default="qwen2.5-vl", choices=list(FAMILIES), help="tiny model family (vlmrl tiny names)")
    ap.add_argument("--video", type=int, default=0, help="frames of one video per prompt (side x side mp4s) instead of an image")
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="also re-run the first and last rows under torch.profiler: per-op time per step")
    a = ap.parse_args()
    if a.child:
        run_one(a)
        return 0

    vocab = 20_000 if a.quick else 151_936
    a.completion = a.completion or (16 if a.quick else 64)
    a.side = a.side or (224 if a.quick else 448)
    work = Path(a.work)
    model = build_model(work / f"model-{a.family}-v{vocab}", vocab, a.quick, a.family)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    data = write_video_rows(work / f"videos-{a.video}-{a.side}", a.video, a.side) if a.video else None
    results = []
    load_before = load_average()

    def cmd_for(flags: dict, run: str) -> list[str]:
        return [
            sys.executable,
            __file__,
            "--child",
            "--flags",
            json.dumps(flags),
            "--model",
            str(model),
            "--out-dir",
            str(work / run),
            "--device",
            a.device,
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            "--g",
            str(a.g),
            "--completion",
            str(a.completion),
            "--side",
            str(a.side),
            "--video",
            str(a.video),
            *(["--data", str(data)] if data else []),
        ]

    for name, flags in selected_rows(a.rows):
        cmd = cmd_for(flags, f"run-{len(results)}")
        subprocess.run(["rm", "-rf", str(work / f"run-{len(results)}")], check=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"configuration {name!r} failed (exit {proc.returncode})")
        res = {"name": name, "flags": flags, **json.loads(line[0][7:]), "load_after": load_average()}
        results.append(res)
        print(
            f"{name:45s} step {res['step_s']:7.2f} s  peak RSS {res['peak_rss_gib']:.2f} GiB  vision images/step {res['vision_images_per_step']:.0f}"
            f"  load after {res['load_after']}",
            flush=True,
        )

    tokens = {r["completion_tokens_per_step"] for r in results}
    if len(tokens) != 1:
        raise SystemExit(f"unequal work: completion tokens per step differ between rows: {sorted(tokens)}")
    off, on = results[0], results[-1]
    peak_key = "gpu_peak_allocated_gib" if a.device.startswith("cuda") else "peak_rss_gib"
    summary = {
        "peak_ratio_all_on_vs_off": on[peak_key] / off[peak_key],
        "peak_over_load_ratio_all_on_vs_off": on["peak_over_load_gib"] / off["peak_over_load_gib"],
        "step_time_ratio_all_on_vs_off": on["step_s"] / off["step_s"],
        "vision_images_per_step_all_on": on["vision_images_per_step"],
        "unique_prompts_per_step": 2,
    }
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
    quiet, why = quiet_verdict(load_before, [r["load_after"] for r in results], threads)
    summary.update(load_before=load_before, load_after=[r["load_after"] for r in results], quiet_machine=quiet, load_note=why)
    device_name = a.device
    if a.device.startswith("cuda"):
        import torch

        device_name = torch.cuda.get_device_name().replace(" ", "-")
    else:
        device_name = "cpu"
    date = datetime.date.today().isoformat()
    import torch
    import transformers

    meta = {
        "date": date,
        "device": device_name,
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "family": a.family,
        "vocab": vocab,
        "image_side": a.side,
        "video_frames": a.video,
        "completion": a.completion,
        "G": a.g,
        "prompts_per_step": 2,
        "steps": a.steps,
        "warmup": a.warmup,
        "quick": a.quick,
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
        "command": "python benchmarks/memory_engine.py " + " ".join(sys.argv[1:]),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    family_tag = ("" if a.family == "qwen2.5-vl" else f"_{a.family}") + (f"_video{a.video}" if a.video else "")
    stem = out / f"memory_engine_{device_name}_{date}{family_tag}{'_quick' if a.quick else ''}"
    profiles = profile_rows(a, [selected_rows(a.rows)[0], selected_rows(a.rows)[-1]], cmd_for) if a.profile else {}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": results, "summary": summary, "profiles": profiles}, indent=2))
    peak_label = "GPU peak allocated (GiB)" if a.device.startswith("cuda") else "peak RSS (GiB)"
    md = [
        f"# Memory engine, part by part ({device_name}, {date})",
        "",
        f"`{meta['command']}` — torch {meta['torch']}, transformers {meta['transformers']}, {meta['cpu_count']} CPUs.",
        f"Tiny {FAMILIES[a.family]}, vocab {vocab:,}, "
        + (f"one {a.video}-frame {a.side}x{a.side} video per prompt (a video counts as one vision image)" if a.video else f"{a.side}x{a.side} images")
        + f", completion {a.completion} (forced), G={a.g}, "
        f"2 prompts/step, fp32; median of {a.steps} steps after {a.warmup} warm-up.",
        "",
        f"| configuration | step (s) | rollout (s) | update (s) | {peak_label} | peak over loaded model (GiB) | vision images / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        md.append(
            f"| {r['name']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['update_s']:.2f} | "
            f"{r[peak_key]:.2f} | {r['peak_over_load_gib']:.2f} | {r['vision_images_per_step']:.0f} |"
        )
    md += [
        "",
        f"All on vs all off: peak x{summary['peak_ratio_all_on_vs_off']:.2f} (over the loaded model: "
        f"x{summary['peak_over_load_ratio_all_on_vs_off']:.2f}), "
        f"step time x{summary['step_time_ratio_all_on_vs_off']:.2f}; vision images per step with all on: "
        f"{summary['vision_images_per_step_all_on']:.0f} (unique prompts: 2).",
        "",
        f"Machine load: {why}. Load after each configuration: " + ", ".join(f"{r['name']} {r['load_after']}" for r in results) + ".",
    ]
    md += profile_md(profiles) if profiles else []
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
