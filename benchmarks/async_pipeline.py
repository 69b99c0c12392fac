#!/usr/bin/env python
"""The rollout pipeline (rollout.max_staleness, issue 36) against the synchronous loop on CPU, at equal work: the
demo task's GRPO from one SFT warm start, the same steps and samples per step, one thread per process (the trainer;
with k > 0 also the producer process), k = 0 (synchronous) and each k of --staleness.

    python benchmarks/async_pipeline.py                                  # the demo's 200 steps, eval every 25; results file
    python benchmarks/async_pipeline.py --steps 6 --eval-steps 3 --test-size 20   # a smoke run

Per run: steps per second of step time (time/step summed from metrics.jsonl: for k > 0 the trainer's wait for the
producer is in it, the producer's generation overlapping the update is not), the run's wall time (model loading,
producer start and evaluations included), the staleness logged (staleness/mean, /max) and the held-out greedy
accuracy per evaluation. The throughput ratio is the synchronous run's summed step time over the pipelined run's.

Writes benchmarks/results/async_pipeline_cpu_<date>.json and .md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process: the producer process inherits it

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vlmrl.config import load_config  # noqa: E402 (src/ on the path first)
from vlmrl.demo import COMMON, GRPO, SFT  # noqa: E402
from vlmrl.sft import sft  # noqa: E402
from vlmrl.train import train  # noqa: E402


def cpu_model() -> str:
    out = subprocess.run(["grep", "-m1", "model name", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    return out.split(":", 1)[1].strip() if ":" in out else "unknown"


def run_grpo(k: int, out: Path, common: list[str]) -> dict:
    """One GRPO run from the SFT model with rollout.max_staleness=k: its step times, staleness and accuracies."""
    folder = out / f"k{k}"
    cfg = load_config(
        None,
        common
        + [
            f"rollout.max_staleness={k}",
            f"training.output_dir={folder}",
            f"model.name_or_path={out / 'sft' / 'final'}",
            f"data.train_path={out / 'sft' / 'data' / 'count' / 'train.jsonl'}",
            f"data.eval_path={out / 'sft' / 'data' / 'count' / 'test.jsonl'}",
            "training.overwrite_output_dir=true",
            "logging.progress_bar=false",
            "logging.report=false",
        ],
    )
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = {}
    for line in (folder / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/accuracy" in row:
            evals[row["step"]] = row["eval/accuracy"]
    step_seconds = sum(r["time/step"] for r in rows)
    return {
        "k": k,
        "steps": len(rows),
        "completions_per_step": cfg.generation_batch_size,
        "step_seconds": round(step_seconds, 2),
        "steps_per_second": round(len(rows) / step_seconds, 4),
        "wall_seconds": round(wall, 1),
        "rollout_seconds": round(sum(r["time/rollout"] for r in rows), 2),
        "update_seconds": round(sum(r["time/update"] for r in rows), 2),
        "producer_generate_seconds": round(sum(r.get("pipeline/generate_seconds", 0.0) for r in rows), 2),
        "collect_wait_seconds": round(sum(r.get("pipeline/collect_seconds", 0.0) for r in rows), 2),
        "push_seconds": round(sum(r.get("pipeline/push_seconds", 0.0) for r in rows), 2),
        "staleness_mean": round(sum(r.get("staleness/mean", 0.0) for r in rows) / len(rows), 3),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
        "final_reward": rows[-1]["reward"],
        "mean_reward_last_25": round(sum(r["reward"] for r in rows[-25:]) / len(rows[-25:]), 4),
        "eval_accuracy": evals,
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def markdown(result: dict) -> str:
    runs = result["runs"]
    base = runs[0]
    lines = [
        f"# Rollout pipeline vs synchronous loop on CPU ({result['date']})",
        "",
        f"Command: `{result['command']}`  ",
        f"CPU: {result['cpu']} ({result['cpus']} cores, shared with other jobs: load average per run below)  ",
        f"torch {result['torch']}, transformers {result['transformers']}; one thread per process; figures in `{result['json']}`.",
        "",
        f"The demo task's GRPO ({base['steps']} steps, {base['completions_per_step']} completions per step, "
        f"{result.get('completion_length') or 'the demo'}'s completion length) from one SFT model; "
        "k = rollout.max_staleness (0: synchronous, one process; k > 0: trainer + producer process).",
        "",
        "| k | step s | steps/s | throughput vs k=0 | wall s | rollout wait s | update s (of it: collect wait, push) "
        "| producer generate s | staleness mean / max | final acc | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        acc = r["eval_accuracy"][max(r["eval_accuracy"], key=int)] if r["eval_accuracy"] else float("nan")
        lines.append(
            f"| {r['k']} | {r['step_seconds']:.0f} | {r['steps_per_second']:.3f} | {base['step_seconds'] / r['step_seconds']:.2f}x "
            f"| {r['wall_seconds']:.0f} | {r['rollout_seconds']:.0f} "
            f"| {r['update_seconds']:.0f}{split_of(r)} "
            f"| {r['producer_generate_seconds']:.0f} "
            f"| {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {100 * acc:.1f}% | {r['load_before']} -> {r['load_after']} |"
        )
    lines += ["", "Held-out accuracy (greedy) per evaluated step:", "", "| step | " + " | ".join(f"k={r['k']}" for r in runs) + " |"]
    lines.append("|---|" + "---|" * len(runs))
    steps = sorted({int(s) for r in runs for s in r["eval_accuracy"]})
    for s in steps:
        cells = [f"{100 * r['eval_accuracy'][s]:.1f}%" if s in r["eval_accuracy"] else "-" for r in runs]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", f"Reading: {reading(result)}", ""]
    return "\n".join(lines)


def split_of(run: dict) -> str:
    """' (collect wait, push)' of a pipelined run's update seconds; empty for k=0 and for results written before them."""
    if not run["k"] or "collect_wait_seconds" not in run:
        return ""
    return f" ({run['collect_wait_seconds']:.0f}, {run['push_seconds']:.0f})"


