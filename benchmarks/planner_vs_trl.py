"""The planner's trainer profiles (`vlmrl plan --profile naive|trl`) against TRL GRPOTrainer's measured peak RSS on CPU.

    python benchmarks/planner_accuracy.py trl                        # configs a,b,c,d; TRL from /work/venv-extras or --python
    python benchmarks/planner_accuracy.py trl --only a --python /path/to/python-with-trl

For each configuration, `benchmarks/vs_trl.py`'s own preparation builds the tiny Qwen2.5-VL folder and the data (the
same model and work as the vlmrl-vs-TRL benchmark), then one fresh process of a Python that has TRL (the `bench`
extra) does what `vlmrl train` does for itself on CPU: it imports the libraries, measures its RSS (the runtime term),
plans the step with the planner (profiles naive and trl; vlmrl's own for reference), runs TRL's GRPOTrainer
(`vs_trl.run_trl`: fp32, CPU, all completions in one micro-batch, beta 0.04) for warm-up + measured steps, and
reads its lifetime peak RSS (VmHWM). Written to benchmarks/results/planner_accuracy_trl_cpu_<date>.json/.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DEFAULT_PYTHON = "/work/venv-extras/bin/python"

# vs_trl.py's a, b, c plus a larger-vocabulary, longer one (d) and a near-empty one (t: tensors of a few MB, so its
# peak RSS is the TRL process's libraries and buffers: what the runtime term must cover).
EXTRA = {
    "t": dict(title="near-empty: 4 image tokens, completion 4, G=2, one prompt", image=56, vocab=None, completion=4, G=2, prompts=1),
    "d": dict(title="vocabulary 151,936, completion 128, G=4, 64 image tokens", image=224, vocab=151_936, completion=128, G=4, prompts=2),
}
STEPS = {"warmup": 1, "steps": 2}


def _vs_trl():
    sys.path.insert(0, str(BENCH))
    import vs_trl

    return vs_trl


def workload_for_spec(spec: dict, prompt_text_tokens: int, runtime_bytes: int, profile: str):
    """The planner's Workload of vs_trl's TRL side: fp32, no autocast, full fine-tuning, one micro-batch of all
    completions, one optimizer step per step, beta > 0 with the reference on the device (here: the CPU)."""
    from vlmrl.plan.planner import Workload

    rows = spec["prompts"] * spec["G"]
    return Workload(
        dtype=spec.get("dtype", "float32"),
        autocast=False,
        num_generations=spec["G"],
        prompts_per_step=spec["prompts"],
        micro_batch=rows,
        grad_accum=1,
        prompt_text_tokens=prompt_text_tokens,
        max_pixels=spec["pixels"],
        completion_tokens=spec["completion"],
        beta=spec["beta"],
        num_iterations=1,
        device="cpu",
        host_runtime_bytes=runtime_bytes,
        profile=profile,
    )


def child(spec_path: str, result_path: str) -> int:
    """In a Python with TRL: runtime RSS after the imports, the plans, then TRL's run and its peak RSS."""
    sys.path.insert(0, str(ROOT / "src"))
    import datasets  # noqa: F401  (imported now: part of the runtime term, as TRL's run needs it)
    import torch
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401

    from vlmrl.engine.memory import host_peak_rss, host_rss
    from vlmrl.plan.profiles import TRAINER_CPU_RUNTIME_BYTES
    from vlmrl.plan.planner import GiB, image_tokens, plan, spec_from_hf_config

    vs_trl = _vs_trl()
    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(spec["seed"])
    # As `vlmrl train` does on CPU: the RSS now, at least the runtime floor (libraries the run imports later).
    measured_runtime = int(host_rss() * GiB)
    runtime = max(measured_runtime, TRAINER_CPU_RUNTIME_BYTES)
    mspec = spec_from_hf_config(spec["model"])
    prompt_tokens = spec["prompt_tokens"]  # counted by the parent (vlmrl's processor; vs_trl checks TRL's are equal)
    text = prompt_tokens - image_tokens(mspec, spec["pixels"])
    plans = {p: plan(mspec, workload_for_spec(spec, text, runtime, p)) for p in ("naive", "trl", "vlmrl")}
    t0 = time.perf_counter()
    out = Path(result_path).parent
    result = vs_trl.run_trl(spec, out)
    measured = host_peak_rss()
    record = {
        "config": spec["name"],
        "title": spec["title"],
        "measured_peak_rss_gib": round(measured, 4),
        "runtime_at_prediction_gib": round(runtime / GiB, 4),
        "rss_at_prediction_gib": round(measured_runtime / GiB, 4),
        "prompt_tokens": prompt_tokens,
        "prompt_text_tokens": text,
        "tokens_per_step": [s["tokens"] for s in result["per_step"]],
        "trl_settings": result["settings"],
        "seconds": round(time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(),
    }
    for name, p in plans.items():
        predicted = p.host["process_peak"] / GiB
        record[name] = {
            "predicted_peak_rss_gib": round(predicted, 4),
            "predicted_tensors_gib": round(p.peak_allocated / GiB, 4),
            "difference_pct": round(100 * (predicted / measured - 1), 2),
            "above_runtime_difference_pct": round(100 * ((predicted - runtime / GiB) / (measured - runtime / GiB) - 1), 2),
            "phases_gib": {k: round(v / GiB, 4) for k, v in p.phases.items()},
            "terms_gib": {k: round(v / GiB, 4) for k, v in p.terms.items() if v},
        }
    Path(result_path).write_text(json.dumps(record, indent=1))
    return 0


def run(names: list[str], python: str, work: Path, rounds: int = 1) -> list[dict]:
    """One fresh TRL process per config and round (peak RSS of identical work varies between processes)."""
    vs_trl = _vs_trl()
    table = {**vs_trl.CONFIGS, **EXTRA}
    rows = []
    for name, rnd in ((n, r) for n in names for r in range(rounds)):
        spec = vs_trl.prepare(name, table[name], work)
        spec.update(**STEPS, device="cpu", dtype="float32", vlmrl_overrides=[])
        spec["prompt_tokens"] = vs_trl._vlmrl_prompt_tokens(spec)
        spec_path = work / f"config_{name}" / "planner_spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        result = work / f"config_{name}" / f"planner_trl_r{rnd}" / "result.json"
        result.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop("GLIBC_TUNABLES", None)  # glibc defaults, as vs_trl's headline runs
        env["PYTHONPATH"] = str(ROOT / "src")
        cmd = [python, str(BENCH / "planner_accuracy.py"), "_trl_child", "--spec", str(spec_path), "--result", str(result)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        (result.parent / "log.txt").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
        if proc.returncode != 0 or not result.is_file():
            raise RuntimeError(f"config {name}: TRL run failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
        rows.append({**json.loads(result.read_text()), "round": rnd})
    return rows


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """Rows of an earlier run of the same day for configs this run did not measure, then this run's."""
    done = {r["config"] for r in new}
    return sorted([r for r in old if r["config"] not in done] + new, key=lambda r: (r["config"], r.get("round", 0)))


def _short(command: str) -> str:
    """The command without its --note text (the note is printed once, below the table)."""
    import re

    return re.sub(r" --note ('[^']*'(\"'\"'[^']*')*'?|\S+)", " --note ...", command)


def markdown(rows: list[dict], date: str, machine: str, command: str, note: str | None) -> str:
    lines = [
        f"# Planner profiles vs TRL GRPOTrainer's measured peak RSS on CPU ({date}, {machine})",
        "",
        f"Command: `{_short(command)}`. Each row: one fresh process of TRL 1.16's GRPOTrainer (`benchmarks/vs_trl.py`'s TRL side: "
        f"tiny Qwen2.5-VL, fp32, CPU, all completions in one micro-batch, beta 0.04 with a reference model, glibc defaults) "
        f"for {STEPS['warmup']} + {STEPS['steps']} steps; the prediction is made in that process before the model loads, "
        "from its RSS after the imports (the runtime term) plus the planned host terms, like `vlmrl train` predicts itself "
        "on CPU (the runtime term: that RSS, at least the TRL runtime floor `plan_profiles.TRAINER_CPU_RUNTIME_BYTES`, 0.56 GiB). "
        "Measured: the process's lifetime peak RSS (VmHWM). Target (issue 13): +/-15%. The vlmrl column is vlmrl's plan of the "
        "same work with this process's runtime term (not a measurement; vlmrl's own runs are in vs_trl_cpu_*.md).",
        "",
        "| config (round) | measured peak RSS GiB | runtime term GiB | naive GiB | naive diff | trl GiB | trl diff | "
        "trl above runtime | vlmrl profile GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n, t, v = r["naive"], r["trl"], r["vlmrl"]
        lines.append(
            f"| {r['config']} ({r.get('round', 0) + 1}): {r['title']} | {r['measured_peak_rss_gib']:.3f} | {r['runtime_at_prediction_gib']:.3f} | "
            f"{n['predicted_peak_rss_gib']:.3f} | {n['difference_pct']:+.1f}% | {t['predicted_peak_rss_gib']:.3f} | "
            f"{t['difference_pct']:+.1f}% | {t['above_runtime_difference_pct']:+.1f}% | {v['predicted_peak_rss_gib']:.3f} |"
        )
    ok = lambda k: sum(abs(r[k]["difference_pct"]) <= 15 for r in rows)  # noqa: E731
    lines += ["", f"Within +/-15% (runs): naive {ok('naive')} of {len(rows)}, trl {ok('trl')} of {len(rows)}."]
    commands = sorted({_short(r.get("command")) for r in rows if r.get("command")})
    if len(commands) > 1:
        lines += ["", "Rows come from these commands (same day, merged by config): " + "; ".join(f"`{c}`" for c in commands)]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"
