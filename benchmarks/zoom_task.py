#!/usr/bin/env python
"""The zoom task (issue 28 part 5): held-out accuracy of a tiny Qwen2.5-VL with the zoom tool vs without it, on CPU.

    python benchmarks/zoom_task.py                     # ~minutes: task, two SFT runs, evaluation; results file
    python benchmarks/zoom_task.py --quick             # a smoke run (few steps, few rows)

The task (vlmrl.data.tasks.make_zoom_task): a 448x448 black image holds one white square, one seen pixel wide at a
pixel budget of 56x56 (data.max_pixels=3136), with one of its four corners missing; the question is which. The
defaults are the documented setting (docs/tools.md, "A task that needs the tool"): one place (--spots 1: the box to
zoom into is always the same), no jitter, the square in its box's top-left quarter (make_zoom_task's corner_aligned), so the zoomed
box shows it as one image token whose four patches are its four blocks; --spots 4 --jitter 2 --centred is the
earlier, harder setting (the model must also find the square; each block a separate token), at which the tiny model
stayed at chance.

Two models from the embedded tiny Qwen2.5-VL, the same SFT settings and steps:
- **tool**: SFT warm start on expert tool-use traces (the tool call on the right box, the tool's zoomed image, the
  answer: vlmrl.tools.traces.sft_rows, tool turns masked), evaluated with the zoom tool loaded;
- **no tool**: SFT on the direct answers of the same rows, evaluated with no tool.
Both are evaluated by the plain multi-turn loop (vlmrl.models.tool_loop: HF generate turn by turn, greedy) on the
held-out split. --grpo-steps N adds N GRPO steps with the zoom tool (multi-turn rollouts in the continuous engine)
from the tool SFT model, and its evaluation.

Writes benchmarks/results/zoom_task_cpu_<date>.json and .md (with --out-dir's run folders for report.png).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vlmrl.data.tasks import make_zoom_task  # noqa: E402 (src/ on the path first)
from vlmrl.tools.execute import ToolCall, run_tool  # noqa: E402
from vlmrl.tools.context import ToolContext  # noqa: E402
from vlmrl.tools.traces import expert_conversation, image_saver, sft_rows  # noqa: E402

SEEN = 56  # the model sees every image at 56x56 (min_pixels = max_pixels = 56 * 56)
PIXELS = SEEN * SEEN
ZOOM_FACTOR = 4

SFT = [
    f"data.min_pixels={PIXELS}",
    f"data.max_pixels={PIXELS}",
    "training.seed=0",
    "sft.projector_steps=20",
    "sft.projector_learning_rate=3e-3",
    "sft.learning_rate=1e-3",
    "sft.train_vision_tower=true",
    "sft.batch_size=32",
    "logging.progress_bar=false",
    "training.overwrite_output_dir=true",
]


def zoom_call(row: dict) -> ToolCall:
    """The expert's call for a task row: zoom into its box (seen pixels), enlarged ZOOM_FACTOR times."""
    return ToolCall("zoom", {"bbox_2d": list(row["zoom_box"]), "factor": ZOOM_FACTOR})


def seen_size(image) -> tuple[int, int]:
    from vlmrl.data.media import target_size

    return target_size(image.width, image.height, PIXELS, PIXELS)