def reading(result: dict) -> str:
    """Computed from the runs: the throughput ratios, how much of the producer's generation the trainer did not wait
    for (load-free: both sides within one run), and how far the load moved between the runs."""
    runs = result["runs"]
    base = runs[0]
    ratios = ", ".join(f"k={r['k']} {base['step_seconds'] / r['step_seconds']:.2f}x" for r in runs[1:])
    hidden = [
        f"k={r['k']} {100 * (1 - (r['rollout_seconds'] + r['collect_wait_seconds']) / r['producer_generate_seconds']):.0f}%"
        for r in runs[1:]
        if "collect_wait_seconds" in r and r["producer_generate_seconds"] > 0
    ]
    overlap = (
        f" Share of the producer's generation the trainer did not wait for (1 - (rollout wait + collect wait) / generate): {', '.join(hidden)}."
        if hidden
        else ""
    )
    loads = [x for r in runs for x in (r["load_before"], r["load_after"])]
    sync_gen = base["rollout_seconds"]
    return (
        f"Throughput of step time against the synchronous loop at equal work: {ratios}.{overlap} The load average ranged "
        f"{min(loads)}-{max(loads)} on {result['cpus']} cores shared with other jobs and the runs ran one after another, so "
        f"their seconds carry different loads (the synchronous run generated for {sync_gen:.0f} s, the producers for "
        f"{', '.join(str(round(r['producer_generate_seconds'])) for r in runs[1:])} s, the same work): a ratio above 2 with "
        "two processes is load, not overlap. One seed, each accuracy one greedy pass over the held-out rows."
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, default=25)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--staleness", default="1,2", help="the k > 0 to run after k = 0, comma-separated")
    parser.add_argument(
        "--completion-length",
        type=int,
        default=0,
        help="every completion exactly this many tokens (min = max), a generation-heavy step; 0: the demo's",
    )
    parser.add_argument("--out-dir", default="outputs/bench_async_pipeline")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--render", metavar="JSON", help="only write the .md of an earlier results JSON")
    args = parser.parse_args()
    if args.render:
        path = Path(args.render)
        result = json.loads(path.read_text())
        for run in result["runs"]:
            run["eval_accuracy"] = {int(k): v for k, v in run["eval_accuracy"].items()}
        path.with_suffix(".md").write_text(markdown(result))
        return 0
    import torch
    import transformers

    torch.set_num_threads(1)
    out = Path(args.out_dir)
    common = COMMON + [f"data.task_test_size={args.test_size}", "logging.progress_bar=false"]
    sft(load_config(None, common + SFT + [f"training.output_dir={out / 'sft'}", "training.overwrite_output_dir=true"]))
    grpo = GRPO + [f"training.max_steps={args.steps}", f"training.eval_steps={args.eval_steps}"]
    if args.completion_length:
        grpo += [f"rollout.max_completion_length={args.completion_length}", f"rollout.min_completion_length={args.completion_length}"]
    runs = [run_grpo(k, out, common + grpo) for k in [0, *(int(x) for x in args.staleness.split(",") if x)]]
    date = _dt.date.today().isoformat()
    name = f"async_pipeline_cpu_{date}" + (f"_len{args.completion_length}" if args.completion_length else "")
    result = {
        "date": date,
        "command": "python benchmarks/async_pipeline.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "json": f"{name}.json",
        "completion_length": args.completion_length,
        "runs": runs,
    }
    folder = Path(args.results)
    (folder / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
