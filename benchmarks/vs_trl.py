"""vlmrl vs TRL's GRPOTrainer, side by side: same tiny VLM, same prompts and images, same work.

    pip install -e '.[bench]'                       # TRL, pinned; never a runtime dependency of vlmrl
    python benchmarks/vs_trl.py                     # configs a,b,c; 2 warm-up + 8 measured steps per side
    python benchmarks/vs_trl.py --quick             # tiny sizes: checks the harness in a few minutes
    python benchmarks/vs_trl.py --configs a --steps 8 --warmup 2 --rounds 2
    python benchmarks/vs_trl.py --device cuda --dtype bfloat16 --rounds 2   # on a GPU (written, not yet run)

For each configuration the parent process builds one tiny Qwen2.5-VL (`vlmrl.tiny_models.tiny`), saves it with
`save_pretrained`, writes a JSONL dataset of PNG images, then runs each side in its own subprocess,
alternating vlmrl, TRL (x --rounds), under the same environment (same GLIBC_TUNABLES, same threads).
Both load the model from that folder, the same rows, the same G, max_completion_length, completions
per step (one rollout and one optimizer step per step on both sides), beta, learning rate, AdamW
betas, clipping, loss type, seed, fp32 on CPU, and generation forced to exactly max_completion_length
tokens (vlmrl: rollout.min_completion_length; TRL: generation_kwargs min_new_tokens). Every prompt has
the same text, so whichever rows a side's sampler picks, the prompt work is the same.

Per side and step it records: step time, rollout / scoring / update split, completion tokens trained
(vlmrl: metrics.jsonl completions/mean_length x completions; TRL: the completion mask that
`_generate_and_score_completions` hands to the loss), and the process peak RSS (getrusage). If the
tokens trained per step differ between the sides the run exits with status 3 and says where.

How TRL is timed (a subclass of GRPOTrainer plus a TrainerCallback, no change to TRL's code):
  step     on_step_begin -> on_step_end of the callback (one optimizer step = one rollout here);
           `between` is on_step_end -> next on_step_end (adds the dataloader fetch and TRL's logging)
  rollout  time inside `_generate` (chat template + processor, HF generate, decode)
  scoring  rest of `_generate_and_score_completions` (processor again, reference log-probs, rewards)
  update   step - rollout - scoring (TRL's loss forward/backward and the optimizer step)
vlmrl's split comes from its own metrics.jsonl (time/rollout, time/scoring, time/update, time/step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
GLIBC_TUNED = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"
PROBLEM = "How many red shapes are there in the image? Answer with a number."

# name -> settings. image: side in pixels (patch 14, merge 2: 448 -> 256 image tokens); prompts: per step.
CONFIGS = {
    "a": dict(title="image-heavy (256 image tokens), completion 32, G=8", image=448, vocab=None, completion=32, G=8, prompts=2),
    "b": dict(title="Qwen vocabulary 151,936, completion 64, G=8", image=112, vocab=151_936, completion=64, G=8, prompts=2),
    "c": dict(title="G=16 (one prompt of 256 image tokens), completion 32", image=448, vocab=None, completion=32, G=16, prompts=1),
}
QUICK = {
    "a": dict(title="quick a: 112px (16 image tokens), completion 8, G=4", image=112, vocab=None, completion=8, G=4, prompts=2),
    "b": dict(title="quick b: vocab 151,936, completion 8, G=4", image=56, vocab=151_936, completion=8, G=4, prompts=1),
    "c": dict(title="quick c: G=8, completion 8", image=112, vocab=None, completion=8, G=8, prompts=1),
}
COMMON = dict(
    beta=0.04,
    learning_rate=1e-5,
    seed=0,
    loss_type="grpo",
    epsilon=0.2,
    max_grad_norm=1.0,
    adam_beta1=0.9,
    adam_beta2=0.99,
    adam_epsilon=1e-8,
    weight_decay=0.0,
    temperature=1.0,
)


# ------------------------------------------------------------------ reward (both sides)


def bench_reward(prompts, completions, **kwargs):
    """Deterministic reward from what each side hands a reward function: the decoded completion text
    (vlmrl passes strings, TRL conversational messages). A big-vocabulary model mostly samples ids the
    tiny tokenizer cannot decode, so rewards may be all equal there; the work done is the same."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        if isinstance(text, list):
            text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
        out.append(((len(text) * 7 + sum(map(ord, text[:16]))) % 11) / 10.0)
    return out


