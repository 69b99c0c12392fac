"""Naive (prompt repeated G times) vs grouped (one vision encode per prompt) log-prob forward/backward.

    python benchmarks/grouped_scoring.py --preset qwen2.5-vl-3b --device cuda --out benchmarks/results
    python benchmarks/grouped_scoring.py --tiny --device cpu            # smoke test on the tiny model

Times the forward (no grad, as in old/reference scoring) and forward+backward (as in an update) of one
micro-batch of U prompts x G completions, median of --repeats after a warm-up, and the CUDA peak memory
of each; checks that both paths give the same log-probs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vlmrl.models.logprobs import completion_logps, completion_logps_grouped, vision_encode_counter  # noqa: E402
from vlmrl.models.loading import load_model  # noqa: E402
from vlmrl.models.processing import build_prompt, encode_prompts, load_processor, select_rows  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--side", type=int, default=448)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    if a.tiny:
        from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

        path, dtype = build_tiny_qwen25vl(Path("/tmp/vlmrl-bench-tiny")), "float32"
    else:
        from vlmrl.plan.presets import build_preset_model

        path = Path(f"/tmp/vlmrl-preset-{a.preset}")
        if not (path / "config.json").exists():
            build_preset_model(a.preset, path, device=a.device)
        dtype = "bfloat16"
    cfg = SimpleNamespace(
        name_or_path=str(path),
        dtype=dtype,
        attn_implementation="sdpa",
        freeze_vision_tower=False,
        train_projector_only=False,
        use_lora=False,
        lora_vision=False,
        trust_remote_code=False,
        allow_hub_download=False,
        gradient_checkpointing=True,
    )
    model = load_model(cfg).to(dev)
    proc = load_processor(path, min_pixels=a.side * a.side, max_pixels=a.side * a.side)
    rng = np.random.default_rng(0)
    U, G, T = a.prompts, a.generations, a.completion
    texts = [build_prompt(proc, f"How many red shapes are there in picture {i}?", 1) for i in range(U)]
    images = [[Image.fromarray(rng.integers(0, 255, (a.side, a.side, 3), dtype=np.uint8))] for _ in range(U)]
    batch = {k: v.to(dev) for k, v in encode_prompts(proc, texts, images).items()}
    row_prompt = torch.arange(U, device=dev).repeat_interleave(G)
    ids = torch.randint(10, 500, (U * G, T), device=dev)
    from vlmrl.models.rollout import vision_token_ids

    ids[torch.isin(ids, torch.tensor(vision_token_ids(model), device=dev))] = 20  # completions never hold image slots
    mask = torch.ones_like(ids)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    paths = {
        "naive": lambda: completion_logps(model, select_rows(batch, row_prompt), ids, mask),
        "grouped": lambda: completion_logps_grouped(model, batch, row_prompt, ids, mask),
    }
    results, values = {}, {}
    for name, fn in paths.items():
        for mode in ("forward", "forward+backward"):
            times, peak = [], 0.0
            for rep in range(a.repeats + 1):
                model.zero_grad(set_to_none=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                sync()
                t0 = time.perf_counter()
                with vision_encode_counter(model) as counter, torch.autocast(dev.type, torch.bfloat16, enabled=dtype == "bfloat16"):
                    if mode == "forward":
                        with torch.no_grad():
                            out = fn()
                    else:
                        out = fn()
                        (out * mask).sum().backward()
                sync()
                if rep:
                    times.append(time.perf_counter() - t0)
                if dev.type == "cuda":
                    peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
            values[name] = out.detach().float()
            results[f"{name}/{mode}"] = {
                "median_s": statistics.median(times),
                "images_encoded": counter.images,
                **({"peak_allocated_gib": round(peak, 2)} if dev.type == "cuda" else {}),
            }
            print(name, mode, results[f"{name}/{mode}"], flush=True)
    diff = (values["naive"] - values["grouped"]).abs().max().item()
    for mode in ("forward", "forward+backward"):
        results[f"speedup/{mode}"] = results[f"naive/{mode}"]["median_s"] / results[f"grouped/{mode}"]["median_s"]
    record = {
        "model": "tiny-qwen2.5-vl" if a.tiny else a.preset,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "prompts": U,
        "generations": G,
        "completion_tokens": T,
        "image_side": a.side,
        "dtype": dtype,
        "gradient_checkpointing": True,
        "max_abs_logp_diff": diff,
        "results": results,
    }
    print(json.dumps(record, indent=1))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"grouped_scoring_{record['model']}.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
