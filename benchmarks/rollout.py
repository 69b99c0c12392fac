"""Rollout throughput: HF generate vs today's loop (rollout.engine=loop) vs the continuous engine.

    python benchmarks/rollout.py                 # CPU, writes benchmarks/results/rollout_<device>_<date>.{md,json}
    python benchmarks/rollout.py --quick         # vocab 20,000, short completions: checks the harness in a minute
    python benchmarks/rollout.py --device cuda   # on a GPU

Workload (issue 17, part 5): tiny Qwen2.5-VL (2 layers, hidden 128) with a Qwen-size vocabulary (151,936), one
56x56 image per prompt, fp32, sampling at temperature 1. Completion lengths come from a distribution, not forced:
the LM head gets a bias on the EOS logit so that, on this random model, EOS has a near-constant probability
per token (hazard `--eos-rate`), i.e. lengths roughly geometric (mean ~ 1/rate) capped at --max-new-tokens. The bias
is part of the model, so HF generate, the loop and the engine all sample from the same distribution. The loop and
the engine get the same per-row sampling streams (generate(prompt_seeds=...)), so they produce the same
completions token for token and do the same useful work; HF generate draws with torch.multinomial from its own
stream, so its lengths differ run to run (reported per method; tokens/s divides them out).

Per configuration (prompts x G) the three methods run in turn, `--repeats` times (alternating: hf, loop, engine,
hf, ...; the same seed per repeat), and the median wall time is reported. decode tokens/s = completion tokens
produced (up to and including EOS, summed over rows) / wall time of the whole rollout call (prefill included);
time per step = the wall time of one rollout call (one GRPO step's rollout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

CONFIGS = [dict(prompts=4, G=8), dict(prompts=8, G=4), dict(prompts=2, G=16)]
QUICK_CONFIGS = [dict(prompts=2, G=4)]
ENGINE_STEPS = {"engine": "dynamic", "engine-static": "static", "engine-graph": "cuda_graph"}
PROBLEMS = ["what is shown?", "describe the picture", "count the objects", "what colour dominates?", "is there text?"]


def build_model(folder: Path, vocab: int) -> Path:
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    if not (folder / "config.json").exists():
        build_tiny_qwen25vl(folder, seed=0, min_pixels=56 * 56, max_pixels=56 * 56, vocab_size=vocab)
    return folder


def add_eos_bias(model, eos_ids: list[int], rate: float) -> float:
    """Give the LM head a bias on EOS so that P(EOS) ~ rate per token on this random model; returns the bias.
    The other logits of a random tiny model are small (|z| ~ 0.1), so logsumexp(others) ~ log(V - 1)."""
    import torch

    from vlmrl.models.loading import unwrap

    core = unwrap(model)
    old = core.lm_head
    head = torch.nn.Linear(
        old.in_features, old.out_features, bias=True, device=old.weight.device, dtype=old.weight.dtype
    )  # the model may already sit on the GPU
    head.weight = old.weight
    bias = math.log(old.out_features - 1) + math.log(rate / (1 - rate))
    with torch.no_grad():
        head.bias.zero_()
        head.bias[eos_ids] = bias
    core.lm_head = head
    return bias


def prompts_for(processor, n: int, device):
    import numpy as np
    from PIL import Image

    from vlmrl.models.processing import build_prompt, encode_prompts

    rng = np.random.default_rng(0)
    texts = [build_prompt(processor, PROBLEMS[i % len(PROBLEMS)], 1) for i in range(n)]
    images = [[Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))] for _ in range(n)]
    batch = encode_prompts(processor, texts, images)
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in batch.items()}


def run_once(method: str, model, tokenizer, prompts, G: int, max_new: int, decode_batch: int, seed: int) -> dict:
    import torch

    from vlmrl.models.rollout import generate

    kw = dict(num_generations=G, max_new_tokens=max_new, temperature=1.0, do_sample=True)
    torch.manual_seed(seed)
    if method == "hf":
        kw["shared_prefix"] = False
    else:  # loop and engine: the same per-row streams, hence the same completions (the same work, token for token)
        kw["prompt_seeds"] = torch.randint(0, 2**62, (prompts["input_ids"].shape[0],)).tolist()
    if method in ENGINE_STEPS:  # engine-static / engine-graph: rollout.decode_step=static / cuda_graph (benchmarks/gpu_suite.py)
        kw.update(engine="continuous", decode_batch_size=decode_batch, decode_step=ENGINE_STEPS[method])
    elif method != "loop" and method != "hf":
        raise ValueError(f"unknown method {method!r}: hf, loop, {', '.join(ENGINE_STEPS)}")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    comp = generate(model, tokenizer, prompts, **kw)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    lengths = comp.lengths.tolist()
    return dict(wall_s=wall, tokens=int(sum(lengths)), lengths=lengths, width=int(comp.ids.shape[1]))


def summarise(runs: list[dict]) -> dict:
    wall = statistics.median(r["wall_s"] for r in runs)
    tokens = statistics.median(r["tokens"] for r in runs)
    lengths = sorted(length for r in runs for length in r["lengths"])
    q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]  # noqa: E731
    tps = statistics.median(r["tokens"] / r["wall_s"] for r in runs)
    return dict(
        median_wall_s=wall,
        median_tokens=tokens,
        median_tokens_per_s=tps,
        length_mean=sum(lengths) / len(lengths),
        length_p50=q(0.5),
        length_p90=q(0.9),
        length_max=lengths[-1],
        walls=[r["wall_s"] for r in runs],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--eos-rate", type=float, default=1 / 40, help="P(EOS) per token: lengths ~ geometric, mean ~ 1/rate")
    ap.add_argument("--decode-batch", type=int, default=0, help="the engine's rollout.decode_batch_size (0 = all rows: the config default)")
    ap.add_argument("--methods", default="hf,loop,engine")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", help="prompts x G list, e.g. 4x8,8x4 (default: 4x8,8x4,2x16)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--work", default="/tmp/vlmrl-bench-rollout")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--render", help="only write the .md of an existing results .json (with --notes)")
    ap.add_argument("--notes", help="a markdown file appended to the .md (machine load, observations)")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        write_md(Path(args.render).with_suffix(".md"), data["meta"], data["results"], args.notes)
        return 0

    import torch
    import transformers

    from vlmrl.models.loading import load_model
    from vlmrl.models.processing import load_processor
    from vlmrl.models.rollout import eos_token_ids

    torch.set_num_threads(args.threads)
    vocab = 20_000 if args.quick else 151_936
    max_new = 16 if args.quick else args.max_new_tokens
    folder = build_model(Path(args.work) / f"tiny-qwen25vl-v{vocab}", vocab)
    cfg = argparse.Namespace(
        name_or_path=str(folder), dtype="float32", attn_implementation="sdpa", freeze_vision_tower=False, train_projector_only=False,
        use_lora=False, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=[], lora_vision=False, trust_remote_code=False,
        allow_hub_download=False, gradient_checkpointing=False,
    )  # fmt: skip
    model = load_model(cfg).to(args.device).eval()
    processor = load_processor(folder)
    bias = add_eos_bias(model, eos_token_ids(model, processor.tokenizer), args.eos_rate)
    methods = args.methods.split(",")
    results = []
    date = datetime.date.today().isoformat()
    meta = dict(
        date=date,
        command="python " + " ".join(sys.argv),
        device=args.device,
        machine=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        torch_threads=args.threads,
        torch=torch.__version__,
        transformers=transformers.__version__,
        vocab=vocab,
        max_new_tokens=max_new,
        eos_rate=args.eos_rate,
        eos_bias=bias,
        decode_batch=args.decode_batch,
        repeats=args.repeats,
        commit=_git_commit(),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"rollout_{args.device}{'_quick' if args.quick else ''}_{date}{args.tag}"

    def save() -> None:
        stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, results=results), indent=2))
        write_md(stem.with_suffix(".md"), meta, results, args.notes)

    specs = QUICK_CONFIGS if args.quick else CONFIGS
    if args.configs:
        specs = [dict(prompts=int(p), G=int(g)) for p, g in (c.split("x") for c in args.configs.split(","))]
    for spec in specs:
        prompts = prompts_for(processor, spec["prompts"], args.device)
        for m in methods:  # warm-up (allocator, first-call costs), not measured
            run_once(m, model, processor.tokenizer, prompts, spec["G"], 8, args.decode_batch, seed=0)
        runs = {m: [] for m in methods}
        for rep in range(args.repeats):
            for m in methods:
                runs[m].append(run_once(m, model, processor.tokenizer, prompts, spec["G"], max_new, args.decode_batch, seed=1000 + rep))
                print(spec, m, rep, f"{runs[m][-1]['wall_s']:.2f}s {runs[m][-1]['tokens']} tokens", flush=True)
        row = dict(**spec, rows=spec["prompts"] * spec["G"], methods={m: summarise(r) for m, r in runs.items()})
        results.append(row)
        save()  # after every configuration: an interrupted run keeps what it measured
    print(table(meta, results))
    print(f"wrote {stem}.json")
    return 0


def _git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_md(path: Path, meta: dict, results: list[dict], notes: str | None) -> None:
    head = [
        f"# Rollout throughput, {meta['device']}, {meta['date']}",
        "",
        f"Machine: {meta['machine']}, {meta['cpu_count']} CPUs; torch {meta['torch']}, transformers {meta['transformers']}; "
        f"vlmrl commit {meta.get('commit', 'unknown')}.",
        "Methods: **hf** = HF generate with num_return_sequences (rollout with memory.shared_prefix=false); **loop** = today's",
        "shared-prefix loop (rollout.engine=loop); **engine** = the continuous-batching engine (rollout.engine=continuous,",
        f"rollout.decode_batch_size={meta['decode_batch']}). Workload and definitions: the docstring of benchmarks/rollout.py.",
        "",
    ]
    body = table(meta, results)
    tail = ["", Path(notes).read_text()] if notes else []
    path.write_text("\n".join(head) + "\n" + body + "\n" + "\n".join(tail))


def table(meta: dict, results: list[dict]) -> str:
    lines = [
        f"`{meta['command']}`: vocab {meta['vocab']:,}, max {meta['max_new_tokens']} new tokens, EOS rate {meta['eos_rate']:.4f}/token, "
        f"engine decode batch {meta['decode_batch']}, {meta['repeats']} repeats (median), {meta['torch_threads']} torch thread(s). "
        "x loop, x HF: ratios of the median tokens/s (unpaired: under changing load prefer ratios within one repeat).",
        "",
        "| prompts x G | rows | method | time per step (s) | decode tokens/s | tokens | length mean / p50 / p90 / max | x loop | x HF |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        ms = row["methods"]
        for name, s in ms.items():
            x_loop = s["median_tokens_per_s"] / ms["loop"]["median_tokens_per_s"] if "loop" in ms else float("nan")
            x_hf = s["median_tokens_per_s"] / ms["hf"]["median_tokens_per_s"] if "hf" in ms else float("nan")
            lines.append(
                f"| {row['prompts']} x {row['G']} | {row['rows']} | {name} | {s['median_wall_s']:.2f} | {s['median_tokens_per_s']:.0f} | "
                f"{s['median_tokens']:.0f} | {s['length_mean']:.1f} / {s['length_p50']} / {s['length_p90']} / {s['length_max']} | "
                f"{x_loop:.2f} | {x_hf:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
