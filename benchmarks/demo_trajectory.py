"""Which change moved `make demo`'s trajectory: the demo of a commit under a given Python environment, run by run.

    python benchmarks/demo_trajectory.py run --label NAME --commit SHA --python VENV/bin/python [--grpo-steps N] [--json FILE]
    python benchmarks/demo_trajectory.py render [--json FILE] [--md FILE] [--reference NAME] [--pairs A:B,C:D]
    python benchmarks/demo_trajectory.py cleanup

`run` checks the commit out into a detached worktree (under --work, kept for the next run of that commit), runs the
demo there (`vlmrl demo`, as `make demo` does, with that commit's own src/ first on the path, a fresh VLMRL_CACHE so
the embedded model is built by the code and packages under test, and the Makefile's environment) with the given
interpreter, and stores in the JSON file, under the label: the commit, transformers / torch versions, the machine load
before and after, the wall time, the SHA-256 of the built tiny model and of SFT's final weights, each GRPO step's
(loss, reward, grad_norm) and the held-out accuracy per evaluated step. `render` writes the table of all runs between
the `demo-trajectory` markers of the .md file: per run its eval series and where it first departs from the reference
run (the first SFT weights or GRPO step that differ). `cleanup` removes the worktrees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_JSON = RESULTS / "demo_trajectory_attribution_2026-11-27.json"
DEFAULT_MD = RESULTS / "demo_trajectory_attribution_2026-11-27.md"
STEP_KEYS = ("loss", "reward", "grad_norm")


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else None


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def worktree(work: Path, commit: str) -> Path:
    """A detached checkout of commit under work/, made once."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    tree = work / full[:12]
    if not (tree / "src" / "vlmrl").is_dir():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), full], cwd=ROOT, check=True, capture_output=True)
    return tree