# ------------------------------------------------------------------ preparation (parent)


def prepare(name: str, spec: dict, work: Path) -> dict:
    """Tiny model folder + dataset for one configuration (built once, loaded by both sides)."""
    import numpy as np
    from PIL import Image

    sys.path.insert(0, str(ROOT / "src"))
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    folder = work / f"config_{name}"
    model_dir, data_dir = folder / "model", folder / "data"
    side = spec["image"]
    pixels = side * side
    build_tiny_qwen25vl(model_dir, seed=0, min_pixels=pixels, max_pixels=pixels, vocab_size=spec["vocab"])
    (data_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    n_rows = max(8, 4 * spec["prompts"])
    for i in range(n_rows):
        path = data_dir / "images" / f"{i:03d}.png"
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(path)
        rows.append({"image": f"images/{i:03d}.png", "problem": PROBLEM, "solution": str(i % 5)})
    with open(data_dir / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return {
        **spec,
        **COMMON,
        "name": name,
        "model": str(model_dir),
        "data": str(data_dir / "train.jsonl"),
        "pixels": pixels,
        "completions_per_step": spec["prompts"] * spec["G"],
    }


# ------------------------------------------------------------------ instrumentation (both sides)

VISION = {"calls": 0, "images": 0}


def count_vision(model) -> None:
    """Count the images the vision tower encodes (rows of grid_thw per call), the same way on both sides.
    A deep copy of the model (vlmrl's reference) keeps the hook, so reference scoring is counted too."""
    core = getattr(model, "model", model)
    tower = getattr(core, "visual", None) or getattr(model, "visual", None)
    if tower is None:
        return

    def hook(module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        VISION["calls"] += 1
        VISION["images"] += int(grid.shape[0]) if grid is not None else 0

    tower.register_forward_pre_hook(hook, with_kwargs=True)


class RssSampler:
    """Samples the process RSS every `period` s on a thread, tagged with the phase the main thread is in.

    `first_rollout_rss` is the RSS when the first rollout begins (model, reference, optimizer and data loaded, nothing
    generated yet); growth above it is what training itself adds, the figure that says what a side's own step
    costs beyond the libraries and the model. Per phase it keeps the highest RSS seen."""

    def __init__(self, period: float = 0.005):
        import threading

        import psutil

        self.proc, self.period = psutil.Process(), period
        self.phase, self.first_rollout_rss, self.peaks = "setup", None, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def sample(self) -> int:
        rss = self.proc.memory_info().rss
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
        return rss

    def enter(self, phase: str) -> None:
        if phase == "rollout" and self.first_rollout_rss is None:
            self.first_rollout_rss = self.sample()
        self.sample()
        self.phase = phase

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.sample()
        gib = 2**30
        return {
            "rss_at_first_rollout_gib": None if self.first_rollout_rss is None else self.first_rollout_rss / gib,
            "peak_rss_by_phase_gib": {k: v / gib for k, v in self.peaks.items()},
        }


RSS: RssSampler | None = None


def tag_phase(name: str, fn):
    """`fn` wrapped so the RSS sampler knows the phase while it runs (the phase before is restored after)."""

    def wrapped(*args, **kwargs):
        before = RSS.phase if RSS else None
        if RSS:
            RSS.enter(name)
        try:
            return fn(*args, **kwargs)
        finally:
            if RSS:
                RSS.enter(before)

    return wrapped


# ------------------------------------------------------------------ vlmrl side (child)


def run_vlmrl(spec: dict, out: Path) -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    import vlmrl.train as vlmrl_train
    from vlmrl.config import load_config
    from vlmrl.train import train

    original_load_policy = vlmrl_train.load_policy

    def load_policy_counted(*args, **kwargs):
        model, processor = original_load_policy(*args, **kwargs)
        count_vision(model)
        return model, processor

    vlmrl_train.load_policy = load_policy_counted
    for name in ("rollout", "reward_and_advantages", "score", "update"):
        setattr(vlmrl_train, name, tag_phase({"reward_and_advantages": "rewards", "score": "scoring"}.get(name, name), getattr(vlmrl_train, name)))

    steps = spec["warmup"] + spec["steps"]
    overrides = {
        "model.name_or_path": spec["model"],
        "model.dtype": spec.get("dtype", "float32"),
        "data.train_path": spec["data"],
        "data.min_pixels": spec["pixels"],
        "data.max_pixels": spec["pixels"],
        "rollout.num_generations": spec["G"],
        "rollout.max_completion_length": spec["completion"],
        "rollout.min_completion_length": spec["completion"],
        "rollout.temperature": spec["temperature"],
        "rollout.top_p": 1.0,
        "rollout.top_k": 0,
        "algorithm.beta": spec["beta"],
        "algorithm.loss_type": spec["loss_type"],
        "algorithm.epsilon": spec["epsilon"],
        "algorithm.num_iterations": 1,
        "algorithm.scale_rewards": "group",
        "algorithm.reward_funcs": [f"{THIS}:bench_reward"],
        "optim.learning_rate": spec["learning_rate"],
        "optim.lr_scheduler_type": "constant",
        "optim.adam_beta1": spec["adam_beta1"],
        "optim.adam_beta2": spec["adam_beta2"],
        "optim.adam_epsilon": spec["adam_epsilon"],
        "optim.weight_decay": spec["weight_decay"],
        "optim.max_grad_norm": spec["max_grad_norm"],
        "training.per_device_train_batch_size": spec["completions_per_step"],
        "training.gradient_accumulation_steps": 1,
        "training.max_steps": steps,
        "training.seed": spec["seed"],
        "training.device": spec.get("device", "cpu"),
        "training.bf16": False,
        "training.output_dir": str(out / "run"),
        "training.resume": "never",
        "training.save_final_model": False,
        "logging.tensorboard": False,
        "logging.progress_bar": False,
        "logging.log_completions": 0,
        "logging.report": False,
    }
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()] + list(spec.get("vlmrl_overrides", [])))
    prompt_tokens = _vlmrl_prompt_tokens(spec)
    train(cfg, log=lambda *a: None)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/step" in r]
    n = spec["completions_per_step"]
    per_step = [
        {
            "step": r.get("step", i + 1),
            "step_s": r["time/step"],
            "rollout_s": r["time/rollout"],
            "scoring_s": r["time/scoring"] + r.get("time/rewards", 0.0),
            "update_s": r["time/update"],
            "tokens": round(r["completions/mean_length"] * n),
            "prompt_tokens": prompt_tokens * n,
        }
        for i, r in enumerate(rows)
    ]
    settings = {"memory": {k: v for k, v in cfg.memory.__dict__.items()}, "attn_implementation": cfg.model.attn_implementation}
    return {"per_step": per_step, "settings": settings}


def _vlmrl_prompt_tokens(spec: dict) -> int:
    """Tokens of one prompt (text + image placeholders) as vlmrl encodes it; every row has the same."""
    from vlmrl.data.media import load_images
    from vlmrl.models.processing import build_prompt, encode_prompts, load_processor

    row = json.loads(Path(spec["data"]).read_text().splitlines()[0])
    processor = load_processor(spec["model"], min_pixels=spec["pixels"], max_pixels=spec["pixels"])
    images = load_images([str(Path(spec["data"]).parent / row["image"])], spec["pixels"], spec["pixels"])
    batch = encode_prompts(processor, [build_prompt(processor, row["problem"], 1)], [images])
    return int(batch["attention_mask"].sum())


# ------------------------------------------------------------------ TRL side (child)


def _trl_processor(model_dir: str):
    """A real ProcessorMixin for Qwen2.5-VL without its video processor (which needs torchvision).

    Qwen2_5_VLProcessor's own constructor insists on a video processor; ProcessorMixin derives the
    sub-processors from the constructor's signature, so a subclass whose constructor takes only the
    image processor and the tokenizer behaves as the stock processor does for images."""
    from transformers import AutoTokenizer, ProcessorMixin
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class ImageOnlyQwen25VLProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    template = (Path(model_dir) / "chat_template.jinja").read_text()
    return ImageOnlyQwen25VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def run_trl(spec: dict, out: Path) -> dict:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    processor = _trl_processor(spec["model"])
    data_dir = Path(spec["data"]).parent
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": r["problem"]}] for r in rows],
            "image": [str(data_dir / r["image"]) for r in rows],
            "solution": [r["solution"] for r in rows],
        }
    ).cast_column("image", datasets.Image())

    n = spec["completions_per_step"]
    args = GRPOConfig(
        output_dir=str(out / "run"),
        use_cpu=spec.get("device", "cpu") == "cpu",
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": getattr(torch, spec.get("dtype", "float32"))},
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=spec["G"],
        num_iterations=1,
        max_completion_length=spec["completion"],
        generation_kwargs={"min_new_tokens": spec["completion"]},
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        beta=spec["beta"],
        loss_type=spec["loss_type"],
        epsilon=spec["epsilon"],
        scale_rewards="group",
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=spec["adam_beta1"],
        adam_beta2=spec["adam_beta2"],
        adam_epsilon=spec["adam_epsilon"],
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["max_grad_norm"],
        max_steps=spec["warmup"] + spec["steps"],
        seed=spec["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )

    timers = {"rollout": 0.0, "gen_and_score": 0.0, "tokens": 0, "prompt_tokens": 0}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            result = tag_phase("rollout", super()._generate)(prompts)
            timers["rollout"] += time.perf_counter() - t0
            return result

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            result = tag_phase("scoring", super()._generate_and_score_completions)(inputs)
            timers["gen_and_score"] += time.perf_counter() - t0
            mask = result["completion_mask"]
            if result.get("tool_mask") is not None:
                mask = mask * result["tool_mask"]
            timers["tokens"] += int(mask.sum())
            timers["prompt_tokens"] += int(result["prompt_mask"].sum())
            return result

    per_step: list[dict] = []

    class StepTimer(TrainerCallback):
        t_begin = t_last_end = None

        def on_step_begin(self, args, state, control, **kw):
            self.t_begin = time.perf_counter()
            if RSS:
                RSS.enter("update")  # TRL generates inside training_step: rollout and scoring are tagged inside it

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available() and spec.get("device") == "cuda":
                torch.cuda.synchronize()  # the step's kernels are done before it is timed
            now = time.perf_counter()
            step = now - self.t_begin
            rollout, score = timers["rollout"], timers["gen_and_score"] - timers["rollout"]
            per_step.append(
                {
                    "step": state.global_step,
                    "step_s": step,
                    "rollout_s": rollout,
                    "scoring_s": score,
                    "update_s": step - timers["gen_and_score"],
                    "tokens": timers["tokens"],
                    "prompt_tokens": timers["prompt_tokens"],
                    "between_s": None if self.t_last_end is None else now - self.t_last_end,
                }
            )
            self.t_last_end = now
            timers.update(rollout=0.0, gen_and_score=0.0, tokens=0, prompt_tokens=0)

    trainer = TimedGRPOTrainer(
        model=spec["model"], reward_funcs=[bench_reward], args=args, train_dataset=dataset, processing_class=processor, callbacks=[StepTimer()]
    )
    count_vision(trainer.model)
    if getattr(trainer, "ref_model", None) is not None:
        count_vision(trainer.ref_model)
    logged_lengths = []
    trainer.train()
    for entry in trainer.state.log_history:
        if "completions/mean_length" in entry:
            logged_lengths.append(entry["completions/mean_length"])
    for row, length in zip(per_step, logged_lengths):
        row["logged_mean_length"] = length
    settings = {
        "attn_implementation": trainer.model.config._attn_implementation,
        "pad_to_multiple_of": trainer.pad_to_multiple_of,
        "gradient_checkpointing": args.gradient_checkpointing,
    }
    return {"per_step": per_step, "settings": settings}


def child(side: str, spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_path).parent
    import psutil
    import torch

    torch.manual_seed(spec["seed"])
    on_gpu = spec.get("device") == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    rss_start = psutil.Process().memory_info().rss
    global RSS
    RSS = RssSampler()
    t0 = time.perf_counter()
    result = run_vlmrl(spec, out) if side == "vlmrl" else run_trl(spec, out)
    result.update(RSS.stop())
    result.update(
        side=side,
        wall_s=time.perf_counter() - t0,
        rss_at_start_gib=rss_start / 2**30,
        peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
        torch_threads=torch.get_num_threads(),
        gpu_peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        gpu_peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if on_gpu else None,
        gpu_name=torch.cuda.get_device_name() if on_gpu else None,
        vision_images_encoded_per_step=VISION["images"] / max(1, len(result["per_step"])),
        vision_calls_per_step=VISION["calls"] / max(1, len(result["per_step"])),
    )
    Path(out_path).write_text(json.dumps(result, indent=1))
    return 0


# ------------------------------------------------------------------ parent: run, check, report


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarise(result: dict, warmup: int) -> dict:
    steps = result["per_step"][warmup:]
    med = {k: _median([s[k] for s in steps]) for k in ("step_s", "rollout_s", "scoring_s", "update_s")}
    tokens = [s["tokens"] for s in steps]
    between = [s["between_s"] for s in steps if s.get("between_s") is not None]
    return {
        **{f"median_{k}": v for k, v in med.items()},
        **({"median_between_steps_s": _median(between)} if between else {}),
        "tokens_per_step": tokens,
        "trained_tokens_per_s": _median(tokens) / med["step_s"],
        "peak_rss_gib": result["peak_rss_gib"],
        "measured_steps": len(steps),
        "gpu_peak_allocated_gib": result.get("gpu_peak_allocated_gib"),
        "gpu_peak_reserved_gib": result.get("gpu_peak_reserved_gib"),
    }


def merge_rounds(results: list[dict], warmup: int) -> dict:
    """One side's rounds -> its summary: medians over every round's measured steps, the largest peaks, and the growth
    above the first rollout per round (peak RSS - RSS when the first rollout began; the largest round counts)."""
    per_step = [st for res in results for st in res["per_step"][warmup:]]
    gpu = {k: max(r[k] for r in results) for k in ("gpu_peak_allocated_gib", "gpu_peak_reserved_gib") if results[0].get(k) is not None}
    merged = summarise({"per_step": per_step, "peak_rss_gib": max(r["peak_rss_gib"] for r in results), **gpu}, 0)
    growth = [r["peak_rss_gib"] - r["rss_at_first_rollout_gib"] for r in results if r.get("rss_at_first_rollout_gib") is not None]
    merged.update(
        rss_at_start_gib=max(r["rss_at_start_gib"] for r in results),
        rss_at_first_rollout_gib=max((r.get("rss_at_first_rollout_gib") or 0.0) for r in results),
        growth_above_first_rollout_gib=max(growth) if growth else None,
        growth_above_first_rollout_by_round_gib=growth,
        peak_rss_by_phase_gib=[r.get("peak_rss_by_phase_gib") for r in results],
        settings=results[0].get("settings"),
        vision_images_encoded_per_step=results[0].get("vision_images_encoded_per_step"),
        vision_calls_per_step=results[0].get("vision_calls_per_step"),
        per_step_all_rounds=[res["per_step"] for res in results],
    )
    return merged


def library_versions() -> dict:
    out = {"python": platform.python_version()}
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("torch", "transformers", "trl", "accelerate", "datasets", "tokenizers", "vlmrl"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def machine() -> dict:
    info = {"cpu": platform.processor() or "?", "cores": os.cpu_count()}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["cpu"] = value.strip()
            if key.strip() == "CPU(s)":
                info["cores"] = int(value.strip())
    except (OSError, subprocess.CalledProcessError, ValueError):
        pass
    mem = Path("/proc/meminfo")
    if mem.is_file():
        info["ram_gib"] = round(int(mem.read_text().split()[1]) / 2**20, 1)
    return info


def markdown(record: dict) -> str:
    m, libs = record["machine"], record["libraries"]
    gpu = record.get("device") == "cuda"
    where = f"GPU ({record.get('gpu')})" if gpu else "CPU"
    dtype = {"float32": "fp32", "bfloat16": "bf16"}[record.get("dtype", "float32")]
    gpu_head = " GPU peak alloc / reserved GiB |" if gpu else ""
    lines = [
        f"# vlmrl vs TRL GRPOTrainer on {where} ({record['date']})",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m.get('ram_gib', '?')} GiB RAM; torch threads {record['torch_threads']}",
        "- libraries: " + ", ".join(f"{k} {v}" for k, v in libs.items()),
        f"- allocator: GLIBC_TUNABLES={record['glibc_tunables'] or '(unset, glibc defaults)'} (same for both sides)",
        f"- command: `{record['command']}`",
        (
            f"- steps: {record['warmup']} warm-up + {record['steps']} measured per side, {record['rounds']} round(s) alternating vlmrl, TRL; "
            "medians over measured steps (over all rounds)"
        ),
        f"- vlmrl overrides beyond its defaults: {record.get('vlmrl_overrides') or 'none'}",
        f"- common: {dtype} weights, {'CUDA' if gpu else 'CPU'}, "
        + ", ".join(f"{k}={v}" for k, v in COMMON.items())
        + "; one rollout and one optimizer step per step, all completions in one micro-batch on both sides",
        "",
        f"| config | side | step s | rollout s | scoring s | update s | peak RSS GiB |{gpu_head} trained tok/s | tok/step | images encoded/step |",
        "|---|---|---|---|---|---|---|" + ("---|" if gpu else "") + "---|---|---|",
    ]
    for c in record["configs"]:
        for side in ("vlmrl", "trl"):
            s = c[side]
            gpu_cell = f" {s['gpu_peak_allocated_gib']:.2f} / {s['gpu_peak_reserved_gib']:.2f} |" if gpu else ""
            lines.append(
                f"| {c['name']} | {side} | {s['median_step_s']:.3f} | {s['median_rollout_s']:.3f} | {s['median_scoring_s']:.3f} | "
                f"{s['median_update_s']:.3f} | {s['peak_rss_gib']:.2f} |{gpu_cell} {s['trained_tokens_per_s']:.0f} | "
                f"{_median(s['tokens_per_step']):.0f} | "
                f"{s.get('vision_images_encoded_per_step') if s.get('vision_images_encoded_per_step') is not None else '?'} |"
            )
        r = c["ratios_vlmrl_over_trl"]
        gpu_cell = f" **{r['gpu_peak_allocated']:.2f} / {r['gpu_peak_reserved']:.2f}** |" if gpu else ""
        lines.append(
            f"| {c['name']} | **vlmrl/TRL** | **{r['step_time']:.2f}** | {r['rollout']:.2f} | {r['scoring']:.2f} | "
            f"{r['update']:.2f} | "
            f"**{r['peak_rss']:.2f}** |{gpu_cell} {r['throughput']:.2f} | equal: {c['equal_work']} | |"
        )
    lines += [
        "",
        "Ratios are vlmrl / TRL: below 1 means vlmrl is faster or smaller, except throughput (above 1 = vlmrl trains more tokens per second).",
        "",
        "Configurations:",
        "",
    ]
    for c in record["configs"]:
        lines.append(
            f"- **{c['name']}**: {c['title']}; image {c['image']}x{c['image']} px, vocab {c['vocab'] or 'tokenizer (~600)'}, "
            f"{c['prompts']} prompt(s) x G={c['G']} = {c['completions_per_step']} completions of {c['completion']} tokens per step; "
            f"prompt tokens per step {c.get('prompt_tokens_per_step')} (same on both sides)"
        )
    memory = "GPU peak reserved" if gpu else "peak RSS"
    lines += ["", f"Targets (issue 7): on a and b, vlmrl step time <= 0.5x TRL's and {memory} <= 0.5x TRL's.", ""]
    for c in record["configs"]:
        if c["name"] in ("a", "b"):
            r = c["ratios_vlmrl_over_trl"]
            mem = r["gpu_peak_reserved"] if gpu else r["peak_rss"]
            lines.append(
                f"- {c['name']}: step time {r['step_time']:.2f}x ({'met' if r['step_time'] <= 0.5 else 'NOT met'}), "
                f"{memory} {mem:.2f}x ({'met' if mem <= 0.5 else 'NOT met'})"
            )
    lines += ["", "Growth above the first rollout (peak RSS - RSS when the first rollout began: what training adds beyond the"]
    lines += ["libraries, model, reference and optimizer moments; issue 27 targets on b: <= 0.3x TRL's, throughput >= 3x):", ""]
    for c in record["configs"]:
        v, t, r = c["vlmrl"], c["trl"], c["ratios_vlmrl_over_trl"]
        if r.get("growth_above_first_rollout") is None:
            continue
        lines.append(
            f"- {c['name']}: vlmrl {v['growth_above_first_rollout_gib']:.2f} GiB (first rollout at {v['rss_at_first_rollout_gib']:.2f}), "
            f"TRL {t['growth_above_first_rollout_gib']:.2f} GiB (at {t['rss_at_first_rollout_gib']:.2f}): "
            f"**{r['growth_above_first_rollout']:.2f}x**"
            + (
                f" ({'met' if r['growth_above_first_rollout'] <= 0.3 else 'NOT met'}); throughput {r['throughput']:.2f}x "
                f"({'met' if r['throughput'] >= 3 else 'NOT met'})"
                if c["name"] == "b"
                else ""
            )
        )
    if record.get("load"):
        lines += ["", "Machine load (1-minute average) before / after each side: " + "; ".join(record["load"])]
    if record.get("note"):
        lines += ["", f"Note: {record['note']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="a,b,c")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per side (after the warm-up; the issue asks for >= 5)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per side, not measured")
    ap.add_argument("--rounds", type=int, default=1, help="alternations vlmrl, TRL per config")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1+2 steps: checks the harness")
    ap.add_argument(
        "--allocator",
        choices=["default", "tuned"],
        default="default",
        help=f"default: glibc defaults for both sides (what a user's process gets); tuned: GLIBC_TUNABLES={GLIBC_TUNED} "
        "for both (no mmap, no trim: faster big-vocabulary steps, but peak RSS becomes the heap's high-water mark)",
    )
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: both sides on the GPU; also records torch.cuda.max_memory_allocated / reserved per side",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights' dtype on both sides")
    ap.add_argument("--work", default="/tmp/vlmrl_vs_trl", help="scratch folder for models, data and runs")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; with --quick: <work>/results)")
    ap.add_argument(
        "--vlmrl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vlmrl config override (repeatable), e.g. memory.logprob_chunk_tokens=128; recorded in the results",
    )
    ap.add_argument("--note", default=None, help="free text stored with the results (e.g. 'preliminary: machine busy')")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        return child(a._child, a._spec, a._result)

    given = argv if argv is not None else sys.argv[1:]
    if a.quick and not any(g.startswith("--steps") for g in given):
        a.steps = 2
    if a.quick and not any(g.startswith("--warmup") for g in given):
        a.warmup = 1
    table = QUICK if a.quick else CONFIGS
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {','.join(table)}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    env.pop("GLIBC_TUNABLES", None)
    if a.allocator == "tuned":
        env["GLIBC_TUNABLES"] = GLIBC_TUNED
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)

    record = {
        "date": datetime.date.today().isoformat(),
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "libraries": library_versions(),
        "glibc_tunables": env.get("GLIBC_TUNABLES"),
        "command": shlex.join(["python", "benchmarks/vs_trl.py", *(argv if argv is not None else sys.argv[1:])]),
        "warmup": a.warmup,
        "steps": a.steps,
        "rounds": a.rounds,
        "quick": a.quick,
        "note": a.note,
        "vlmrl_overrides": a.vlmrl_override,
        "device": a.device,
        "dtype": a.dtype,
        "configs": [],
    }
    failures = []
    for name in names:
        spec = prepare(name, table[name], work)
        spec.update(warmup=a.warmup, steps=a.steps, vlmrl_overrides=a.vlmrl_override, device=a.device, dtype=a.dtype)
        spec_path = work / f"config_{name}" / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        runs: dict[str, list] = {"vlmrl": [], "trl": []}
        for rnd in range(a.rounds):
            for side in ("vlmrl", "trl"):
                run_dir = work / f"config_{name}" / f"{side}_r{rnd}"
                if run_dir.exists():
                    import shutil

                    shutil.rmtree(run_dir)
                run_dir.mkdir(parents=True)
                result_path = run_dir / "result.json"
                print(f"[{name}] round {rnd + 1}/{a.rounds}: {side} ...", flush=True)
                load_before = os.getloadavg()[0]
                proc = subprocess.run(
                    [sys.executable, str(THIS), "--_child", side, "--_spec", str(spec_path), "--_result", str(result_path)],
                    check=False,
                    env=env,
                    cwd=str(ROOT),
                    capture_output=True,
                    text=True,
                )
                (run_dir / "log.txt").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
                if proc.returncode != 0 or not result_path.is_file():
                    print(proc.stderr[-4000:], file=sys.stderr)
                    print(f"[{name}] {side} failed (exit {proc.returncode}); log: {run_dir / 'log.txt'}", file=sys.stderr)
                    return 1
                res = json.loads(result_path.read_text())
                record.setdefault("load", []).append(f"{name} {side} r{rnd}: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
                runs[side].append(res)
                s = summarise(res, a.warmup)
                print(
                    f"[{name}] {side}: median step {s['median_step_s']:.3f}s, peak RSS {s['peak_rss_gib']:.2f} GiB "
                    f"(first rollout at {res.get('rss_at_first_rollout_gib') or float('nan'):.2f}; by phase "
                    + ", ".join(f"{k} {x:.2f}" for k, x in (res.get("peak_rss_by_phase_gib") or {}).items())
                    + f"), tokens/step {s['tokens_per_step']}",
                    flush=True,
                )
        merged = {side: merge_rounds(results, a.warmup) for side, results in runs.items()}
        record["torch_threads"] = runs["vlmrl"][0]["torch_threads"]
        record["gpu"] = runs["vlmrl"][0].get("gpu_name")
        # Equal work: every measured and warm-up step of every round must train the same number of tokens.
        expected = spec["completions_per_step"] * spec["completion"]
        v_tok = [st["tokens"] for res in runs["vlmrl"] for st in res["per_step"]]
        t_tok = [st["tokens"] for res in runs["trl"] for st in res["per_step"]]
        t_logged = [
            round(st["logged_mean_length"] * spec["completions_per_step"])
            for res in runs["trl"]
            for st in res["per_step"]
            if st.get("logged_mean_length") is not None
        ]
        v_prompt = {st["prompt_tokens"] for res in runs["vlmrl"] for st in res["per_step"]}
        t_prompt = {st["prompt_tokens"] for res in runs["trl"] for st in res["per_step"]}
        equal = (
            len(v_tok) == len(t_tok)
            and set(v_tok) == set(t_tok) == {expected}
            and set(t_logged) <= {expected}
            and len(v_prompt) == 1
            and v_prompt == t_prompt
        )
        if not equal:
            failures.append(
                f"config {name}: work differs: completion tokens trained per step vlmrl {v_tok}, TRL {t_tok} "
                f"(TRL's own log: {t_logged}; expected {expected} = {spec['completions_per_step']} completions x "
                f"{spec['completion']} tokens); prompt tokens per step vlmrl {sorted(v_prompt)}, TRL {sorted(t_prompt)}"
            )
        v, t = merged["vlmrl"], merged["trl"]
        ratios = {
            "step_time": v["median_step_s"] / t["median_step_s"],
            "rollout": v["median_rollout_s"] / t["median_rollout_s"],
            "scoring": v["median_scoring_s"] / t["median_scoring_s"] if t["median_scoring_s"] > 0 else float("nan"),
            "update": v["median_update_s"] / t["median_update_s"],
            "peak_rss": v["peak_rss_gib"] / t["peak_rss_gib"],
            "throughput": v["trained_tokens_per_s"] / t["trained_tokens_per_s"],
        }
        if v.get("growth_above_first_rollout_gib") is not None and t.get("growth_above_first_rollout_gib"):
            ratios["growth_above_first_rollout"] = v["growth_above_first_rollout_gib"] / t["growth_above_first_rollout_gib"]
        if v.get("gpu_peak_reserved_gib") is not None:  # on a GPU the memory target is on the device's peaks
            ratios["gpu_peak_allocated"] = v["gpu_peak_allocated_gib"] / t["gpu_peak_allocated_gib"]
            ratios["gpu_peak_reserved"] = v["gpu_peak_reserved_gib"] / t["gpu_peak_reserved_gib"]
        record["configs"].append(
            {
                **{k: spec[k] for k in ("name", "title", "image", "vocab", "completion", "G", "prompts", "completions_per_step")},
                "image_tokens_per_prompt": (spec["image"] // 28) ** 2,
                "equal_work": equal,
                "tokens_per_step_expected": expected,
                "prompt_tokens_per_step": sorted(v_prompt),
                "vlmrl": v,
                "trl": t,
                "ratios_vlmrl_over_trl": ratios,
            }
        )
        print(f"[{name}] ratios vlmrl/TRL: " + ", ".join(f"{k} {x:.2f}" for k, x in ratios.items()) + f"; equal work: {equal}", flush=True)

    out = Path(a.out) if a.out else (work / "results" if a.quick else ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    where = "cpu" if a.device == "cpu" else (record.get("gpu") or "cuda").replace(" ", "-")
    stem = (
        f"vs_trl_{where}_{record['date']}"
        + ("_quick" if a.quick else "")
        + ("_overrides" if a.vlmrl_override else "")
        + ("_tuned_allocator" if a.allocator == "tuned" else "")
    )
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    (out / f"{stem}.md").write_text(markdown(record))
    print(markdown(record))
    print(f"wrote {out / (stem + '.json')} and .md")
    if failures:
        print("EQUAL-WORK CHECK FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
