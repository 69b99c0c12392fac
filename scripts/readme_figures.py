"""The documentation's benchmark figures, rendered from the result files under benchmarks/results/.

Each function returns the markdown that sits between `<!-- NAME:start -->` and `<!-- NAME:end -->` in README.md or a docs page;
`scripts/update_reference.py` writes them and tests/test_readme_figures.py fails when README and results disagree.
A block whose result file is absent is left as it is (the function returns None).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"


def _newest(pattern: str) -> Path | None:
    """The result file matching pattern with the latest date in its name (names end in _YYYY-MM-DD[...].json)."""
    dated = [p for p in RESULTS.glob(pattern) if re.search(r"_\d{4}-\d{2}-\d{2}\.json$", p.name)]  # not _run1, _first_pass...
    return max(dated, key=lambda p: p.name[-15:]) if dated else None


def _load(path: Path | None) -> dict | None:
    return json.loads(path.read_text()) if path is not None else None


def memory_engine() -> str | None:
    path = _newest("memory_engine_cpu_*.json")
    result = _load(path)
    if result is None:
        return None
    meta, summary = result["meta"], result["summary"]
    lines = [
        f"`{meta['command']}` on the {meta['cpu_count']}-core CPU ({meta['date']}; `benchmarks/results/{path.with_suffix('.md').name}`).",
        f"Tiny Qwen2.5-VL with a {meta['vocab']:,}-token vocabulary, {meta['image_side']}x{meta['image_side']} images, "
        f"completions forced to {meta['completion']} tokens, G = {meta['G']}, {meta['prompts_per_step']} prompts per step, fp32; "
        "each row switches one more part on:",
        "",
        "| configuration | step (s) | rollout (s) | update (s) | peak RSS (GiB) | peak over loaded model (GiB) | vision images / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['name']} | {row['step_s']:.2f} | {row['rollout_s']:.2f} | {row['update_s']:.2f} | {row['peak_rss_gib']:.2f} "
            f"| {row['peak_over_load_gib']:.2f} | {row['vision_images_per_step']:.0f} |"
        )
    lines += [
        "",
        f"All on vs all off: step time x{summary['step_time_ratio_all_on_vs_off']:.2f}, peak RSS x{summary['peak_ratio_all_on_vs_off']:.2f} "
        f"(x{summary['peak_over_load_ratio_all_on_vs_off']:.2f} over the loaded model).",
    ]
    if summary.get("load_note"):
        lines += ["", f"Machine load: {summary['load_note']}."]
    for name, ops in (result.get("profiles") or {}).items():
        head, top = ops[0], ops[1:4]
        share = head["vocab_sized_self_s_per_step"] / head["total_self_s_per_step"]
        lines += [
            "",
            f"Profiled ({name}, a separate run under torch.profiler): {head['total_self_s_per_step']:.2f} s of ops per step, "
            f"{share:.0%} of it in ops with a vocabulary-sized input; the largest: "
            + "; ".join(f"{r['op']} {r['shapes']} {r['self_s_per_step']:.2f} s" for r in top)
            + ".",
        ]
    return "\n".join(lines) + "\n"


def memory_engine_families() -> str | None:
    """All off vs all on for every family / workload run with --family or --video (the newest file of each)."""
    newest: dict[str, Path] = {}
    for path in sorted(RESULTS.glob("memory_engine_cpu_*_*.json")):
        match = re.fullmatch(r"memory_engine_cpu_(\d{4}-\d{2}-\d{2})_(.+)\.json", path.name)
        if match is None or match.group(2).endswith("quick"):
            continue
        tag = match.group(2)
        if tag not in newest or newest[tag].name < path.name:
            newest[tag] = path
    if not newest:
        return None
    lines = [
        "| workload (result file) | step all off -> all on (s) | peak RSS all off -> all on (GiB) | vision inputs / step all off -> all on |",
        "|---|---|---|---|",
    ]
    for _tag, path in sorted(newest.items()):
        result = _load(path)
        off, on = result["rows"][0], result["rows"][-1]
        meta = result["meta"]
        what = f"{meta['family']}" + (f", one {meta['video_frames']}-frame video per prompt" if meta.get("video_frames") else "")
        lines.append(
            f"| {what} (`{path.with_suffix('.md').name}`) | {off['step_s']:.2f} -> {on['step_s']:.2f} | "
            f"{off['peak_rss_gib']:.2f} -> {on['peak_rss_gib']:.2f} | {off['vision_images_per_step']:.0f} -> {on['vision_images_per_step']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def vs_trl() -> str | None:
    """One row per configuration, from the newest result file that measured it (a run may re-measure only some)."""
    newest: dict[str, tuple[Path, dict, dict]] = {}
    for path in sorted(p for p in RESULTS.glob("vs_trl_cpu_*.json") if re.search(r"_\d{4}-\d{2}-\d{2}\.json$", p.name)):
        result = _load(path)
        for config in result["configs"]:
            newest[config["name"]] = (path, result, config)  # sorted by date: a later file replaces an earlier one
    if not newest:
        return None
    lines = []
    for path in sorted({path for path, _, _ in newest.values()}, key=lambda p: p.name):
        result = _load(path)
        machine = result["machine"]
        names = ",".join(name for name, (p, _, _) in sorted(newest.items()) if p == path)
        lines.append(
            f"- {names}: `{result['command']}` ({result['date']}; {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']} GiB RAM; "
            f"glibc tunables: {result['glibc_tunables'] or 'unset'} on both sides; "
            f"{result['warmup']} warm-up + {result['steps']} measured steps per side and round, {result['rounds']} rounds; "
            f"`benchmarks/results/{path.with_suffix('.md').name}`)" + (f". {result['note']}" if result.get("note") else "")
        )
    lines += [
        "",
        "| config | step time vlmrl / TRL | peak RSS vlmrl / TRL | growth above the first rollout vlmrl / TRL | throughput vlmrl / TRL "
        "| images encoded per step vlmrl / TRL | completion tokens per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for _name, (_path, _result, config) in sorted(newest.items()):
        ours, trl = config["vlmrl"], config["trl"]
        growth = config["ratios_vlmrl_over_trl"].get("growth_above_first_rollout")
        growth_cell = (
            f"{ours['growth_above_first_rollout_gib']:.2f} / {trl['growth_above_first_rollout_gib']:.2f} GiB = **{growth:.2f}**"
            if growth is not None
            else "not recorded"
        )
        lines.append(
            f"| ({config['name']}) {config['title']} "
            f"| {ours['median_step_s']:.3f} / {trl['median_step_s']:.3f} s = **{ours['median_step_s'] / trl['median_step_s']:.2f}** "
            f"| {ours['peak_rss_gib']:.2f} / {trl['peak_rss_gib']:.2f} GiB = **{ours['peak_rss_gib'] / trl['peak_rss_gib']:.2f}** "
            f"| {growth_cell} | **{config['ratios_vlmrl_over_trl']['throughput']:.2f}x** "
            f"| {ours['vision_images_encoded_per_step']:.0f} / {trl['vision_images_encoded_per_step']:.0f} "
            f"| {config['tokens_per_step_expected']} (equal: {config['equal_work']}) |"
        )
    return "\n".join(lines) + "\n"


def _gpu_row(preset: str, record: dict) -> str:
    if record.get("oom"):
        return f"| {preset} | {record['name']} | out of memory | | |"
    return (
        f"| {preset} | {record['name']} | {record['gpu_peak_allocated_gib']:.1f} / {record['gpu_peak_reserved_gib']:.1f} "
        f"| {record['time_step_s']:.2f} | {record['tokens_per_s']:.0f} |"
    )


def gpu_memory() -> str | None:
    paths = sorted(p for p in RESULTS.glob("gpu_memory_*.json") if not p.stem.endswith("_grouped"))
    if not paths:
        return None
    runs = [_load(p) for p in paths]
    first = runs[0]
    lines = [
        f"Measured on one **{first['device']}** ({first['date'][:10]}, torch {first['torch']}, transformers {first['transformers']}), "
        "random-weight real-size architectures, bf16, sdpa, 2 prompts x G, 256 image tokens per prompt, 64-token completions "
        f"(`benchmarks/gpu_memory.py`; {', '.join(f'`{p.name}`' for p in paths)}):",
        "",
        "| model | config | peak allocated / reserved GiB | s/step | completion tok/s |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        lines += [_gpu_row(run["preset"], record) for record in run["records"]]
    return "\n".join(lines) + "\n"


def _largest(rows: list[dict], key: str) -> float:
    return max(abs(row[key]) for row in rows if row.get(key) is not None)


def planner_accuracy() -> str | None:
    trace, runs, gpu = (_newest(p) for p in ("planner_accuracy_cpu_trace_*.json", "planner_accuracy_cpu_runs_*.json", "planner_vs_h100_*.json"))
    if trace is None or runs is None or gpu is None:
        return None
    trace_rows, run_rows = _load(trace)["rows"], _load(runs)["rows"]
    gpu_rows = [row for row in _load(gpu)["rows"] if row.get("reserved_difference_pct") is not None]
    within = sum(abs(row["difference_pct"]) <= 10 for row in run_rows)
    return (
        f"Accuracy: closed form vs `--trace` on {len(trace_rows)} configs (full, LoRA, shared prefix, eager, SFT, video, Qwen3.5, tiles): "
        "largest difference "
        f"{_largest(trace_rows, 'difference_pct'):.1f}% (`{trace.name}`); vs {len(gpu_rows)} H100 runs: within "
        f"{_largest(gpu_rows, 'reserved_difference_pct'):.1f}% of `max_memory_reserved` (`{gpu.name}`); vs {len(run_rows)} real CPU runs: "
        f"peak RSS within 10% on {within} of {len(run_rows)}, largest {_largest(run_rows, 'difference_pct'):.1f}% (`{runs.name}`)."
        + _trainer_profiles()
        + "\n"
    )


def planner_deepspeed() -> str | None:
    """The planner against 2-process DeepSpeed ZeRO-2/3 runs on the CPU (benchmarks/planner_deepspeed.py)."""
    path = _newest("planner_deepspeed_cpu_*.json")
    data = _load(path)
    if data is None:
        return None
    intro = (
        f"`python benchmarks/planner_accuracy.py deepspeed` ({data['date']}, {data['machine']}; "
        f"`benchmarks/results/{path.with_suffix('.md').name}`): "
        "`accelerate launch` with a DeepSpeed JSON (unset keys at DeepSpeed 0.19.8's defaults), 2 processes over gloo, 2 steps of "
        "the mid tiny Qwen2.5-VL (0.10 B parameters, float32). Measured: the larger per-process peak RSS of the two ranks; predicted: "
        "plan() of the run's config with its DeepSpeed config."
    )
    return intro + "\n\n" + planner_deepspeed_table(data["rows"])


def planner_deepspeed_table(rows: list[dict]) -> str:
    lines = [
        "| config | run | zero_optimization | measured GiB | peak in | predicted GiB | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        zero = ", ".join(f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in row["deepspeed_config"]["zero_optimization"].items())
        run = ("GRPO" if row["command"] == "train" else "SFT") + (" LoRA" if "model.use_lora=true" in row["overrides"] else " full")
        run += ", mmap threshold pinned" if row.get("mmap_threshold_pinned") else ""
        malloc = " ".join(f"{k}={v}" for k, v in row.get("malloc_env", {}).items())
        lines.append(
            f"| {row['name']} | {run}{' (' + malloc + ')' if malloc else ''} | {zero} | {row['measured_peak_rss_gib']:.2f} | "
            f"{row['peak_segment']} | {row['predicted_peak_rss_gib']:.2f} | {row['difference_pct']:+.1f}% |"
        )
    scored = [row for row in rows if not row.get("malloc_env")]
    within = sum(abs(row["difference_pct"]) <= 10 for row in scored)
    lines += ["", f"Within +/-10%: {within} of {len(scored)} configs (the diagnostic rows, run with an environment setting, not counted)."]
    by_name = {row["name"]: row for row in rows}
    for row in rows:
        base = by_name.get(row["name"].removesuffix("-mmap1m").removesuffix("-unpinned")) if row.get("malloc_env") else None
        if base is not None:
            env = " ".join(f"{k}={v}" for k, v in row["malloc_env"].items())
            lines.append(
                f"With {env} the {base['name']} run peaks at {row['measured_peak_rss_gib']:.2f} GiB instead of "
                f"{base['measured_peak_rss_gib']:.2f} (planner {row['difference_pct']:+.1f}% instead of {base['difference_pct']:+.1f}%)."
            )
    return "\n".join(lines) + "\n"


def _trainer_profiles() -> str:
    """The --profile naive / trl predictions against TRL GRPOTrainer's measured peak RSS on CPU."""
    path = _newest("planner_accuracy_trl_cpu_*.json")
    if path is None:
        return ""
    rows = _load(path)["rows"]
    parts = []
    for profile in ("trl", "naive"):
        errors = [row[profile]["difference_pct"] for row in rows if profile in row]
        within = sum(abs(e) <= 15 for e in errors)
        parts.append(f"`--profile {profile}` within 15% on {within} of {len(errors)} (largest {max(abs(e) for e in errors):.1f}%)")

    return f" Against TRL 1.16 GRPOTrainer's measured peak RSS on CPU: {', '.join(parts)} (`{path.name}`)."


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def make_times() -> str | None:
    result = _load(RESULTS / "make_times_cpu.json" if (RESULTS / "make_times_cpu.json").exists() else None)
    if result is None:
        return None
    test = result["make_test"]
    line = (
        f"On a {result['cpu_count']}-core CPU machine ({result['date']}, fresh clone of {result['commit']}, "
        f"`python scripts/measure_make_times.py`): `make test` {_minutes(test['seconds'])} in all (install, ruff lint and format check, "
        f"then {test['pytest_summary']} in {_minutes(test['pytest_seconds'])})"
    )
    if "make_demo" in result:
        line += f"; `make demo` {_minutes(result['make_demo']['seconds'])} after that"
    return line + ".\n"