def run(args) -> dict:
    tree = worktree(Path(args.work), args.commit)
    out = Path(args.work) / "runs" / args.label
    env = {
        **os.environ,
        "PYTHONPATH": str(tree / "src"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",  # the Makefile's exports
        "VLMRL_CACHE": str(out / "cache"),
    }
    versions = subprocess.run(
        [args.python, "-c", "import torch, transformers, vlmrl; print(torch.__version__, transformers.__version__, vlmrl.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert versions[2].startswith(str(tree)), f"vlmrl imported from {versions[2]}, not from {tree}"
    timing = {"wall_seconds": None, "load_before": None, "load_after": None, "returncode": None}
    if args.command == "run":
        subprocess.run(["rm", "-rf", str(out)], check=True)
        out.mkdir(parents=True)
        # The demo's own settings; --grpo-steps cuts GRPO short (enough to find where two runs first differ).
        steps = f"training.max_steps={args.grpo_steps}"
        cut = f"d.GRPO = [x for x in d.GRPO if not x.startswith('training.max_steps=')] + [{steps!r}]; " if args.grpo_steps else ""
        code = f"import vlmrl.demo as d; {cut}d.run_demo({str(out / 'demo')!r})"
        timing["load_before"], start = load(), time.monotonic()
        with open(out / "log.txt", "w") as log:  # a file, not a pipe: the demo outlives a stopped launcher
            done = subprocess.run([args.python, "-c", code], env=env, stdout=log, stderr=subprocess.STDOUT)
        timing.update(wall_seconds=round(time.monotonic() - start, 1), load_after=load(), returncode=done.returncode)
    entry = collect(args.label, tree, out, versions, timing)
    entry["grpo_steps_asked"] = args.grpo_steps or 200
    path = Path(args.json)
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[args.label] = entry
    path.write_text(json.dumps(runs, indent=1) + "\n")
    print(f"{args.label}: {entry['commit']} transformers {entry['transformers']} rc {entry['returncode']}, eval {series(entry)}")
    return entry


def collect(label: str, tree: Path, out: Path, versions: list[str], timing: dict) -> dict:
    """One run's record from its folder (a `collect` of a run whose launcher was stopped has no timing)."""
    demo = out / "demo"
    metrics, evals = demo / "grpo" / "metrics.jsonl", demo / "grpo" / "eval.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    accuracy = [json.loads(x) for x in evals.read_text().splitlines()] if evals.exists() else []
    tiny = sorted((out / "cache").glob("tiny-*/model.safetensors"))
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name")), "")
    return {
        "label": label,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip(),
        "torch": versions[0],
        "transformers": versions[1],
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        **timing,
        "tiny_model_sha256": sha256(tiny[0]) if tiny else None,
        "sft_final_sha256": sha256(demo / "sft" / "final" / "model.safetensors"),
        "grpo_steps": [[r.get(k) for k in STEP_KEYS] for r in rows],
        "eval_accuracy_by_step": {str(r["step"]): r["eval/accuracy"] for r in accuracy if "eval/accuracy" in r},
    }


def series(entry: dict) -> str:
    """'0: 25.0, 25: 25.0, ...': held-out accuracy (%) by GRPO step."""
    return ", ".join(f"{k}: {100 * v:.1f}" for k, v in sorted(entry["eval_accuracy_by_step"].items(), key=lambda kv: int(kv[0])))


def first_difference(entry: dict, ref: dict) -> str:
    """Where entry first departs from ref: the built model, SFT's final weights, then the first GRPO step."""
    if entry["tiny_model_sha256"] != ref["tiny_model_sha256"]:
        return "the built tiny model"
    if entry["sft_final_sha256"] != ref["sft_final_sha256"]:
        return "SFT's final weights"
    for i, (a, b) in enumerate(zip(entry["grpo_steps"], ref["grpo_steps"])):
        changed = [k for k, x, y in zip(STEP_KEYS, a, b) if x != y]
        if changed:
            return f"GRPO step {i + 1} ({', '.join(changed)})"
    return f"none: same bits through the {min(len(entry['grpo_steps']), len(ref['grpo_steps']))} GRPO steps both ran"


def render(args) -> None:
    runs = json.loads(Path(args.json).read_text())
    ref = runs[args.reference]
    lines = [
        f"| run | commit | transformers | GRPO steps | held-out accuracy (%) by GRPO step | first difference from `{args.reference}` "
        "| wall s (load before -> after) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, e in runs.items():
        lines.append(
            f"| {label} | {e['commit']} | {e['transformers']} | {len(e['grpo_steps'])} | {series(e)} | {first_difference(e, ref)} | "
            + (f"{e['wall_seconds']:.0f} ({e['load_before'].split()[0]} -> {e['load_after'].split()[0]}) |" if e["wall_seconds"] else "not timed |")
        )
    if args.pairs:
        lines += ["", "| run | against | first difference |", "|---|---|---|"]
        for pair in args.pairs.split(","):
            a, b = pair.split(":")
            name = {x: f"{x} ({runs[x]['commit']}, {runs[x]['transformers']})" for x in (a, b)}
            lines.append(f"| {name[a]} | {name[b]} | {first_difference(runs[a], runs[b])} |")
    block = "\n".join(lines) + "\n"
    md = Path(args.md)
    text = md.read_text() if md.exists() else "<!-- demo-trajectory:start -->\n<!-- demo-trajectory:end -->\n"
    marked = f"<!-- demo-trajectory:start -->\n{block}<!-- demo-trajectory:end -->"
    text = re.sub(r"<!-- demo-trajectory:start -->\n.*?<!-- demo-trajectory:end -->", lambda _: marked, text, flags=re.S)
    md.write_text(text)
    print(block)


def cleanup(args) -> None:
    for tree in sorted(Path(args.work).glob("*/src")):
        subprocess.run(["git", "worktree", "remove", "--force", str(tree.parent)], cwd=ROOT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "collect", "render", "cleanup"])
    parser.add_argument("--label")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--work", default="/tmp/demo-trajectory")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--md", default=str(DEFAULT_MD))
    parser.add_argument("--reference", default="record")
    parser.add_argument("--pairs", default="", help="render: a:b,c:d ... runs compared pairwise")
    parser.add_argument("--grpo-steps", type=int, default=0, help="GRPO steps (default: the demo's 200)")
    args = parser.parse_args()
    {"run": run, "collect": run, "render": render, "cleanup": cleanup}[args.command](args)


if __name__ == "__main__":
    main()
