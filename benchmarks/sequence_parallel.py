"""Per-process host memory of one long row's scoring + update pass with Ulysses sequence parallelism: SP 1 (one
process) vs SP 2 (two gloo processes), on the CPU.

    python benchmarks/sequence_parallel.py            # writes benchmarks/results/sequence_parallel_cpu_<date>.{json,md}
    python benchmarks/sequence_parallel.py --quick    # a small row and model: checks the harness, writes nothing

Workload (defaults): one prompt with 4 images of 448 x 448 px (256 merged tokens each, 1,024 image tokens) and one
512-token completion, on a Qwen2.5-VL built offline (vlmrl.tiny_models: hidden 1024, 4 decoder layers, 8 heads /
2 KV heads, MLP 2816, a 2-layer vision encoder of width 64) in fp32: a decoder much wider than the vision encoder, so
that most of the pass's memory is in the part SP splits. The pass is what a GRPO step runs per micro-batch: the
policy's log-probs without gradients (old log-probs), then log-probs with gradients, the GRPO loss and backward
(engine/ulysses.py under SP 2, exactly as `vlmrl train` enters it). Each process is fresh (spawned); its peak RSS
(VmHWM) is reset (/proc/self/clear_refs) just before the pass, so `pass peak` is the process's peak during the pass
and `pass increment` = pass peak - RSS before the pass (the model and the prompt tensors are counted before it; the
parameter gradients, allocated in the pass, are reported apart).
Also checked: SP 2's log-probs equal SP 1's (max |diff|). What SP does not split here (yet): the vision encoder
(whole on every process) and the LM head / log-prob chunks (the gathered hidden states, whole on every process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> None:
    """VmHWM := VmRSS (Linux: writing 5 to /proc/self/clear_refs resets the peak resident set size)."""
    Path("/proc/self/clear_refs").write_text("5")


def _worker(rank: int, world: int, port: int, args: dict, queue) -> None:
    try:
        queue.put((rank, _measure(rank, world, port, args)))
    except BaseException as e:  # the parent stops at once with the reason
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise


def _measure(rank: int, world: int, port: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from vlmrl.algo.losses import aggregate, per_token_loss, step_normaliser
    from vlmrl.config import AlgorithmConfig, load_config
    from vlmrl.data.rows import load_dataset_split
    from vlmrl.engine import ulysses
    from vlmrl.models.logprobs import group_rows
    from vlmrl.models.policy import load_policy
    from vlmrl.models.prefix import LogprobOptions, completion_logps_for
    from vlmrl.run.datasets import encode_rows

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", HF_HUB_OFFLINE="1"
    )
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo")
    pixels = args["image_px"] ** 2
    cfg = load_config(None, [f"model.name_or_path={args['model']}", f"data.min_pixels={pixels}", f"data.max_pixels={pixels}", "training.device=cpu"])
    model, processor = load_policy(cfg, torch.device("cpu"))
    model.train()
    rows, _ = load_dataset_split(args["data"], limit_images=args["images"], skip_bad_rows=False)
    prompts = encode_rows(processor, rows[:1], cfg, torch.device("cpu"))
    _, row_prompt = group_rows(torch.zeros(1, dtype=torch.long))
    width = args["completion"]
    ids = torch.randint(10, 200, (1, width), generator=torch.Generator().manual_seed(0))
    special = [getattr(model.config, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
    ids[torch.isin(ids, torch.tensor([t for t in special if t is not None]))] = 10  # plain text tokens only
    mask = torch.ones(1, width, dtype=torch.long)
    opts = LogprobOptions(chunk_tokens=1024)
    split = ulysses.sequence_parallel(model) if world > 1 else torch.enable_grad()
    dist.barrier()
    _reset_peak()
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    with split:
        with torch.no_grad():
            old = completion_logps_for(model, prompts, row_prompt, ids, mask, opts)
        logps = completion_logps_for(model, prompts, row_prompt, ids, mask, opts)
        tok_loss, _ = per_token_loss(logps, old, torch.tensor([1.0]), AlgorithmConfig())
        loss = aggregate(tok_loss, mask, "grpo", step_normaliser([mask], width))
        loss.backward()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    out = {
        "rank": rank,
        "prompt_tokens": int(prompts["attention_mask"].sum()),
        "image_tokens": int((prompts["input_ids"] == model.config.image_token_id).sum()),
        "rss_before_gib": before / 2**20,
        "pass_peak_gib": peak / 2**20,
        "pass_increment_gib": (peak - before) / 2**20,
        "gradients_gib": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None) / 2**30,
        "seconds": seconds,
        "logps": logps.detach()[0].tolist(),
        "split": ulysses.take_split_metrics() if world > 1 else {},
    }
    dist.destroy_process_group()
    return out


def _run(world: int, args: dict) -> list[dict]:
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    ctx = mp.get_context("spawn")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, store.port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=args["timeout"]) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    bad = {r: v for r, v in results.items() if isinstance(v, str)}
    if bad:
        raise SystemExit(f"SP {world}: {bad}")
    return [results[r] for r in range(world)]


def _setup(folder: Path, quick: bool, images: int, image_px: int) -> tuple[Path, Path]:
    """The model folder and a one-row dataset of `images` noise images of image_px x image_px."""
    import numpy as np
    from PIL import Image

    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    size = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256) if quick else {}
    if not quick:
        size = dict(hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=2816)
    model = build_tiny_qwen25vl(folder / "model", **size, max_pixels=image_px**2)
    rng = np.random.default_rng(0)
    names = []
    for i in range(images):
        Image.fromarray(rng.integers(0, 255, (image_px, image_px, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        names.append(f"img{i}.png")
    data = folder / "row.jsonl"
    data.write_text(json.dumps({"images": names, "problem": "Describe the four images in detail.", "solution": "x"}) + "\n")
    return model, data


def _markdown(result: dict) -> str:
    w = result["workload"]
    lines = [
        f"# Ulysses sequence parallelism: per-process host memory of one long row ({result['date']}, CPU, gloo)",
        "",
        f"Row: {w['prompt_tokens']} prompt tokens ({w['image_tokens']} image tokens from {w['images']} images of {w['image_px']} px) "
        f"+ {w['completion']} completion tokens; model: Qwen2.5-VL built offline, {w['model']} (fp32). One pass = old log-probs "
        "without gradients + log-probs with gradients, GRPO loss, backward. Peaks are VmHWM reset just before the pass.",
        "",
        "| SP | process | RSS before (GiB) | pass peak (GiB) | pass increment (GiB) | of which parameter gradients (GiB) | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for sp in ("1", "2"):
        for r in result["runs"][sp]:
            lines.append(
                f"| {sp} | {r['rank']} | {r['rss_before_gib']:.3f} | {r['pass_peak_gib']:.3f} | {r['pass_increment_gib']:.3f} "
                f"| {r['gradients_gib']:.3f} | {r['seconds']:.1f} |"
            )
    ratio = result["ratio"]
    lines += [
        "",
        f"Per-process pass peak, SP 2 (max over processes) / SP 1: **{ratio['pass_peak']:.3f}**; pass increment: "
        f"**{ratio['pass_increment']:.3f}**; pass increment less the parameter gradients (whole on every process): "
        f"**{ratio['increment_less_gradients']:.3f}**. SP 2's log-probs vs SP 1's: max |diff| {result['max_abs_logp_diff']:.2e}.",
        "",
        "Not split by SP here (yet): the vision encoder (whole on every process) and the LM head over the gathered hidden "
        "states; the model and its gradients are whole on every process (DDP). Seconds are wall time on a shared 2-core "
        "machine (other jobs running), not a speed comparison.",
        "",
        f"Command: `{result['command']}`; {result['machine']}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small row and model: check the harness, write nothing")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = parser.parse_args()
    import tempfile

    images, image_px, completion = (2, 112, 32) if a.quick else (4, 448, 512)
    with tempfile.TemporaryDirectory() as tmp:
        model, data = _setup(Path(tmp), a.quick, images, image_px)
        args = dict(model=str(model), data=str(data), images=images, image_px=image_px, completion=completion, threads=a.threads, timeout=1800)
        runs = {str(sp): _run(sp, args) for sp in (1, 2)}
    one, two = runs["1"][0], runs["2"]
    diff = max(abs(x - y) for r in two for x, y in zip(one["logps"], r["logps"]))
    for r in (one, *two):
        r.pop("logps")
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/sequence_parallel.py" + (" --quick" if a.quick else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads per process {a.threads}",
        "workload": dict(
            images=images,
            image_px=image_px,
            completion=completion,
            prompt_tokens=one["prompt_tokens"],
            image_tokens=one["image_tokens"],
            model="hidden 128, 2 layers" if a.quick else "hidden 1024, 4 decoder layers, 8 heads / 2 KV heads, MLP 2816, vision 2 x 64",
        ),
        "runs": runs,
        "ratio": {
            "pass_peak": max(r["pass_peak_gib"] for r in two) / one["pass_peak_gib"],
            "pass_increment": max(r["pass_increment_gib"] for r in two) / one["pass_increment_gib"],
            "increment_less_gradients": max(r["pass_increment_gib"] - r["gradients_gib"] for r in two)
            / (one["pass_increment_gib"] - one["gradients_gib"]),
        },
        "max_abs_logp_diff": diff,
    }
    text = _markdown(result)
    print(text)
    if not a.quick:
        stem = Path(a.out) / f"sequence_parallel_cpu_{result['date']}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        stem.with_suffix(".md").write_text(text)
        print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
