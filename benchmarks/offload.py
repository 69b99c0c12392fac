"""Cost of memory.offload_optimizer_during_rollout: one park (device -> host) and one restore (host -> device) of
AdamW's states per GRPO step.

    python benchmarks/offload.py            # writes benchmarks/results/offload_<device>_<date>.{json,md}
    python benchmarks/offload.py --quick    # small sizes, checks the harness

Workload: `--params` trainable float32 parameters in tensors of `--tensor-mb` MB (a model's weight matrices), AdamW
stepped once so that both moments exist (8 bytes per parameter of state). Timed per round trip (median of
`--repeats`): park, restore, and the bytes the training device holds before / while parked. Also the process's RSS
(host) before the first park and after it, which on a CUDA device is the pinned host buffers and on a CPU device (here)
the second host copy the mechanism keeps. On the CPU nothing is freed for anything else: the figure that matters there
is the time, which a GPU run replaces with PCIe time (~2 x bytes / 25 GB/s on a PCIe 4 x16 link: not run here).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def measure(params: int, tensor_mb: float, repeats: int, device: str) -> dict:
    import torch

    from vlmrl.engine.offload import OptimizerParking, device_state_bytes

    per_tensor = max(1, int(tensor_mb * 2**20 / 4))
    sizes = [per_tensor] * (params // per_tensor) + ([params % per_tensor] if params % per_tensor else [])
    weights = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
    opt = torch.optim.AdamW(weights, lr=1e-3)
    for w in weights:
        w.grad = torch.ones_like(w)
    opt.step()
    parking = OptimizerParking(opt, enabled=True)
    state = device_state_bytes(opt)
    rss_before = rss_bytes()
    parks, restores = [], []
    held_while_parked = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        parking.park()
        if device == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        held_while_parked = device_state_bytes(opt)
        parking.restore()
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        parks.append(t1 - t0)
        restores.append(t2 - t1)
    return {
        "params": params,
        "tensors": len(sizes),
        "state_bytes": state,
        "state_bytes_on_device_while_parked": held_while_parked,
        "park_s_median": statistics.median(parks),
        "restore_s_median": statistics.median(restores),
        "round_trip_GBps": 2 * state / (statistics.median(parks) + statistics.median(restores)) / 1e9,
        "host_rss_added_by_host_buffers": rss_bytes() - rss_before,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, nargs="+", default=[10_000_000, 40_000_000])
    p.add_argument("--tensor-mb", type=float, default=16.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [1_000_000] if args.quick else args.params
    rows = [measure(n, args.tensor_mb, 2 if args.quick else args.repeats, device) for n in sizes]
    for r in rows:
        print(json.dumps(r))
    if args.quick:
        return 0
    date = datetime.date.today().isoformat()
    name = torch.cuda.get_device_name().replace(" ", "_") if device == "cuda" else "cpu"
    meta = {"date": date, "device": name, "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"offload_{name}_{date}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Optimizer-state parking round trip, {name}, {date}",
        "",
        f"`python benchmarks/offload.py` ({meta['machine']}, torch {meta['torch']}); median of {args.repeats} round trips.",
        "",
        "| AdamW params | state (MB) | on device while parked | park (s) | restore (s) | GB/s (both ways) | host RSS added (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['params']:,} | {r['state_bytes'] / 1e6:.0f} | {r['state_bytes_on_device_while_parked']} B | {r['park_s_median']:.3f} | "
            f"{r['restore_s_median']:.3f} | {r['round_trip_GBps']:.1f} | {r['host_rss_added_by_host_buffers'] / 1e6:.0f} |"
        )
    lines += ["", "GPU (pinned buffers over PCIe): not run (no GPU lent to this task)."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