def _paired(ours: dict, other: dict) -> float:
    """Median over repeats of the tokens/s ratio within one repeat (the methods ran alternately, so a repeat's
    ratio compares them under the same machine load)."""
    ratios = sorted((ours["median_tokens"] / a) / (other["median_tokens"] / b) for a, b in zip(ours["walls"], other["walls"]))
    return ratios[len(ratios) // 2]


def rollout() -> str | None:
    path = _newest("rollout_cpu_*.json")
    result = _load(path)
    if result is None:
        return None
    meta = result["meta"]
    lines = [
        f"`{meta['command']}` ({meta['date']}, {meta['cpu_count']} CPU cores, {meta['torch_threads']} torch thread(s), commit {meta['commit']}; "
        f"`benchmarks/results/{path.with_suffix('.md').name}`): tiny Qwen2.5-VL, vocabulary {meta['vocab']:,}, at most "
        f"{meta['max_new_tokens']} new tokens, variable lengths (EOS rate {meta['eos_rate']} per token), engine decode batch "
        f"{meta['decode_batch'] or 'all rows of a call (rollout.decode_batch_size=0, the default)'}; loop and engine sample the same "
        "streams (same tokens). Ratios are medians of per-repeat ratios.",
        "",
        "| prompts x G | decode tokens/s HF generate / loop / engine | engine / loop | engine / HF generate |",
        "|---|---|---|---|",
    ]
    for row in result["results"]:
        hf, loop, engine = (row["methods"][k] for k in ("hf", "loop", "engine"))
        lines.append(
            f"| {row['prompts']} x {row['G']} | {hf['median_tokens_per_s']:.0f} / {loop['median_tokens_per_s']:.0f} / "
            f"{engine['median_tokens_per_s']:.0f} | {_paired(engine, loop):.2f} | {_paired(engine, hf):.2f} |"
        )
    return "\n".join(lines) + "\n"


def families_table() -> str | None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("families_table", Path(__file__).parent / "families_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render(json.loads(module.MATRIX.read_text())) if module.MATRIX.exists() else None


def gpu_suite() -> str:
    """One line: the newest GPU suite run (benchmarks/gpu_suite.py), or that none ran; its tables are in docs/results.md."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_page", Path(__file__).parent / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    suite = module.newest_suite(RESULTS)
    if suite is None:
        return (
            "GPU figures (rollout tokens/s, update MFU, planner on GPU, memory engine, OOM recovery): **not run** "
            "(no GPU lent since `benchmarks/gpu_suite.py` exists); see `docs/results.md`.\n"
        )
    path, data = suite
    meta = data["meta"]
    done = [name for name, stage in data["stages"].items() if stage["status"] == "ok"]
    return (
        f"GPU figures: `{meta['command']}` on {meta['device']} ({meta['date']}, commit {meta['commit']}; `benchmarks/results/{path.name}`), "
        f"stages finished: {', '.join(done) or 'none'}; tables in `docs/results.md`.\n"
    )


BLOCKS = {
    "gpu-suite": gpu_suite,
    "rollout": rollout,
    "families-table": families_table,
    "make-times": make_times,
    "memory-engine": memory_engine,
    "memory-engine-families": memory_engine_families,
    "vs-trl": vs_trl,
    "gpu-memory": gpu_memory,
    "planner-accuracy": planner_accuracy,
    "planner-deepspeed": planner_deepspeed,
}


def rendered() -> dict[str, str]:
    """Block name -> markdown, for every block whose result files exist."""
    return {name: text for name, render in BLOCKS.items() if (text := render()) is not None}
