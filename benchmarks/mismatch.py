"""Rollout-training mismatch on CPU: the sampler's per-token log-probs (recorded at the decode step that chose each
token) against the scoring pass's (`completion_logps_for`, as train.py scores old log-probs), for the decode loop
(all rows in one batch) and the continuous engine at several decode batch sizes, in fp32 and (--bf16) in bf16: fp32
weights under bf16 autocast (training.bf16) and bf16 weights (model.dtype=bfloat16).

    python benchmarks/mismatch.py [--bf16]     # writes benchmarks/results/mismatch_cpu_<date>.md and .json

Every engine draws each row from its own seeded stream (rollout.engine=continuous's rule), so the same tokens are
scored in every setting of one dtype; what differs is the decode batch each token's logits were computed in.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import tempfile

import numpy as np
import torch

from vlmrl.models.logprobs import group_rows
from vlmrl.algo.mismatch import log_ratios, mismatch_metrics
from vlmrl.models.loading import load_model
from vlmrl.models.prefix import LogprobOptions, completion_logps_for
from vlmrl.models.processing import build_prompt, encode_prompts, load_processor
from vlmrl.models.rollout import generate


def _model_config(path: str, dtype: str = "float32"):
    from vlmrl.config import ModelConfig

    return ModelConfig(name_or_path=path, dtype=dtype, attn_implementation="sdpa")


def _prompts(processor, n: int, seed: int) -> dict:
    from PIL import Image

    rng = np.random.default_rng(seed)
    texts = [build_prompt(processor, ["how many shapes?", "describe the picture in detail", "count the red ones"][i % 3], 1) for i in range(n)]
    images = [[Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))] for _ in range(n)]
    return encode_prompts(processor, texts, images)


def prompts_on(processor, n: int, device, seed: int = 0) -> dict:
    """`n` one-image prompts on `device`."""
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in _prompts(processor, n, seed).items()}


def measure(model, processor, prompts, *, engine: str, decode_batch_size: int, bf16: bool, G: int, max_new: int, temperature: float) -> dict:
    n = prompts["input_ids"].shape[0]
    seeds = [1000 + i for i in range(n)]
    device_type = prompts["input_ids"].device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        comp = generate(
            model,
            processor.tokenizer,
            prompts,
            num_generations=G,
            max_new_tokens=max_new,
            temperature=temperature,
            engine=engine,
            decode_batch_size=decode_batch_size,
            prompt_seeds=seeds,
        )
    _, row_prompt = group_rows(torch.arange(n).repeat_interleave(G))
    opts = LogprobOptions(temperature=temperature, bf16_autocast=bf16, device_type=device_type)
    with torch.no_grad():
        scored = completion_logps_for(model, prompts, row_prompt, comp.ids, comp.mask, opts)
    metrics = mismatch_metrics(log_ratios(comp.sampling_logps.to(scored.device), scored, comp.mask.to(scored.device)))
    return {"tokens": int(comp.mask.sum()), **metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--bf16", action="store_true", help="also in bf16: autocast and bf16 weights (slow on CPU)")
    args = parser.parse_args()
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_qwen25vl(pathlib.Path(tmp) / "tiny")
        processor = load_processor(path)
        prompts = _prompts(processor, args.prompts, seed=0)
        rows = args.prompts * args.generations
        settings = [("loop", 0)] + [("continuous", b) for b in (1, 2, 4, 8, rows)]
        results = []
        # (label, weights dtype, bf16 autocast): fp32; training.bf16's autocast over fp32 weights; bf16 weights.
        dtypes = [("fp32", "float32", False)]
        if args.bf16:
            dtypes += [("bf16 autocast", "float32", True), ("bf16 weights", "bfloat16", False)]
        for label_dtype, weights, bf16 in dtypes:
            model = load_model(_model_config(str(path), weights)).eval()
            for engine, batch in settings:
                r = measure(
                    model,
                    processor,
                    prompts,
                    engine=engine,
                    decode_batch_size=batch,
                    bf16=bf16,
                    G=args.generations,
                    max_new=args.max_new_tokens,
                    temperature=args.temperature,
                )
                label = "loop (all rows in one decode batch)" if engine == "loop" else f"continuous, decode_batch_size={batch}"
                results.append({"dtype": label_dtype, "engine": label, **r})
                print(results[-1])
    day = datetime.date.today().isoformat()
    out = pathlib.Path(__file__).parent / "results" / f"mismatch_cpu_{day}"
    command = "python benchmarks/mismatch.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items() if v is not False
    )
    cpu = platform.processor() or platform.machine()
    meta = {"command": command, "torch": torch.__version__, "cpu": cpu, "model": "tiny Qwen2.5-VL (vlmrl.tiny_models.tiny)"}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    lines = [
        f"# Rollout-training mismatch on CPU ({day})",
        "",
        f"`{command}` (torch {torch.__version__}; {meta['model']}; {args.prompts} prompts x {args.generations} samples, up to "
        f"{args.max_new_tokens} tokens). The sampler's log-prob of each sampled token (decode step) against the scoring pass's",
        "(`completion_logps_for`, grouped, 128-token LM-head chunks: what train.py scores). kl: k3 estimate of KL(sampler || trainer)",
        "per token; ratios: trainer / sampler probability.",
        "",
        "| dtype | engine | tokens | kl | max ratio | min ratio | max abs log-prob diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['dtype']} | {r['engine']} | {r['tokens']} | {r['mismatch/kl']:.2e} | {r['mismatch/max_ratio']:.6f} | "
            f"{r['mismatch/min_ratio']:.6f} | {r['mismatch/max_abs_logp_diff']:.2e} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
