#!/usr/bin/env python
"""DAPO dynamic sampling on the demo task (issue 39 part 1): GRPO with and without algorithm.dynamic_sampling from the
same SFT warm start, held-out accuracy per evaluated step against steps, wall-clock and completions generated.

    python benchmarks/dynamic_sampling.py                          # demo settings, --steps GRPO steps each; results file
    python benchmarks/dynamic_sampling.py --steps 4 --eval-steps 2 --test-size 20   # a smoke run

The demo (src/vlmrl/demo.py: the count task, the embedded tiny Qwen2.5-VL, SFT that teaches the answer format but
not counting) with its GRPO settings, except max_steps (--steps), eval_steps (--eval-steps) and the held-out rows
(--test-size). Both runs start from the one SFT model and share every seed; the dynamic run adds
algorithm.dynamic_sampling=true with dynamic_sampling_max_batches=--max-batches. Step time comes from the runs'
metrics.jsonl (time/step: rollout, rewards, refill, scoring, update; evaluation left out), so the comparison holds
whatever the evaluation costs; on a shared machine the times carry its load, which the results file records.

Writes benchmarks/results/dynamic_sampling_cpu_<date>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vlmrl.config import load_config  # noqa: E402 (src/ on the path first)
from vlmrl.demo import COMMON, GRPO, SFT  # noqa: E402
from vlmrl.sft import sft  # noqa: E402
from vlmrl.train import train  # noqa: E402


def cpu_model() -> str:
    out = subprocess.run(["grep", "-m1", "model name", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    return out.split(":", 1)[1].strip() if ":" in out else "unknown"


def run_grpo(name: str, out: Path, common: list[str], extra: list[str]) -> dict:
    """One GRPO run from the SFT model; per step its time and completions, per evaluation its accuracy."""
    folder = out / name
    cfg = load_config(
        None,
        common
        + extra
        + [
            f"training.output_dir={folder}",
            f"model.name_or_path={out / 'sft' / 'final'}",
            f"data.train_path={out / 'sft' / 'data' / 'count' / 'train.jsonl'}",
            f"data.eval_path={out / 'sft' / 'data' / 'count' / 'test.jsonl'}",
            "training.overwrite_output_dir=true",
            "logging.progress_bar=false",
            "logging.report=false",
        ],
    )
    start = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - start
    per_generation = cfg.generation_batch_size
    steps, elapsed, generated = [], 0.0, 0
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        elapsed += row["time/step"]
        generated += per_generation + int(row.get("dynamic_sampling/extra_rollouts", 0))
        steps.append(
            {
                "step": row["step"],
                "seconds": round(elapsed, 2),
                "completions": generated,
                "reward": row["reward"],
                "frac_reward_zero_std": row["frac_reward_zero_std"],
                **{k.split("/", 1)[1]: row[k] for k in row if k.startswith("dynamic_sampling/")},
            }
        )
    evals = {}
    for line in (folder / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/accuracy" in row:
            evals[row["step"]] = row["eval/accuracy"]
    return {"name": name, "overrides": extra, "wall_seconds": round(wall, 1), "steps": steps, "eval_accuracy": evals}


def first_reaching(run: dict, target: float) -> dict | None:
    """The first evaluated step at or above `target`, with the step time and completions spent up to it."""
    by_step = {s["step"]: s for s in run["steps"]}
    for step, acc in sorted(run["eval_accuracy"].items()):
        if acc >= target - 1e-9:
            spent = by_step.get(step, {"seconds": 0.0, "completions": 0})
            return {"step": step, "accuracy": acc, "seconds": spent["seconds"], "completions": spent["completions"]}
    return None


def markdown(result: dict) -> str:
    base, dyn = result["runs"]
    lines = [
        f"# Dynamic sampling on the demo task ({result['date']})",
        "",
        f"Command: `{result['command']}`  ",
        f"CPU: {result['cpu']} ({result['cpus']} cores, load average {result['load_before']} before, {result['load_after']} after: "
        "shared with other jobs)  ",
        f"torch {result['torch']}, transformers {result['transformers']}; figures in `{result['json']}`.",
        "",
        "Held-out accuracy (eval/accuracy, greedy) per evaluated GRPO step; seconds = summed step times (no evaluation),",
        "completions = completions generated up to that step (extra generation batches included):",
        "",
        "| step | baseline acc | baseline s | baseline completions | dynamic acc | dynamic s | dynamic completions |",
        "|---|---|---|---|---|---|---|",
    ]
    b_steps, d_steps = ({s["step"]: s for s in r["steps"]} for r in (base, dyn))
    for step in sorted(set(base["eval_accuracy"]) | set(dyn["eval_accuracy"])):
        b, d = b_steps.get(step, {}), d_steps.get(step, {})
        lines.append(
            f"| {step} | {100 * base['eval_accuracy'].get(step, float('nan')):.1f}% | {b.get('seconds', 0):.0f} | {b.get('completions', 0)} "
            f"| {100 * dyn['eval_accuracy'].get(step, float('nan')):.1f}% | {d.get('seconds', 0):.0f} | {d.get('completions', 0)} |"
        )
    filtered = sum(s.get("filtered_groups", 0) for s in dyn["steps"])
    extra = sum(s.get("extra_batches", 0) for s in dyn["steps"])
    filled = sum(s.get("filled_groups", 0) for s in dyn["steps"])
    zero_std = sum(s["frac_reward_zero_std"] for s in base["steps"]) / max(1, len(base["steps"]))
    lines += [
        "",
        f"Baseline: on average {100 * zero_std:.0f}% of each step's groups had equal rewards (no gradient).",
        f"Dynamic: {filtered:.0f} groups filtered, {extra:.0f} extra generation batches, {filled:.0f} filtered groups used to fill "
        f"(steps where the batches ran out) over {len(dyn['steps'])} steps.",
        "",
        f"Target accuracy {100 * result['target']:.1f}% (the baseline's best): {result['verdict']}",
        "",
        f"Reading: {reading(result)}",
        "",
    ]
    return "\n".join(lines)


def reading(result: dict) -> str:
    """The results' reading, computed from the runs: per accuracy level above the start that either run reached, the
    first evaluated step of each; the completions each spent in all; how far the load moved during the runs."""
    base, dyn = result["runs"]
    start = base["eval_accuracy"][min(base["eval_accuracy"])]
    levels = sorted({a for r in (base, dyn) for a in r["eval_accuracy"].values() if a > start + 1e-9})
    parts = []
    for level in levels:
        b, d = first_reaching(base, level), first_reaching(dyn, level)
        steps = {name: (f"step {r['step']}" if r else "not reached") for name, r in (("baseline", b), ("dynamic", d))}
        parts.append(f"{100 * level:.1f}%: baseline {steps['baseline']}, dynamic {steps['dynamic']}")
    if parts:
        reached = "First evaluated step at or above each accuracy reached (greedy, held-out): " + "; ".join(parts) + "."
    else:
        reached = f"Neither run rose above the starting {100 * start:.1f}% within {len(base['steps'])} steps, so no accuracy was reached sooner."
    spent = {r["name"]: r["steps"][-1]["completions"] for r in (base, dyn)}
    ratio = spent["dynamic"] / max(1, spent["baseline"])
    load = (result["load_before"], result["load_after"])
    rows = result.get("test_size", "the")  # results written before the field: "the held-out rows"
    shared = (
        f"the load average went from {load[0]} to {load[1]} on {result['cpus']} cores, so the step seconds carry other jobs' work"
        if max(load) > 0.5 * result["cpus"]
        else f"the load average stayed at or below {max(load)} on {result['cpus']} cores"
    )
    return (
        f"{reached} Over {len(dyn['steps'])} steps the dynamic run generated {spent['dynamic']} completions against the "
        f"baseline's {spent['baseline']} ({ratio:.2f}x); {shared}; the completions generated are the load-free cost. "
        f"One seed: each evaluated accuracy is one greedy pass over {rows} held-out rows, so a step's figure is not an average."
    )


def verdict(base: dict, dyn: dict, target: float) -> str:
    start = base["eval_accuracy"].get(min(base["eval_accuracy"]))
    finals = f"final accuracy: baseline {100 * _last(base):.1f}%, dynamic {100 * _last(dyn):.1f}%"
    if target <= start:
        return (
            f"the baseline never rose above its starting {100 * start:.1f}% within the steps run, so there is no accuracy to reach sooner; {finals}."
        )
    b, d = first_reaching(base, target), first_reaching(dyn, target)
    if d is None:
        return "the dynamic run did not reach it within the steps run."
    if b is None:
        return f"only the dynamic run reached it (step {d['step']})."
    faster = "fewer" if d["step"] < b["step"] else ("as many" if d["step"] == b["step"] else "more")
    return (
        f"baseline at step {b['step']} ({b['seconds']:.0f} s of steps, {b['completions']} completions), dynamic at step "
        f"{d['step']} ({d['seconds']:.0f} s, {d['completions']} completions): {faster} steps, "
        f"{'less' if d['seconds'] < b['seconds'] else 'more'} step time, {'fewer' if d['completions'] < b['completions'] else 'more'} completions."
    )


def _last(run: dict) -> float:
    return run["eval_accuracy"][max(run["eval_accuracy"])]


def render(json_path: Path) -> None:
    """The .md of a results JSON again (the verdict recomputed)."""
    result = json.loads(json_path.read_text())
    for run in result["runs"]:
        run["eval_accuracy"] = {int(k): v for k, v in run["eval_accuracy"].items()}
    result["verdict"] = verdict(*result["runs"], result["target"])
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    json_path.with_suffix(".md").write_text(markdown(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--test-size", type=int, default=100)
    parser.add_argument("--max-batches", type=int, default=4)
    parser.add_argument("--out-dir", default="outputs/bench_dynamic_sampling")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--reuse-sft", action="store_true", help="keep --out-dir's SFT model (same --test-size) instead of training it again")
    parser.add_argument("--render", metavar="JSON", help="only write the .md of an earlier results JSON")
    args = parser.parse_args()
    if args.render:
        render(Path(args.render))
        return 0
    import torch
    import transformers

    out = Path(args.out_dir)
    load_before = round(os.getloadavg()[0], 2)
    common = COMMON + [f"data.task_test_size={args.test_size}", "logging.progress_bar=false"]
    if not (args.reuse_sft and (out / "sft" / "final").is_dir()):
        sft(load_config(None, common + SFT + [f"training.output_dir={out / 'sft'}", "training.overwrite_output_dir=true"]))
    grpo = GRPO + [f"training.max_steps={args.steps}", f"training.eval_steps={args.eval_steps}"]
    runs = [
        run_grpo("baseline", out, common, grpo),
        run_grpo("dynamic", out, common, grpo + ["algorithm.dynamic_sampling=true", f"algorithm.dynamic_sampling_max_batches={args.max_batches}"]),
    ]
    target = max(runs[0]["eval_accuracy"].values())
    date = _dt.date.today().isoformat()
    stem = f"dynamic_sampling_cpu_{date}"
    json_path = Path(args.results) / f"{stem}.json"
    result = {
        "date": date,
        "command": "python benchmarks/dynamic_sampling.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "json": str(json_path.relative_to(ROOT)) if json_path.is_relative_to(ROOT) else str(json_path),
        "target": target,
        "test_size": args.test_size,
        "verdict": verdict(runs[0], runs[1], target),
        "runs": runs,
    }
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    json_path.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
