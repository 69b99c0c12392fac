"""`make demo`: tiny Qwen2.5-VL -> synthetic counting data -> SFT warm start -> GRPO -> before/after.

Everything runs on a CPU in minutes and is seeded: the same machine gives the same figures.
The task: "How many red shapes are there in the image?" with 1-4 shapes on a black or white background.
SFT is kept deliberately short: it teaches the answer format (`<answer>N</answer>`) but stops before
the model can count (held-out accuracy at chance, 25%). GRPO then has to learn counting from the
accuracy reward alone; supervised targets are never shown to it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from vlmrl.config import load_config
from vlmrl.tiny_models.tiny import default_model_path
from vlmrl.sft import sft
from vlmrl.train import train
import datetime
import os
import platform
import torch

# The demo's settings, as overrides of the default config.
COMMON = [
    "data.task=count",
    "data.task_train_size=2000",
    "data.task_test_size=200",
    "data.task_image_size=56",
    "data.min_pixels=3136",
    "data.max_pixels=3136",
    "data.task_distractors=false",
    "data.task_colours=[red]",
    "training.seed=0",
    "training.eval_batch_size=50",
    "rollout.max_completion_length=8",
    "algorithm.reward_funcs=[accuracy, answer_format]",
    "logging.progress_bar=true",
]
SFT = [
    "sft.projector_steps=20",
    "sft.projector_learning_rate=3e-3",
    "sft.steps=25",
    "sft.learning_rate=1e-3",
    "sft.train_vision_tower=true",
    "sft.batch_size=32",
]
GRPO = [
    "rollout.num_generations=8",
    "training.per_device_train_batch_size=32",
    "rollout.generation_batch_size=64",
    "training.gradient_accumulation_steps=2",
    "training.max_steps=200",
    "optim.learning_rate=3e-4",
    "algorithm.loss_type=grpo",
    "algorithm.beta=0.0",
    "training.val_before_train=true",
    "rollout.temperature=1.0",
    "training.eval_steps=25",
]
QUICK = ["sft.projector_steps=2", "sft.steps=2", "training.max_steps=2", "data.task_test_size=20"]


def run_demo(output_dir: str = "outputs/demo", quick: bool = False) -> dict:
    from vlmrl.run.report import summary_table

    out = Path(output_dir)
    extra = QUICK if quick else []
    t0 = time.perf_counter()
    print(f"[demo] embedded tiny Qwen2.5-VL at {default_model_path()}")

    # A demo run again starts over: overwrite_output_dir deletes the earlier demo's runs (and only vlmrl run folders).
    sft_cfg = load_config(None, COMMON + SFT + extra + [f"training.output_dir={out / 'sft'}", "training.overwrite_output_dir=true"])
    print("[demo] SFT warm start (stage 1: projector only, stage 2: language model + vision tower)")
    sft_metrics = sft(sft_cfg)
    t_sft = time.perf_counter()

    grpo_cfg = load_config(
        None,
        COMMON
        + GRPO
        + extra
        + [
            f"training.output_dir={out / 'grpo'}",
            f"model.name_or_path={out / 'sft' / 'final'}",
            f"data.train_path={out / 'sft' / 'data' / 'count' / 'train.jsonl'}",
            f"data.eval_path={out / 'sft' / 'data' / 'count' / 'test.jsonl'}",
            "training.overwrite_output_dir=true",  # SFT just trained a new start model: GRPO starts over too
        ],
    )
    print("[demo] GRPO from the SFT model")
    grpo_metrics = train(grpo_cfg)
    t_end = time.perf_counter()

    before = sft_metrics.get("eval/accuracy", float("nan"))
    after = grpo_metrics.get("eval/accuracy", float("nan"))
    rows = [
        ("held-out accuracy after SFT (before GRPO)", f"{100 * before:.1f}%"),
        ("held-out accuracy after GRPO", f"{100 * after:.1f}%"),
        ("gain (points)", f"{100 * (after - before):+.1f}"),
        ("answer format after GRPO", f"{100 * grpo_metrics.get('eval/answer_format', float('nan')):.1f}%"),
        ("SFT time", f"{t_sft - t0:.0f} s"),
        ("GRPO time", f"{t_end - t_sft:.0f} s"),
        ("report", str(out / "grpo" / "report.png")),
    ]
    summary_table(rows, title="vlmrl demo: counting shapes, tiny Qwen2.5-VL, CPU")
    result = {
        "before": before,
        "after": after,
        "sft_seconds": t_sft - t0,
        "grpo_seconds": t_end - t_sft,
        "eval_accuracy_by_step": eval_trajectory(out / "grpo"),
        **machine(),
    }
    (out / "demo_result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"[demo] figures in {out / 'demo_result.json'} (the README's come from benchmarks/results/demo_cpu.json)")
    return result


def eval_trajectory(run_dir: Path) -> dict[str, float]:
    """Held-out accuracy per GRPO step (step 0 = before GRPO), from the run's eval.jsonl."""
    out = {}
    for line in (run_dir / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/accuracy" in row:
            out[str(row["step"])] = row["eval/accuracy"]
    return out


def machine() -> dict:

    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "load_average": round(os.getloadavg()[0], 2),  # at the end of the run: the times are not a quiet machine's above cpus
    }


def figures_markdown(result: dict) -> str:
    """The README's demo figures, rendered from a demo_result.json (scripts/update_reference.py writes them in)."""
    steps = sorted(result["eval_accuracy_by_step"], key=int)
    trajectory = ", ".join(f"{100 * result['eval_accuracy_by_step'][s]:.1f}" for s in steps)
    minutes, seconds = divmod(round(result["sft_seconds"] + result["grpo_seconds"]), 60)
    return (
        f"Measured on a {result['cpus']}-core {result['device'].upper()} machine ({result['date']}, seeded, `make demo`; "
        f"torch {result['torch']}, transformers {result['transformers']}):\n\n"
        "| | held-out accuracy |\n|---|---|\n"
        f"| after SFT (before GRPO) | {100 * result['before']:.1f}% |\n"
        f"| after GRPO | {100 * result['after']:.1f}% |\n\n"
        f"Eval accuracy at GRPO steps {'/'.join(steps)}: {trajectory}%. "
        f"SFT + GRPO took {minutes} min {seconds} s (SFT {result['sft_seconds']:.0f} s, GRPO {result['grpo_seconds']:.0f} s){shared_note(result)}.\n"
    )


def shared_note(result: dict) -> str:
    """', on a machine shared with other jobs (load average 6.1 on 2 cores)' when the run's load was above its cores."""
    load = result.get("load_average")
    return f", on a machine shared with other jobs (load average {load:.1f} on {result['cpus']} cores)" if load and load > result["cpus"] else ""
