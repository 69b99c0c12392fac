#!/usr/bin/env python
"""On-policy distillation on the demo task (issue 39 part 3): does a tiny student distilled from a tiny teacher end
closer to the teacher's held-out accuracy than GRPO alone at the same steps? On CPU.

    python benchmarks/distill.py --eval-set probe --seeds 0 --coefs 1,3 --steps 100   # choose settings (not the test split)
    python benchmarks/distill.py --eval-set test --seeds 1,2,3 --coefs 1,3 --steps 100  # the measurement, fixed settings
    python benchmarks/distill.py --render benchmarks/results/distill_cpu_<date>.json  # the .md again from its JSON

The 2026-11-28 results ran each variant in its own process (--only grpo, --only mixed, --only pure side by side, then
the same command with --no-train for the results), with OMP_NUM_THREADS=1: on the shared 2-core machine two torch
threads per process made a GRPO step take 20-60 s instead of about 1-7 s.

The demo task (vlmrl.demo: count the red shapes, tiny Qwen2.5-VL, an SFT warm start that teaches the answer format but
not counting, accuracy at chance). The **teacher** is the demo: the embedded tiny model (seed 0), the demo's SFT, then
--teacher-steps of the demo's GRPO. The **student** is by default the teacher's own start (the demo's SFT model, at
chance: same architecture and tokenizer, before any GRPO); --student-init-seed N > 0 builds a fresh tiny model of the
same architecture and tokenizer with seed N and gives it the same SFT (seed 1's SFT already reaches the teacher's 75%,
so it is not a weaker student). From the student, per training seed, run --steps steps of the demo's GRPO settings:
- **grpo**: GRPO alone;
- **mixed c**: GRPO + on-policy distillation from the teacher (algorithm.teacher_path, distill_coef=c, the rewards'
  advantage kept);
- **pure c**: the teacher's reverse KL alone (distill_with_rewards=false, distill_coef=c).
--eval-set probe evaluates on a separately drawn copy of the task (seed 1, never the test split) for choosing --steps
and --coefs; --eval-set test evaluates on the demo's held-out test split. Every stage resumes (a finished run is kept).

Writes benchmarks/results/distill_cpu_<date>[_probe].json and .md; the .md's tables and reading are computed from
the JSON (markdown()).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vlmrl.config import load_config  # noqa: E402 (src/ on the path first)
from vlmrl.demo import COMMON, GRPO, SFT, eval_trajectory  # noqa: E402
from vlmrl.sft import sft  # noqa: E402
from vlmrl.train import train  # noqa: E402

PROBE_SEED = 1  # the probe set's draw of the task; the demo's train and test splits are seed 0's


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def grpo_overrides(out: Path, start: Path, run: Path, steps: int, eval_path: Path, *extra: str) -> list[str]:
    data = out / "sft" / "data" / "count"
    return [
        *COMMON,
        *GRPO,
        f"training.output_dir={run}",
        f"model.name_or_path={start}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.eval_path={eval_path}",
        f"training.max_steps={steps}",
        "logging.progress_bar=false",
        "logging.report=false",
        *extra,
    ]


def done(run: Path) -> bool:
    return (run / "final" / "config.json").exists()


def build_models(out: Path, a) -> dict[str, float]:
    """The teacher (demo SFT + GRPO), the fresh student's SFT warm start and the probe set; each kept when built."""
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl, mark_embedded

    times = {}
    if not done(out / "sft"):
        cfg = load_config(None, [*COMMON, *SFT, f"training.output_dir={out / 'sft'}", "logging.progress_bar=false"])
        times["teacher_sft"] = timed(lambda: sft(cfg))
    teacher_cfg = load_config(
        None, grpo_overrides(out, out / "sft" / "final", out / "grpo", a.teacher_steps, out / "sft" / "data" / "count" / "test.jsonl")
    )
    if not done(out / "grpo"):
        times["teacher_grpo"] = timed(lambda: train(teacher_cfg))
    if a.student_init_seed == 0:  # the teacher's own start: the embedded model's SFT
        return times
    init = out / f"student_init_seed{a.student_init_seed}"
    if not (init / "config.json").exists():
        build_tiny_qwen25vl(init, seed=a.student_init_seed)
        mark_embedded(init)  # the embedded model's demo defaults apply to it as to the teacher's start
    student_sft = out / f"student_sft_seed{a.student_init_seed}"
    if not done(student_sft):
        cfg = load_config(None, [*COMMON, *SFT, f"model.name_or_path={init}", f"training.output_dir={student_sft}", "logging.progress_bar=false"])
        times["student_sft"] = timed(lambda: sft(cfg))
    return times


