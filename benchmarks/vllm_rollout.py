"""Rollout throughput on CPU: vLLM (rollout.backend=vllm, in-process as vlmrl colocates it) vs vlmrl's in-process
engines vs HF generate. Runs in the vLLM venv (`make install-vllm`), where all of them are importable:

    .venv-vllm/bin/python benchmarks/vllm_rollout.py            # writes benchmarks/results/vllm_rollout_cpu_<date>.json
    .venv-vllm/bin/python benchmarks/vllm_rollout.py --quick    # vocab 20,000, 16 tokens: checks the harness

Workload: benchmarks/rollout.py's model and prompts (tiny Qwen2.5-VL, 2 layers, hidden 128, a Qwen-size vocabulary
of 151,936, one 56x56 image per prompt, fp32, temperature 1) at its prompts x G configurations, except the lengths:
rollout.py biases the EOS logit through an LM-head bias, which vLLM's Qwen2 model cannot load, so here every method
generates exactly --max-new-tokens tokens per row (min = max new tokens; the same work for all). decode tokens/s =
completion tokens / wall time of one rollout call (prefill and, for vLLM, its input processing included); median of
--repeats (methods alternate within a repeat). vLLM is built once (not timed) and binds its own OpenMP threads; the
others run with --threads torch threads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from rollout import PROBLEMS, build_model, prompts_for, summarise  # noqa: E402 - benchmarks/rollout.py: the same model and prompts

CONFIGS = [dict(prompts=4, G=8), dict(prompts=8, G=4), dict(prompts=2, G=16)]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_inprocess(method: str, model, tokenizer, prompts, G: int, max_new: int, seed: int) -> dict:
    import torch

    from vlmrl.models.rollout import generate

    kw = dict(num_generations=G, max_new_tokens=max_new, min_new_tokens=max_new, temperature=1.0, do_sample=True)
    torch.manual_seed(seed)
    if method == "hf":
        kw["shared_prefix"] = False
    else:
        kw["prompt_seeds"] = torch.randint(0, 2**62, (prompts["input_ids"].shape[0],)).tolist()
        if method == "engine":
            kw.update(engine="continuous")
    start = time.perf_counter()
    comp = generate(model, tokenizer, prompts, **kw)
    wall = time.perf_counter() - start
    lengths = comp.lengths.tolist()
    return dict(wall_s=wall, tokens=int(sum(lengths)), lengths=lengths)


def run_vllm(llm, requests: list[dict], G: int, max_new: int, eos: list[int], seed: int) -> dict:
    from vllm import SamplingParams

    params = [
        SamplingParams(n=G, max_tokens=max_new, min_tokens=max_new, temperature=1.0, seed=seed + i, logprobs=0, stop_token_ids=eos)
        for i in range(len(requests))
    ]
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    wall = time.perf_counter() - start
    lengths = [len(c.token_ids) for o in outs for c in o.outputs]
    return dict(wall_s=wall, tokens=int(sum(lengths)), lengths=lengths)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="vllm,engine,loop,hf")
    ap.add_argument("--configs", help="prompts x G list, e.g. 4x8,8x4 (default: 4x8,8x4,2x16)")
    ap.add_argument("--gpu-share", type=float, default=0.3, help="vLLM's gpu_memory_utilization (on CPU: of the NUMA node's memory)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--work", default="/tmp/vlmrl-bench-rollout")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch
    import transformers

    from vlmrl.models.loading import load_model
    from vlmrl.models.processing import build_prompt, load_processor
    from vlmrl.models.rollout import eos_token_ids
    from vlmrl.rollout.vllm_backend import _register_in_process, trainer_state_kept

    vocab = 20_000 if args.quick else 151_936
    max_new = 16 if args.quick else args.max_new_tokens
    folder = build_model(Path(args.work) / f"tiny-qwen25vl-v{vocab}", vocab)
    cfg = argparse.Namespace(
        name_or_path=str(folder), dtype="float32", attn_implementation="sdpa", freeze_vision_tower=False, train_projector_only=False,
        use_lora=False, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=[], lora_vision=False, trust_remote_code=False,
        allow_hub_download=False, gradient_checkpointing=False,
    )  # fmt: skip
    model = load_model(cfg).eval()
    processor = load_processor(folder)
    eos = eos_token_ids(model, processor.tokenizer)
    methods = args.methods.split(",")
    llm = None
    if "vllm" in methods:
        import vllm
        from vllm import LLM

        with trainer_state_kept():
            _register_in_process(str(folder))
            start = time.perf_counter()
            llm = LLM(model=str(folder), dtype="float32", seed=0, enforce_eager=True, gpu_memory_utilization=args.gpu_share, max_model_len=256)
            build_s = time.perf_counter() - start
    torch.set_num_threads(args.threads)
    specs = [dict(prompts=4, G=8)] if args.quick else CONFIGS
    if args.configs:
        specs = [dict(prompts=int(p), G=int(g)) for p, g in (c.split("x") for c in args.configs.split(","))]
    date = datetime.date.today().isoformat()
    meta = dict(
        date=date,
        command="python " + " ".join(sys.argv),
        cpu_model=cpu_model(),
        cpu_count=os.cpu_count(),
        load_average_start=os.getloadavg()[0],
        torch_threads=args.threads,
        torch=torch.__version__,
        transformers=transformers.__version__,
        vllm=vllm.__version__ if llm is not None else None,
        vllm_build_s=build_s if llm is not None else None,
        vocab=vocab,
        max_new_tokens=max_new,
        repeats=args.repeats,
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
    )
    results = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"vllm_rollout_cpu{'_quick' if args.quick else ''}_{date}.json"
    for spec in specs:
        prompts = prompts_for(processor, spec["prompts"], "cpu")
        texts = [build_prompt(processor, PROBLEMS[i % len(PROBLEMS)], 1) for i in range(spec["prompts"])]
        images = _images(spec["prompts"])
        requests = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in zip(texts, images)]

        def once(m: str, seed: int, new: int, G=spec["G"], requests=requests, prompts=prompts) -> dict:
            if m == "vllm":
                with trainer_state_kept():
                    return run_vllm(llm, requests, G, new, eos, seed)
            return run_inprocess(m, model, processor.tokenizer, prompts, G, new, seed)

        for m in methods:  # warm-up, not measured
            once(m, 0, 8)
        runs = {m: [] for m in methods}
        for rep in range(args.repeats):
            for m in methods:
                runs[m].append(once(m, 1000 + rep, max_new))
                print(spec, m, rep, f"{runs[m][-1]['wall_s']:.2f}s {runs[m][-1]['tokens']} tokens", flush=True)
        results.append(dict(**spec, rows=spec["prompts"] * spec["G"], methods={m: summarise(r) for m, r in runs.items()}))
        meta["load_average_end"] = os.getloadavg()[0]
        path.write_text(json.dumps(dict(meta=meta, results=results), indent=2) + "\n")  # after every configuration
    for row in results:
        for m, s in row["methods"].items():
            print(f"{row['prompts']}x{row['G']} {m:7s} {s['median_tokens_per_s']:8.0f} tokens/s  {s['median_wall_s']:.2f} s/step")
    print(f"wrote {path}")
    return 0


def _images(n: int) -> list[list]:
    """benchmarks/rollout.prompts_for's images (same generator, same order)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [[Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))] for _ in range(n)]


if __name__ == "__main__":
    raise SystemExit(main())
