"""Does GRPO with rollout.backend=vllm learn `make demo`'s task as the in-process engine does? (issue 34)

The demo's own recipe (src/vlmrl/demo.py: COMMON + SFT warm start, then COMMON + GRPO: 8 prompts x G 8 a step,
lr 3e-4, temperature 1, accuracy + answer_format rewards), 20 GRPO steps, the only change rollout.backend. Runs in
the vLLM venv (both backends importable there):

    PY=.venv-vllm/bin/python
    $PY benchmarks/vllm_demo_learning.py sft   --out /tmp/vdl                       # the SFT model, once
    $PY benchmarks/vllm_demo_learning.py grpo  --out /tmp/vdl --backend vllm        # 20 steps -> /tmp/vdl/grpo-vllm-s0
    $PY benchmarks/vllm_demo_learning.py grpo  --out /tmp/vdl --backend inprocess
    $PY benchmarks/vllm_demo_learning.py greedy --out /tmp/vdl --backend vllm       # vLLM greedy vs HF greedy, final weights
    $PY benchmarks/vllm_demo_learning.py report --out /tmp/vdl --name vllm_demo_learning_cpu_<date>

`report` reads the runs' metrics.jsonl / eval.jsonl (and greedy.json) and writes benchmarks/results/<name>.json
and the markdown table generated from it (<name>.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

STEPS = 20
LABELS = {  # what a run folder's label part means
    "base": "the vLLM backend before its seeds were spread (ec05940): sample i of a prompt seeded prompt seed + i, and "
    "the prompt seeds consecutive, so neighbouring prompts shared G-1 sampling streams (64 samples a step from 15 streams)",
    "fix": "the vLLM backend with spread seeds (rollout/vllm_backend.group_seed): 64 distinct streams a step",
}
QUIET = ["logging.progress_bar=false", "training.overwrite_output_dir=true"]


def grpo_overrides(out: Path, backend: str, seed: int, steps: int, label: str = "") -> list[str]:
    from vlmrl.demo import COMMON, GRPO

    data = out / "sft" / "data" / "count"
    extra = ["rollout.backend=vllm", "rollout.vllm_gpu_memory_utilization=0.3"] if backend == "vllm" else []
    return (
        COMMON
        + GRPO
        + QUIET
        + [
            f"training.output_dir={run_dir(out, backend, seed, label)}",
            f"model.name_or_path={out / 'sft' / 'final'}",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'test.jsonl'}",
            f"training.seed={seed}",
            f"training.max_steps={steps}",
            "training.eval_steps=0",  # held-out accuracy before (val_before_train) and after the steps only
            *extra,
        ]
    )


def run_dir(out: Path, backend: str, seed: int, label: str = "") -> Path:
    return out / f"grpo-{backend}{'-' + label if label else ''}-s{seed}"


def cmd_sft(args) -> None:
    from vlmrl.config import load_config
    from vlmrl.demo import COMMON, SFT
    from vlmrl.sft import sft

    sft(load_config(None, COMMON + SFT + QUIET + [f"training.output_dir={args.out / 'sft'}"]))


def cmd_grpo(args) -> None:
    from vlmrl.config import load_config
    from vlmrl.train import train

    train(load_config(None, grpo_overrides(args.out, args.backend, args.seed, args.steps, args.label)))


def cmd_greedy(args) -> None:
    """vLLM started on the SFT weights, the run's final weights pushed into it (the path every step takes), then vLLM
    greedy vs HF greedy on the first --rows held-out prompts."""
    import torch

    from vlmrl.config import load_config  # vlmrl first: it lets the registry's torchvision import beside CPU torch
    from vlmrl.models.policy import load_policy
    from vlmrl.models.rollout import generate
    from vlmrl.rollout.vllm_backend import VLLMRollout
    from vlmrl.run.datasets import encode_rows, load_datasets, row_prompt_inputs

    from vllm import SamplingParams  # noqa: I001 - after vlmrl

    run = run_dir(args.out, args.backend, args.seed, args.label)
    cfg = load_config(None, grpo_overrides(args.out, "vllm", args.seed, args.steps))
    model, processor = load_policy(cfg, torch.device("cpu"))  # the SFT weights: what vLLM is built from
    final, _ = load_policy(
        load_config(None, grpo_overrides(args.out, "vllm", args.seed, args.steps) + [f"model.name_or_path={run / 'final'}"]), torch.device("cpu")
    )
    model.load_state_dict(final.state_dict())
    model.eval()
    rows = load_datasets(cfg, processor=processor).eval[: args.rows]
    backend = VLLMRollout(cfg, model, processor, log=lambda *_: None)
    synced = backend.sync(step=args.steps, rows=rows)  # push + probe
    prompts = encode_rows(processor, rows, cfg, torch.device("cpu"))
    hf = generate(model, processor.tokenizer, prompts, num_generations=1, max_new_tokens=8, do_sample=False, shared_prefix=False)
    texts, images, _ = row_prompt_inputs(processor, rows, cfg)
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=backend.eos, allowed_token_ids=backend.allowed)
    outs = backend.llm.generate(backend.requests(texts, images), params, use_tqdm=False)
    equal = [list(o.outputs[0].token_ids) == hf.ids[i][hf.mask[i].bool()].tolist() for i, o in enumerate(outs)]
    result = {"rows": len(equal), "equal": sum(equal), "probe_max_abs_logp_diff": synced.get("vllm/probe_max_abs_logp_diff")}
    (run / "greedy.json").write_text(json.dumps(result) + "\n")
    print(result)


def load_run(run: Path) -> dict:
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {e["step"]: e["eval/accuracy"] for e in map(json.loads, (run / "eval.jsonl").read_text().splitlines()) if "eval/accuracy" in e}
    rewards = [m["reward"] for m in train]
    diffs = [b - a for a, b in zip(rewards, rewards[1:])]
    out = {
        "steps": len(train),
        "reward": rewards,
        "accuracy_reward": [m.get("rewards/accuracy/mean") for m in train],
        "format_reward": [m.get("rewards/answer_format/mean") for m in train],
        "first5_mean": statistics.fmean(rewards[:5]),
        "last5_mean": statistics.fmean(rewards[-5:]),
        # step-to-step noise: sd of successive differences / sqrt(2) (robust to a trend), and the sd of a 5-step mean
        "step_noise_sd": statistics.stdev(diffs) / 2**0.5 if len(diffs) > 1 else None,
        "mismatch_metric_every_step": all(any(k.startswith("mismatch/") for k in m) for m in train),
        "mismatch_max_abs_logp_diff_max": max((m.get("mismatch/max_abs_logp_diff", 0.0) for m in train), default=None),
        "probe_max_abs_logp_diff_max": max((m["vllm/probe_max_abs_logp_diff"] for m in train if "vllm/probe_max_abs_logp_diff" in m), default=None),
        "heldout_accuracy": {str(k): v for k, v in sorted(evals.items())},
    }
    out["rise"] = out["last5_mean"] - out["first5_mean"]
    for part in ("accuracy", "format"):
        series = [x for x in out[f"{part}_reward"] if x is not None]
        out[f"{part}_first5_last5"] = [statistics.fmean(series[:5]), statistics.fmean(series[-5:])] if len(series) >= 5 else None
    if (run / "greedy.json").exists():
        out["greedy_final_weights"] = json.loads((run / "greedy.json").read_text())
    return out


def cmd_report(args) -> None:
    runs = {p.name.removeprefix("grpo-"): load_run(p) for p in sorted(args.out.glob("grpo-*")) if (p / "metrics.jsonl").exists()}
    result = {
        "what": "make demo's recipe (src/vlmrl/demo.py COMMON+GRPO after its SFT warm start), 20 GRPO steps, only rollout.backend changed",
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "runs": runs,
    }
    dest = ROOT / "benchmarks" / "results"
    (dest / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (dest / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    def parts(pair):
        return "-" if pair is None else f"{pair[0]:.3f} -> {pair[1]:.3f}"

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = [
        f"# {result['what']}",
        "",
        f"Generated by benchmarks/vllm_demo_learning.py report from the JSON beside this file ({result['date']}, {result['cpus']} CPUs).",
        "",
        "| run (backend-seed) | steps | reward, first 5 steps | last 5 steps | rise | step noise sd | accuracy part, first 5 -> last 5 | "
        "format part | held-out acc before -> after | mismatch/* every step | greedy vLLM = HF (final weights) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["runs"].items():
        acc = r["heldout_accuracy"]
        keys = sorted(acc, key=int)
        g = r.get("greedy_final_weights")
        greedy = f"{g['equal']}/{g['rows']}" if g else "not run"
        heldout = f"{pct(acc[keys[0]])} -> {pct(acc[keys[-1]])}" if keys else "-"
        lines.append(
            f"| {name} | {r['steps']} | {r['first5_mean']:.3f} | {r['last5_mean']:.3f} | {r['rise']:+.3f} | "
            f"{r['step_noise_sd']:.3f} | {parts(r['accuracy_first5_last5'])} | {parts(r['format_first5_last5'])} | {heldout} | "
            f"{'yes' if r['mismatch_metric_every_step'] else 'no'} | {greedy} |"
        )
    lines += [""] + [f"- `{k}`: {v}." for k, v in LABELS.items() if any(f"-{k}-" in name for name in result["runs"])]
    lines += ["", "Per-step mean reward (accuracy + answer_format, temperature 1, 64 completions a step):", ""]
    for name, r in result["runs"].items():
        lines.append(f"- {name}: " + ", ".join(f"{x:.3f}" for x in r["reward"]))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["sft", "grpo", "greedy", "report"])
    p.add_argument("--out", type=Path, default=Path("/tmp/vllm_demo_learning"))
    p.add_argument("--backend", choices=["vllm", "inprocess"], default="vllm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--label", default="", help="a name part of the run folder (grpo-<backend>-<label>-s<seed>)")
    p.add_argument("--name", default=f"vllm_demo_learning_cpu_{datetime.date.today().isoformat()}")
    args = p.parse_args()
    {"sft": cmd_sft, "grpo": cmd_grpo, "greedy": cmd_greedy, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