def probe_set(out: Path) -> Path:
    """A separate draw of the demo's task (seed 1; the demo's splits are seed 0's) for choosing settings."""
    from vlmrl.data.tasks import make_count_task

    if not (out / "probe" / "test.jsonl").exists():
        make_count_task(out / "probe", n_train=0, n_test=200, seed=PROBE_SEED, image_size=56, colours=("red",), distractors=False)
    return out / "probe" / "test.jsonl"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return round(time.perf_counter() - t0, 1)


def variants(coefs: list[float]) -> dict[str, list[str]]:
    out = {"grpo": []}
    for c in coefs:
        out[f"mixed {c:g}"] = [f"algorithm.distill_coef={c}"]
        out[f"pure {c:g}"] = [f"algorithm.distill_coef={c}", "algorithm.distill_with_rewards=false"]
    return out


def per_step(run: Path, key: str) -> dict[str, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if key in row:
            out[str(row["step"])] = round(row[key], 4)
    return out


def student_start(out: Path, init_seed: int) -> Path:
    return out / "sft" / "final" if init_seed == 0 else out / f"student_sft_seed{init_seed}" / "final"


def run_students(out: Path, a, eval_path: Path) -> dict:
    """{variant: {seed: {accuracy, reverse_kl, seconds}}}: each variant from the fresh student's SFT warm start."""
    start = student_start(out, a.student_init_seed)
    teacher = out / "grpo" / "final"
    runs: dict = {}
    for name, extra in variants(a.coefs).items():
        for seed in a.seeds:
            if a.only and name.split()[0] not in a.only:
                continue
            run = out / "students" / a.eval_set / f"seed{seed}" / name.replace(" ", "_")
            with_teacher = [f"algorithm.teacher_path={teacher}"] if extra else []
            cfg = load_config(
                None,
                grpo_overrides(
                    out, start, run, a.steps, eval_path, f"training.eval_steps={a.eval_steps}", f"training.seed={seed}", *with_teacher, *extra
                ),
            )
            seconds = run / "bench_seconds.json"
            if a.no_train and not seconds.exists():
                continue
            if not seconds.exists():
                print(f"[distill] student {name}, seed {seed}: {a.steps} steps", flush=True)
                seconds.write_text(json.dumps(timed(lambda cfg=cfg: train(cfg))))
            runs.setdefault(name, {})[str(seed)] = {
                "accuracy": eval_trajectory(run),
                "reverse_kl": per_step(run, "distill/reverse_kl"),
                "reward": per_step(run, "rewards/accuracy/mean") or per_step(run, "reward"),
                "seconds": json.loads(seconds.read_text()),
            }
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out-dir", default="outputs/distill_bench")
    p.add_argument("--steps", type=int, default=100, help="GRPO steps of each student")
    p.add_argument("--teacher-steps", type=int, default=200, help="GRPO steps of the teacher (after the demo's SFT)")
    p.add_argument("--coefs", default="1", help="algorithm.distill_coef values, comma-separated")
    p.add_argument("--seeds", default="1,2,3", help="training.seed of the students, comma-separated")
    p.add_argument("--student-init-seed", type=int, default=0, help="seed of a fresh student's random weights; 0: the teacher's own SFT start")
    p.add_argument(
        "--only", default="", help="only these variants (grpo,mixed,pure): run several processes side by side, then one without --only for all"
    )
    p.add_argument("--no-train", action="store_true", help="write the results of the finished runs, train nothing")
    p.add_argument("--setup-only", action="store_true", help="build the teacher (and the fresh student's start), then stop")
    p.add_argument("--eval-set", choices=["probe", "test"], default="test")
    p.add_argument("--eval-steps", type=int, default=25)
    p.add_argument("--results", default=None, help="results file stem (default benchmarks/results/distill_cpu_<date>[_probe])")
    p.add_argument("--render", metavar="JSON", help="only write the .md of an earlier results JSON")
    a = p.parse_args()
    if a.render:
        path = Path(a.render)
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        return
    a.coefs = [float(c) for c in a.coefs.split(",")]
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.only = [v for v in a.only.split(",") if v]
    out = Path(a.out_dir)
    load_start = round(os.getloadavg()[0], 2)
    times = build_models(out, a)
    if a.setup_only:
        return
    eval_path = probe_set(out) if a.eval_set == "probe" else out / "sft" / "data" / "count" / "test.jsonl"
    runs = run_students(out, a, eval_path)
    if "grpo" not in runs or len(runs) < 2:  # nothing to compare yet: the results come from a later call
        return
    teacher = {"on_test": eval_trajectory(out / "grpo")}
    if a.eval_set == "probe":  # the teacher's accuracy on the probe set: one evaluation of its final model
        teacher["on_eval_set"] = evaluate(out / "grpo" / "final", eval_path, out / "teacher_on_probe")
    else:
        teacher["on_eval_set"] = teacher["on_test"][max(teacher["on_test"], key=int)]
    result = {
        "date": _dt.date.today().isoformat(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_average": [load_start, None],
        "command": "python benchmarks/distill.py " + " ".join(sys.argv[1:]),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "eval_set": a.eval_set,
        "steps": a.steps,
        "teacher_steps": a.teacher_steps,
        "student_init_seed": a.student_init_seed,
        "seeds": a.seeds,
        "teacher": teacher,
        "runs": runs,
        "setup_seconds": times,
    }
    result["load_average"][1] = round(os.getloadavg()[0], 2)
    stem = (
        Path(a.results) if a.results else ROOT / "benchmarks" / "results" / f"distill_cpu_{result['date']}{'_probe' if a.eval_set == 'probe' else ''}"
    )
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def evaluate(model: Path, eval_path: Path, folder: Path) -> float:
    """Greedy accuracy of `model` on `eval_path` (vlmrl's own evaluation, the settings the runs evaluate with)."""
    from vlmrl.cli import run_eval  # `vlmrl eval`: writes folder/eval.json

    saved = folder / "eval.json"
    if not saved.exists():
        run_eval(load_config(None, [*COMMON, f"model.name_or_path={model}", f"data.eval_path={eval_path}", f"training.output_dir={folder}"]))
    return json.loads(saved.read_text())["eval/accuracy"]


# ------------------------------------------------------------------------------------------------ the results file


def finals(r: dict) -> dict[str, dict[str, float]]:
    """{variant: {seed: accuracy at the last evaluated step}}."""
    return {name: {s: acc[max(acc, key=int)] for s, v in seeds.items() for acc in [v["accuracy"]]} for name, seeds in r["runs"].items()}


def reading(r: dict) -> str:
    """The reading of a results JSON, computed: per distilled variant, on how many seeds its final gap to the teacher
    is smaller than GRPO alone's on the same seed, the mean gaps, and whether its reverse KL fell on every seed."""
    t = r["teacher"]["on_eval_set"]
    gap = {name: {s: abs(t - acc) for s, acc in seeds.items()} for name, seeds in finals(r).items()}
    mean = {name: statistics.mean(g.values()) for name, g in gap.items()}
    parts = []
    for name in [n for n in gap if n != "grpo"]:
        closer = sum(gap[name][s] < gap["grpo"][s] for s in gap[name])
        same = sum(gap[name][s] == gap["grpo"][s] for s in gap[name])
        fell = all(first > last for v in r["runs"][name].values() for first, last in [kl_pair(v["reverse_kl"])])
        parts.append(
            f"**{name}** ended closer to the teacher than GRPO alone on {closer} of {len(gap[name])} seeds ({same} equal), mean gap "
            f"{100 * mean[name]:.1f} points against GRPO's {100 * mean['grpo']:.1f}; its per-token reverse KL on its own samples "
            f"{'fell' if fell else 'did not fall'} on every seed (mean of the first and of the last 5 steps: {kl_summary(r['runs'][name])})"
        )
    where = "the probe set (a separate draw of the task, for choosing settings)" if r["eval_set"] == "probe" else "the held-out test split"
    return (
        f"Teacher {100 * t:.1f}% on {where}. After {r['steps']} steps: " + "; ".join(parts) + ". "
        f"Each accuracy is one greedy pass over the evaluation rows; {len(r['seeds'])} training seed(s) per variant."
    )


def kl_pair(kl: dict[str, float]) -> tuple[float, float]:
    """Mean reverse KL over the first and over the last 5 logged steps."""
    steps = sorted(kl, key=int)
    return statistics.mean(kl[s] for s in steps[:5]), statistics.mean(kl[s] for s in steps[-5:])


def kl_summary(seeds: dict) -> str:
    return ", ".join(f"seed {s} {first:.3f} -> {last:.3f}" for s, v in seeds.items() for first, last in [kl_pair(v["reverse_kl"])])


def threads(r: dict) -> str:
    """'OMP_NUM_THREADS=1 ' when the call recorded it (results from before the field: nothing)."""
    value = r.get("omp_num_threads")
    return "" if value in (None, "unset") else f"OMP_NUM_THREADS={value} "


def student_words(init_seed: int) -> str:
    if init_seed == 0:
        return (
            "the teacher's own starting point (the embedded tiny Qwen2.5-VL after the demo's SFT, before any GRPO; same architecture and tokenizer)"
        )
    return f"a fresh tiny Qwen2.5-VL of the same architecture and tokenizer (random weights, seed {init_seed}) with the demo's SFT"


def markdown(r: dict) -> str:
    teacher = r["teacher"]["on_test"]
    names = list(r["runs"])
    seeds = [str(s) for s in r["seeds"]]
    steps = sorted({st for v in r["runs"].values() for run in v.values() for st in run["accuracy"]}, key=int)
    head = "| step | " + " | ".join(f"{n} (seed {s})" for n in names for s in seeds) + " |\n|---|" + "---|" * (len(names) * len(seeds))
    rows = "\n".join(
        f"| {st} | " + " | ".join(f"{100 * r['runs'][n][s]['accuracy'].get(st, float('nan')):.1f}%" for n in names for s in seeds) + " |"
        for st in steps
    )
    fin = finals(r)
    t = r["teacher"]["on_eval_set"]
    summary = "\n".join(
        f"| {n} | {', '.join(f'{100 * fin[n][s]:.1f}%' for s in seeds)} | {100 * statistics.mean(fin[n].values()):.1f}% | "
        f"{100 * statistics.mean(abs(t - v) for v in fin[n].values()):.1f} |"
        for n in names
    )
    return (
        f"# On-policy distillation on the demo task, CPU ({r['date']}, evaluated on the {r['eval_set']} set)\n\n"
        f"`{threads(r)}{r['command']}` on {r['cpus']} cores of an {r['cpu']} (load average {r['load_average'][0]} at the start of "
        f"this call, {r['load_average'][1]} at its end; with --only or --no-train the runs were trained by earlier calls).\n\n"
        f"Teacher: the demo (embedded tiny Qwen2.5-VL, seed 0; the demo's SFT; {r['teacher_steps']} GRPO steps), held-out "
        f"test accuracy by GRPO step: {', '.join(f'{s}: {100 * v:.1f}%' for s, v in sorted(teacher.items(), key=lambda x: int(x[0])))}; "
        f"on the evaluation set used below: {100 * t:.1f}%.\n"
        f"Student: {student_words(r['student_init_seed'])}, then {r['steps']} steps of the demo's GRPO settings per "
        "training seed: grpo = GRPO "
        "alone; mixed c = GRPO + reverse KL to the teacher (distill_coef=c); pure c = the reverse KL alone "
        "(distill_with_rewards=false).\n\n"
        "Greedy accuracy on the evaluation set by step:\n\n"
        f"{head}\n{rows}\n\n"
        "Mean over the seeds by step:\n\n"
        "| step | "
        + " | ".join(names)
        + " |\n|---|"
        + "---|" * len(names)
        + "\n"
        + "\n".join(
            f"| {st} | "
            + " | ".join(f"{100 * statistics.mean(r['runs'][n][s]['accuracy'].get(st, float('nan')) for s in seeds):.1f}%" for n in names)
            + " |"
            for st in steps
        )
        + "\n\n"
        "| variant | final accuracy per seed | mean | mean gap to the teacher (points) |\n|---|---|---|---|\n"
        f"{summary}\n\n"
        f"Wall seconds per run (each run's train(), several side by side): "
        + "; ".join(f"{n} " + ", ".join(f"{r['runs'][n][sd]['seconds']:.0f}" for sd in seeds) for n in names)
        + ".\n\n"
        f"Reading (computed from the JSON): {reading(r)}\n"
    )


if __name__ == "__main__":
    main()
