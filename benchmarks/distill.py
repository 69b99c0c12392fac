#!/usr/bin/env python
"""On-policy distillation on the demo task (issue 39 part 3): does a tiny student distilled from a tiny teacher end
closer to the teacher's held-out accuracy than GRPO alone at the same steps? On CPU.

    python benchmarks/distill.py                        # teacher (demo SFT + GRPO), then the two students
    python benchmarks/distill.py --steps 50 --teacher-steps 125 --out-dir /tmp/distill_bench
    python benchmarks/distill.py --student grpo & python benchmarks/distill.py --student distill; wait
    python benchmarks/distill.py        # the finished runs are resumed as done: only the results file is written

The demo task (vlmrl.demo: count the red shapes, tiny Qwen2.5-VL, SFT warm start that teaches the answer format but
not counting, accuracy at chance). The **teacher** is the demo itself stopped at --teacher-steps GRPO steps (the demo
reaches its 75% at step 125). Both **students** start from the same SFT warm start (the teacher's own, so the same
tokenizer) and run --steps steps of the demo's GRPO settings:
- **grpo**: GRPO alone;
- **distill**: GRPO + on-policy distillation from the teacher (algorithm.teacher_path, distill_coef=--coef, the
  rewards' advantage kept).
The teacher stage resumes from its folder (a checkpoint or a finished run), so it can be stopped and continued.

Writes benchmarks/results/distill_cpu_<date>.json and .md (command, CPU model, held-out accuracy by step).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vlmrl.config import load_config  # noqa: E402 (src/ on the path first)
from vlmrl.demo import COMMON, GRPO, SFT, eval_trajectory  # noqa: E402
from vlmrl.sft import sft  # noqa: E402
from vlmrl.train import train  # noqa: E402


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def grpo_overrides(out: Path, run: Path, steps: int, *extra: str) -> list[str]:
    data = out / "sft" / "data" / "count"
    return [
        *COMMON,
        *GRPO,
        f"training.output_dir={run}",
        f"model.name_or_path={out / 'sft' / 'final'}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.eval_path={data / 'test.jsonl'}",
        f"training.max_steps={steps}",
        "logging.progress_bar=false",
        *extra,
    ]


def stage(name: str, fn) -> float:
    print(f"[distill] {name}", flush=True)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out-dir", default="outputs/distill_bench")
    p.add_argument("--steps", type=int, default=50, help="GRPO steps of each student")
    p.add_argument("--teacher-steps", type=int, default=125, help="GRPO steps of the teacher (after the demo's SFT)")
    p.add_argument("--coef", type=float, default=1.0, help="algorithm.distill_coef")
    p.add_argument("--eval-steps", type=int, default=25)
    p.add_argument("--teacher-only", action="store_true", help="train (or resume) the teacher, then stop")
    p.add_argument("--student", choices=["grpo", "distill"], help="train only this student (then run again without it for the results)")
    p.add_argument("--results", default=None, help="results file stem (default benchmarks/results/distill_cpu_<date>)")
    a = p.parse_args()
    out = Path(a.out_dir)
    times = {}
    if not (out / "sft" / "final" / "config.json").exists():
        cfg = load_config(None, [*COMMON, *SFT, f"training.output_dir={out / 'sft'}", "logging.progress_bar=false"])
        times["sft"] = stage("SFT warm start (the demo's)", lambda: sft(cfg))
    teacher_run = out / "grpo"  # the demo's layout (out/sft, out/grpo): a `make demo` folder can be the teacher
    teacher_cfg = load_config(None, grpo_overrides(out, teacher_run, a.teacher_steps))
    if not (teacher_run / "final" / "config.json").exists():  # a finished run is not trained again
        times["teacher"] = stage(f"teacher: GRPO to step {a.teacher_steps} (resumes)", lambda: train(teacher_cfg))
    if a.teacher_only:
        return
    teacher = teacher_run / "final"
    runs = {
        "grpo": [],
        "distill": [f"algorithm.teacher_path={teacher}", f"algorithm.distill_coef={a.coef}"],
    }
    for name, extra in runs.items():
        if a.student not in (None, name) or (out / "students" / name / "bench_seconds.json").exists():
            continue
        cfg = load_config(None, grpo_overrides(out, out / "students" / name, a.steps, f"training.eval_steps={a.eval_steps}", *extra))
        times[name] = stage(f"student {name}: {a.steps} steps", lambda cfg=cfg: train(cfg))
        (out / "students" / name / "bench_seconds.json").write_text(json.dumps(times[name]))
    if a.student is not None:  # one student per process (run both side by side, then once more without --student)
        return
    result = {
        "date": _dt.date.today().isoformat(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_average_end": round(os.getloadavg()[0], 2),
        "command": "python benchmarks/distill.py " + " ".join(sys.argv[1:]),
        "steps": a.steps,
        "teacher_steps": a.teacher_steps,
        "distill_coef": a.coef,
        "teacher_accuracy_by_step": eval_trajectory(teacher_run),
        "accuracy_by_step": {name: eval_trajectory(out / "students" / name) for name in runs},
        "reverse_kl_by_step": reverse_kl(out / "students" / "distill"),
        "seconds": {k: round(v, 1) for k, v in times.items()}
        | {n: round(json.loads((out / "students" / n / "bench_seconds.json").read_text()), 1) for n in runs if n not in times},
    }
    stem = Path(a.results) if a.results else ROOT / "benchmarks" / "results" / f"distill_cpu_{result['date']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def reverse_kl(run: Path) -> dict[str, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "distill/reverse_kl" in row:
            out[str(row["step"])] = round(row["distill/reverse_kl"], 4)
    return out


def markdown(r: dict) -> str:
    teacher = r["teacher_accuracy_by_step"]
    t_final = teacher[max(teacher, key=int)]
    steps = sorted(r["accuracy_by_step"]["grpo"], key=int)
    rows = "\n".join(
        f"| {s} | {100 * r['accuracy_by_step']['grpo'][s]:.1f}% | {100 * r['accuracy_by_step']['distill'].get(s, float('nan')):.1f}% |" for s in steps
    )
    final = {k: v[max(v, key=int)] for k, v in r["accuracy_by_step"].items()}
    gap = {k: abs(t_final - v) for k, v in final.items()}
    verdict = (
        "closer to the teacher than GRPO alone"
        if gap["distill"] < gap["grpo"]
        else ("as close to the teacher as GRPO alone" if gap["distill"] == gap["grpo"] else "further from the teacher than GRPO alone")
    )
    kl = r["reverse_kl_by_step"]
    kl_steps = sorted(kl, key=int)
    shown = [kl_steps[0], kl_steps[len(kl_steps) // 2], kl_steps[-1]]
    return (
        f"# On-policy distillation on the demo task, CPU ({r['date']})\n\n"
        f"`{r['command']}` on {r['cpus']} cores of an {r['cpu']} (load average {r['load_average_end']} at the end; "
        "the machine was shared, so the times are not a quiet machine's).\n\n"
        f"Teacher: the demo (SFT warm start + {r['teacher_steps']} GRPO steps), held-out accuracy {100 * t_final:.1f}% "
        f"(by step: {', '.join(f'{s}: {100 * v:.1f}%' for s, v in sorted(teacher.items(), key=lambda x: int(x[0])))}).\n"
        f"Students: the same SFT warm start, {r['steps']} steps of the demo's GRPO settings; distill adds "
        f"algorithm.teacher_path (distill_coef={r['distill_coef']}, the rewards' advantage kept).\n\n"
        "| step | GRPO alone | GRPO + distillation |\n|---|---|---|\n"
        f"{rows}\n\n"
        f"After {r['steps']} steps the distilled student is **{verdict}** (gap to the teacher's {100 * t_final:.1f}%: "
        f"GRPO {100 * gap['grpo']:.1f} points, distillation {100 * gap['distill']:.1f} points).\n\n"
        f"distill/reverse_kl (mean over loss tokens of log pi - log pi_teacher on the student's samples) at steps "
        f"{', '.join(shown)}: {', '.join(str(kl[s]) for s in shown)}.\n\n"
        f"Wall time (s): {', '.join(f'{k} {v}' for k, v in r['seconds'].items())}.\n"
    )


if __name__ == "__main__":
    main()
