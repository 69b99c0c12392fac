"""docs/results.md: every GPU figure, one table per figure, rendered from the result files under benchmarks/results/.

    python scripts/results_page.py          # rewrite docs/results.md (benchmarks/gpu_suite.py does it after a run)

A figure with no GPU measurement reads "not run". The suite's figures come from the newest
gpu_suite_<device>_<date>.json that is not a smoke run; the older H100 runs from their own files.
tests/test_results_page.py fails when the page and the result files disagree.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
NOT_RUN = "not run"


def _fmt(value, digits: int = 2, scale: float = 1.0, suffix: str = "") -> str:
    return NOT_RUN if value is None else f"{value * scale:.{digits}f}{suffix}"


def newest_suite(results: Path, smoke: bool = False) -> tuple[Path, dict] | None:
    """The newest gpu_suite result (by date, then name) of a real run (smoke=False) or of a smoke run."""
    found = []
    for path in results.glob("gpu_suite_*.json"):
        data = json.loads(path.read_text())
        if bool(data["meta"].get("smoke")) == smoke:
            found.append((data["meta"]["date"], path.name, path, data))
    if not found:
        return None
    _, _, path, data = max(found)
    return path, data


def _source(path: Path, meta: dict, stage: dict) -> str:
    return (
        f"{meta['device']}, {meta['date']}, commit {meta['commit']} (`{meta['command']}`; `benchmarks/results/{path.name}`); "
        f"stage {stage['status']} in {stage.get('seconds', 0)} s." + "".join(f" {n}" for n in stage.get("notes", []))
    )


def _stage(suite, name: str):
    if suite is None:
        return None, None, None
    path, data = suite
    stage = data["stages"].get(name)
    return path, data["meta"], stage


def rollout_table(suite) -> list[str]:
    head = [
        "## Rollout throughput",
        "",
        "Decode tokens/s of one rollout call (prefill included), bf16, 4 prompts x G 8, variable lengths (EOS rate 1/40 per token, "
        "at most 128 new tokens), random-weight presets; fraction of the HBM bound = tokens/s over rows x HBM bandwidth / text "
        "weight bytes (one weight read per decode step; an optimistic bound).",
        "",
        "| model | method | decode tokens/s | time per call (s) | fraction of HBM bound |",
        "|---|---|---|---|---|",
    ]
    path, meta, stage = _stage(suite, "rollout")
    if not stage or not stage["items"]:
        return head + [f"| {NOT_RUN} | | | | |"] + ([] if stage is None else ["", _source(path, meta, stage)])
    rows = [
        f"| {i['model']} | {i['method']} | {i['tokens_per_s']:.0f} | {i['step_s']:.2f} | {_fmt(i['fraction_of_hbm_bound'], 1, 100, '%')} |"
        for i in stage["items"]
    ]
    return head + rows + ["", _source(path, meta, stage)]


def vllm_table(suite) -> list[str]:
    head = [
        "## vLLM beside the in-process decode loop and HF generate",
        "",
        "rollout.backend=vllm as vlmrl colocates it (in-process vLLM engine, `rollout/vllm_engine.LocalEngine`) against the loop and "
        "HF generate on one workload: 4 prompts x G 8, exactly 128 new tokens per sample (min = max), bf16; and the weight sync a "
        "GRPO step pays (the full state pushed with reload_weights, caches reset), median of the repeats.",
        "",
        "| model | method | decode tokens/s | time per call (s) | sync per step (s) |",
        "|---|---|---|---|---|",
    ]
    path, meta, stage = _stage(suite, "vllm")
    if not stage or not stage["items"]:
        return head + [f"| {NOT_RUN} | | | | |"] + ([] if stage is None else ["", _source(path, meta, stage)])
    rows = [
        f"| {i['model']} | {i['method']} | "
        + (f"| | {i['sync_s']:.2f} |" if i["method"] == "sync" else f"{i['tokens_per_s']:.0f} | {i['step_s']:.2f} | |")
        for i in stage["items"]
    ]
    return head + rows + ["", _source(path, meta, stage)]


def update_table(suite) -> list[str]:
    head = [
        "## GRPO step, update time and MFU",
        "",
        "qwen2.5-vl-3b preset, bf16, gradient checkpointing, 2 prompts x G 8, 64-token completions, 256 image tokens per prompt. "
        "MFU = 6 x text parameters x tokens trained / (update time x peak bf16 FLOP/s); vision tower, attention and recompute left out.",
        "",
        "| step (s) | rollout (s) | update (s) | update tokens | MFU | peak reserved (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    path, meta, stage = _stage(suite, "update")
    if not stage or not stage["items"]:
        return head + [f"| {NOT_RUN} | | | | | |"] + ([] if stage is None else ["", _source(path, meta, stage)])
    i = stage["items"][0]
    row = (
        f"| {_fmt(i.get('time_step_s'))} | {_fmt(i.get('time_rollout_s'))} | {_fmt(i.get('time_update_s'))} | {i.get('update_tokens', 0):.0f} "
        f"| {_fmt(i.get('mfu'), 1, 100, '%')} | {_fmt(i.get('measured_peak_gib'))} |"
    )
    return head + [row, "", _source(path, meta, stage)]


def planner_table(suite) -> list[str]:
    head = [
        "## Planner: predicted vs measured peak",
        "",
        "The planner's prediction each run logs (`plan/peak_reserved`) against the run's measured peak reserved memory.",
        "",
        "| configuration | command | predicted (GiB) | measured (GiB) | difference |",
        "|---|---|---|---|---|",
    ]
    path, meta, stage = _stage(suite, "planner")
    if not stage or not stage["items"]:
        return head + [f"| {NOT_RUN} | | | | |"] + ([] if stage is None else ["", _source(path, meta, stage)])
    rows = []
    for i in stage["items"]:
        measured = "out of memory" if i.get("oom") else ("failed" if i.get("returncode") else _fmt(i.get("measured_peak_gib")))
        difference = _fmt(i.get("difference_pct"), 1, 1, "%")
        rows.append(f"| {i['config']} | {i.get('command', 'train')} | {_fmt(i.get('predicted_peak_gib'))} | {measured} | {difference} |")
    return head + rows + ["", _source(path, meta, stage)]


def memory_engine_table(suite) -> list[str]:
    head = [
        "## Memory engine, all off vs all on",
        "",
        "`benchmarks/memory_engine.py --rows first,last` on the GPU (tiny Qwen2.5-VL, vocabulary 151,936, 448 px images, G 8).",
        "",
        "| configuration | step (s) | GPU peak allocated (GiB) | peak over loaded model (GiB) |",
        "|---|---|---|---|",
    ]
    path, meta, stage = _stage(suite, "memory_engine")
    if not stage or not stage["items"] or "rows" not in stage["items"][0]:
        return head + [f"| {NOT_RUN} | | | |"] + ([] if stage is None else ["", _source(path, meta, stage)])
    rows = [
        f"| {r['name']} | {r['step_s']:.2f} | {_fmt(r.get('gpu_peak_allocated_gib', r.get('peak_rss_gib')))} | {r['peak_over_load_gib']:.2f} |"
        for r in stage["items"][0]["rows"]
    ]
    return head + rows + ["", _source(path, meta, stage)]


def oom_table(suite) -> list[str]:
    head = [
        "## Out-of-memory recovery on a real CUDA OOM",
        "",
        "A GRPO step whose full update micro-batch does not fit under a memory cap (`torch.cuda.set_per_process_memory_fraction`); "
        "recovery halves the piece and redoes the same work.",
        "",
        "| memory cap (GiB) | finished | halvings logged |",
        "|---|---|---|",
    ]
    path, meta, stage = _stage(suite, "oom")
    if not stage or not stage["items"]:
        return head + [f"| {NOT_RUN} | | |"] + ([] if stage is None else ["", _source(path, meta, stage)])
    rows = [
        f"| {'injected (CPU)' if i['injected'] else i['cap_gib']} | {'yes' if i['returncode'] == 0 else 'no'} | {len(i['halvings'])} |"
        for i in stage["items"]
    ]
    return head + rows + ["", _source(path, meta, stage)]


def mismatch_table(suite) -> list[str]:
    head = [
        "## Rollout-training mismatch in bf16",
        "",
        "The sampler's log-prob of each sampled token (its decode step) against the scoring pass's (`completion_logps_for`, "
        "as train.py scores old log-probs), qwen2.5-vl-3b, 4 prompts x G 8, up to 64 tokens (`benchmarks/mismatch.py`'s measure). "
        "kl: k3 estimate of KL(sampler || trainer) per token. CPU figures (fp32 and bf16): `benchmarks/results/mismatch_cpu_*.md`.",
        "",
        "| weights | bf16 autocast | engine | decode batch | tokens | kl | max ratio | min ratio | max abs log-prob diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    path, meta, stage = _stage(suite, "mismatch")
    if not stage or not stage["items"]:
        return head + [f"| {NOT_RUN} | | | | | | | | |"] + ([] if stage is None else ["", _source(path, meta, stage)])
    rows = [
        f"| {i['weights']} | {'yes' if i['bf16_autocast'] else 'no'} | {i['engine']} | {i['decode_batch_size']} | {i['tokens']} | "
        f"{i['mismatch/kl']:.2e} | {i['mismatch/max_ratio']:.4f} | {i['mismatch/min_ratio']:.4f} | {i['mismatch/max_abs_logp_diff']:.2e} |"
        for i in stage["items"]
    ]
    return head + rows + ["", _source(path, meta, stage)]


def earlier_gpu_runs(results: Path) -> list[str]:
    """The figures of earlier lent GPUs that the suite does not replace (benchmarks/gpu_memory.py on an H100)."""
    lines = ["## Earlier GPU runs", ""]
    paths = sorted(p for p in results.glob("gpu_memory_*.json") if re.search(r"_\d{4}-\d{2}-\d{2}(_grouped)?\.json$", p.name))
    if not paths:
        return lines + [NOT_RUN, ""]
    lines += ["| file | device | date | model | config | peak allocated / reserved (GiB) | s/step |", "|---|---|---|---|---|---|---|"]
    for path in paths:
        run = json.loads(path.read_text())
        for r in run["records"]:
            peak = "out of memory" if r.get("oom") else f"{r['gpu_peak_allocated_gib']:.1f} / {r['gpu_peak_reserved_gib']:.1f}"
            step = "" if r.get("oom") else f"{r['time_step_s']:.2f}"
            lines.append(f"| `{path.name}` | {run['device']} | {run['date'][:10]} | {run['preset']} | {r['name']} | {peak} | {step} |")
    return lines + [""]


def render(results: Path = RESULTS, smoke: bool = False) -> str:
    suite = newest_suite(results, smoke)
    status = (
        f"Newest suite run: {suite[1]['meta']['device']}, {suite[1]['meta']['date']} (`{suite[0].name}`)."
        if suite
        else 'No GPU suite run yet: every suite figure below reads "not run" (no GPU was lent with the suite in place).'
    )
    lines = [
        "# GPU results",
        "",
        "Generated by `python scripts/results_page.py` from `benchmarks/results/` (do not edit by hand; "
        "`python benchmarks/gpu_suite.py` on one GPU measures every figure and regenerates this page).",
        "",
        status,
        "",
    ]
    for table in (rollout_table, vllm_table, update_table, planner_table, memory_engine_table, oom_table, mismatch_table):
        lines += table(suite) + [""]
    lines += earlier_gpu_runs(results)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}", file=sys.stderr)