def tool_rows(rows: list[dict], base: Path, out: Path, call_every: int = 1) -> list[dict]:
    """Expert tool-use SFT rows: per task row the answer after the zoomed image, and for every `call_every`-th row
    also the call. (A call is ~6x the answer's tokens and SFT's loss is a mean over the batch's target tokens: with a
    call row per answer row the answer, the part that needs the image, gets a sixth of the gradient.)"""
    from PIL import Image

    from vlmrl.tools.registry import load_tools

    tools = load_tools(["zoom"])
    saved = []
    for i, row in enumerate(rows):
        path = str((base / row["image"]).resolve())
        image = Image.open(path).convert("RGB")
        context = ToolContext(images=[image], row=row, seen_sizes=[seen_size(image)])
        call = zoom_call(row)
        result = run_tool(tools, call, context)
        if not result.ok:
            raise RuntimeError(f"row {i}: the expert's zoom failed: {result.error}")
        prompt = [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": row["problem"]}]}]
        conversation = expert_conversation(prompt, [call], [result], row["response"])
        call_row, answer_row = sft_rows(conversation, image_saver(out / "zoomed", f"train_{i:05d}"), solution=row["solution"])
        saved += [call_row, answer_row] if i % call_every == 0 else [answer_row]
    return saved


def direct_rows(rows: list[dict], base: Path) -> list[dict]:
    """The same rows answered directly (the no-tool model's SFT data)."""
    return [
        {"image": str((base / r["image"]).resolve()), "problem": r["problem"], "solution": r["solution"], "response": r["response"]} for r in rows
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_sft(train_path: Path, out: Path, steps: int, start: Path | None = None) -> float:
    """SFT from the embedded tiny model, or (`start`) more language steps from an SFT model (no projector stage)."""
    from vlmrl.config import load_config
    from vlmrl.sft import sft

    more = [f"model.name_or_path={start}", "sft.projector_steps=0"] if start else []
    t0 = time.perf_counter()
    sft(load_config(None, SFT + more + [f"sft.steps={steps}", f"data.train_path={train_path}", f"training.output_dir={out}"]))
    return time.perf_counter() - t0


GRPO = [
    f"data.min_pixels={PIXELS}",
    f"data.max_pixels={PIXELS}",
    "data.eval_path=",
    "training.seed=0",
    "rollout.engine=continuous",
    "tools.tools=[zoom]",
    "tools.max_turns=2",
    "tools.max_turn_tokens=96",
    "tools.max_total_tokens=256",
    "rollout.num_generations=8",
    "rollout.generation_batch_size=32",
    "training.per_device_train_batch_size=32",
    "training.gradient_accumulation_steps=1",
    "rollout.temperature=1.0",
    "optim.learning_rate=3e-4",
    "algorithm.loss_type=grpo",
    "algorithm.beta=0.0",
    "algorithm.reward_funcs=[accuracy]",
    "logging.progress_bar=false",
    "training.overwrite_output_dir=true",
]


def run_grpo(model_dir: Path, train_path: Path, out: Path, steps: int) -> dict:
    """GRPO with the zoom tool (multi-turn rollouts in the continuous engine) from the tool SFT model: seconds and the
    last step's tools/* metrics (report.png in `out` draws them)."""
    from vlmrl.config import load_config
    from vlmrl.train import train

    train(
        load_config(
            None,
            GRPO + [f"model.name_or_path={model_dir}", f"data.train_path={train_path}", f"training.output_dir={out}", f"training.max_steps={steps}"],
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tools = {k: v for k, v in rows[-1].items() if k.startswith("tools/")}
    return {"seconds": run_seconds(out), "steps": steps, "last_step_tools": tools, "reward_by_step": [r.get("reward") for r in rows]}


def run_seconds(out: Path) -> float:
    """A finished run's training time from its own files: from the start of its first step to its end (start-up and
    data preparation before the first step not included)."""
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return json.loads((out / "run_complete.json").read_text())["finished"] - first["time"] + first["time/step"]


def reuse_or_run(train_path: Path, out: Path, steps: int, reuse: bool, start: Path | None = None) -> float:
    """SFT seconds (run_seconds): run SFT, or with --reuse take a finished run's model."""
    if not (reuse and (out / "final" / "config.json").is_file() and (out / "run_complete.json").is_file()):
        run_sft(train_path, out, steps, start)
    return run_seconds(out)


def evaluate(model_dir: Path, rows: list[dict], base: Path, with_tool: bool, max_turns: int = 3) -> dict:
    """Held-out accuracy and tool-use figures of one model through the plain multi-turn loop (greedy)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.processing import load_processor
    from vlmrl.models.tool_loop import LoopSettings, run_tool_loop
    from vlmrl.rewards.functions import accuracy
    from vlmrl.tools.environment import ToolEnvironment
    from vlmrl.tools.registry import load_tools

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = load_processor(model_dir, min_pixels=PIXELS, max_pixels=PIXELS)
    tools = load_tools(["zoom"]) if with_tool else {}
    eval_rows = [{**r, "image": str((base / r["image"]).resolve())} for r in rows]
    envs = [ToolEnvironment(tools, max_turns=max_turns, seen_size=seen_size) for _ in eval_rows]
    t0 = time.perf_counter()
    trajectories = run_tool_loop(model, processor, envs, eval_rows, LoopSettings(max_new_tokens=96, batch_size=50))
    seconds = time.perf_counter() - t0
    correct = [accuracy(**t.reward_inputs(), solution=[r["solution"]])[0] or 0.0 for t, r in zip(trajectories, eval_rows)]
    calls = [len(t.tool_calls) for t in trajectories]
    results = [m for t in trajectories for m in t.completion if m["role"] == "tool"]
    ok = [m for m in results if not str(m["content"] if isinstance(m["content"], str) else m["content"][-1].get("text", "")).startswith("tool ")]
    right_box = [
        any(c.name == "zoom" and list(c.arguments.get("bbox_2d", [])) == list(r["zoom_box"]) for c in t.tool_calls)
        for t, r in zip(trajectories, eval_rows)
    ]
    n = len(eval_rows)
    return {
        "rows": n,
        "accuracy": sum(correct) / n,
        "turns_per_rollout": sum(t.num_turns for t in trajectories) / n,
        "tool_calls_per_rollout": sum(calls) / n,
        "rollouts_with_a_call": sum(c > 0 for c in calls) / n,
        "tool_success_rate": (len(ok) / len(results)) if results else None,
        "right_box_rate": sum(right_box) / n,
        "end_reasons": {k: sum(t.end_reason == k for t in trajectories) for k in sorted({t.end_reason for t in trajectories})},
        "eval_seconds": seconds,
        "example_turns": trajectories[0].turn_texts,
    }


def machine() -> dict:
    import platform

    import torch
    import transformers

    return {
        "date": _dt.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "load_1_5_15": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


COLUMNS = (("tool", "tool SFT, with the zoom tool"), ("grpo_tool", "tool SFT + GRPO, with the zoom tool"), ("no_tool", "direct SFT, no tool"))


def columns(result: dict) -> list[tuple[str, dict]]:
    return [(label, result[key]) for key, label in COLUMNS if key in result]


def markdown(result: dict) -> str:
    cols = columns(result)

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def row(name, fmt):
        return f"| {name} | " + " | ".join(fmt(r) for _, r in cols) + " |"

    grpo = result.get("grpo_run")
    lines = [
        f"# Zoom task on CPU ({result['machine']['date']})",
        "",
        f"`{result['command']}`; {result['machine']['cpus']} CPUs shared with other jobs, load (1/5/15 min) at the end "
        + "/".join(f"{v:.1f}" for v in result["machine"]["load_1_5_15"])
        + f"; torch {result['machine']['torch']}, transformers {result['machine']['transformers']}.",
        "",
        f"Task: {result['task']['n_train']} train / {result['task']['n_test']} held-out rows, 448x448 images seen at 56x56, "
        f"{result['task'].get('spots', 4)} place(s), jitter {result['task'].get('jitter', 2)} px"
        + (", the square in its box's top-left quarter (one image token when zoomed)" if result["task"].get("corner_aligned") else "")
        + f", 4 answers (chance 25%). SFT: {result['sft_steps']} language steps (+20 projector steps)"
        + (f", then a second run of {result['more_sft_steps']} steps from it" if result.get("more_sft_steps") else "")
        + ", batch 32, lr 1e-3, vision tower trained, the same for both SFT models"
        + (
            f"; tool traces: the answer row of every train row, the call row of every {result['call_every']}th"
            if result.get("call_every", 1) > 1
            else ""
        )
        + ". "
        + "Evaluation: greedy, the plain multi-turn loop (vlmrl.models.tool_loop), at most 3 turns.",
        "",
        "| held-out | " + " | ".join(label for label, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
        row("accuracy", lambda r: pct(r["accuracy"])),
        row("turns per rollout", lambda r: f"{r['turns_per_rollout']:.2f}"),
        row("tool calls per rollout", lambda r: f"{r['tool_calls_per_rollout']:.2f}"),
        row("rollouts with a call", lambda r: pct(r["rollouts_with_a_call"])),
        row("tool-call success rate", lambda r: pct(r["tool_success_rate"])),
        row("zoom on the right box", lambda r: pct(r["right_box_rate"])),
        row("end reasons", lambda r: str(r["end_reasons"])),
        row("evaluation seconds", lambda r: f"{r['eval_seconds']:.0f}"),
        "",
        f"Training seconds (first step to the end of each run): SFT tool {result['sft_seconds']['tool']:.0f}, SFT direct "
        f"{result['sft_seconds']['no_tool']:.0f}. "
        + (
            f"GRPO with the tool: {grpo['steps']} steps in {grpo['seconds']:.0f} s (rollout.engine=continuous, tools.max_turns=2, "
            f"G=8, 32 completions per step), last step's tools metrics {json.dumps(grpo['last_step_tools'])}."
            if grpo
            else "GRPO with the tool: not run."
        ),
        f"Total wall time {result['total_seconds']:.0f} s.",
        "",
        f"Example turns on the first held-out row: {json.dumps(cols[0][1]['example_turns'])}",
        "",
    ]
    return "\n".join(lines)


def figure(result: dict, path: Path) -> Path:
    """The results file as a figure: held-out accuracy, turns and tool calls per rollout, tool-call success, with and
    without the tool (drawn from the JSON, never typed)."""
    from matplotlib.figure import Figure

    runs = columns(result)
    panels = [
        ("held-out accuracy", "accuracy", 1.0),
        ("turns per rollout", "turns_per_rollout", None),
        ("tool calls per rollout", "tool_calls_per_rollout", None),
        ("tool-call success rate", "tool_success_rate", 1.0),
    ]
    fig = Figure(figsize=(16, 3.6), layout="constrained")
    for ax, (title, key, top) in zip(fig.subplots(1, len(panels)), panels):
        values = [r.get(key) or 0.0 for _, r in runs]
        ax.bar([name.replace(", ", "\n") for name, _ in runs], values, color=[f"C{i}" for i in range(len(runs))])
        for i, (_, r) in enumerate(runs):
            ax.text(i, values[i], "n/a" if r.get(key) is None else f"{values[i]:.2f}", ha="center", va="bottom", fontsize=9)
        if key == "accuracy":
            ax.axhline(0.25, color="gray", linestyle="--", linewidth=1, label="chance (25%)")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, top or max(max(values) * 1.25, 1.0))
        ax.tick_params(labelsize=7)
    fig.suptitle(f"zoom task, {result['task']['n_test']} held-out rows, tiny Qwen2.5-VL on CPU ({result['machine']['date']})")
    fig.savefig(path, dpi=90)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out-dir", default="/tmp/vlmrl_zoom_task")
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--spots", type=int, default=1, help="places the square may sit at (1, 4, 9): 1 = the zoom box is always the same")
    p.add_argument("--jitter", type=int, default=0, help="the square's random shift in original pixels (default 0)")
    p.add_argument("--centred", action="store_true", help="the square centred in its box (each block a separate image token when zoomed)")
    p.add_argument("--call-every", type=int, default=4, help="tool SFT: the call row of every N-th task row (answer rows of all)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 64 train / 16 test rows, 4 SFT steps, no results file")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--more-sft-steps", type=int, default=0, help="a second SFT run of this many steps from each SFT model")
    p.add_argument("--grpo-steps", type=int, default=0, help="GRPO steps with the tool after the tool SFT (0: none)")
    p.add_argument("--reuse", action="store_true", help="keep SFT models already trained in --out-dir (same settings)")
    p.add_argument("--figure", metavar="RESULT_JSON", help="only write the .md and .png of a results file (next to it)")
    args = p.parse_args(argv)
    if args.figure:  # the .md and .png of a results file, from its JSON
        path = Path(args.figure)
        result = json.loads(path.read_text())
        path.with_suffix(".md").write_text(markdown(result))
        figure(result, path.with_suffix(".png"))
        return {}
    if args.quick:
        args.n_train, args.n_test, args.sft_steps = 64, 16, 4
    out = Path(args.out_dir)
    t0 = time.perf_counter()
    files = make_zoom_task(
        out / "data", n_train=args.n_train, n_test=args.n_test, seen_size=SEEN, spots=args.spots, jitter=args.jitter, corner_aligned=not args.centred
    )
    base = out / "data"
    train = [json.loads(line) for line in files["train"].read_text().splitlines()]
    test = [json.loads(line) for line in files["test"].read_text().splitlines()]
    tool_path = write_jsonl(out / "sft_tool.jsonl", tool_rows(train, base, out / "traces", args.call_every))
    direct_path = write_jsonl(out / "sft_direct.jsonl", direct_rows(train, base))
    sft_seconds = {
        "tool": reuse_or_run(tool_path, out / "sft_tool", args.sft_steps, args.reuse),
        "no_tool": reuse_or_run(direct_path, out / "sft_direct", args.sft_steps, args.reuse),
    }
    tool_dir, direct_dir = out / "sft_tool", out / "sft_direct"
    if args.more_sft_steps:  # a second SFT run from each model's first: the tool model's text is learnt by then
        sft_seconds["tool"] += reuse_or_run(tool_path, out / "sft_tool_more", args.more_sft_steps, args.reuse, tool_dir / "final")
        sft_seconds["no_tool"] += reuse_or_run(direct_path, out / "sft_direct_more", args.more_sft_steps, args.reuse, direct_dir / "final")
        tool_dir, direct_dir = out / "sft_tool_more", out / "sft_direct_more"
    result = {
        "command": "python benchmarks/zoom_task.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip(),
        "task": {
            "n_train": args.n_train,
            "n_test": args.n_test,
            "image_size": 448,
            "seen_size": SEEN,
            "spots": args.spots,
            "jitter": args.jitter,
            "corner_aligned": not args.centred,
            "zoom_factor": ZOOM_FACTOR,
        },
        "call_every": args.call_every,
        "sft_steps": args.sft_steps,
        "sft_seconds": sft_seconds,
        "more_sft_steps": args.more_sft_steps,
        "tool": evaluate(tool_dir / "final", test, base, with_tool=True),
        "no_tool": evaluate(direct_dir / "final", test, base, with_tool=False),
    }
    if args.grpo_steps:
        result["grpo_run"] = run_grpo(tool_dir / "final", files["train"], out / "grpo_tool", args.grpo_steps)
        result["grpo_tool"] = evaluate(out / "grpo_tool" / "final", test, base, with_tool=True)
    result["total_seconds"] = time.perf_counter() - t0
    result["machine"] = machine()
    print(markdown(result))
    if not args.quick:
        stem = Path(args.results) / f"zoom_task_cpu_{result['machine']['date']}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(result))
        figure(result, stem.with_suffix(".png"))
        print(f"wrote {stem}.json / .md / .png")
    return result


if __name__ == "__main__":
    main()
