"""Cost of syncing DDP gradients after the OOM agreement (vlmrl's default with memory.oom_recovery on several
processes) instead of in the last micro-batch's backward (DDP's bucketed all-reduce, overlapped with that backward).

    python benchmarks/ddp_deferred_sync.py            # 2 gloo processes on the CPU, writes benchmarks/results/ddp_deferred_sync_cpu_<date>.*
    python benchmarks/ddp_deferred_sync.py --quick    # small model, checks the harness

Workload: an MLP of `--layers` x Linear(`--width`, `--width`) (fp32), one optimizer step = `--micro` micro-batches of
`--batch` rows, on 2 processes. Per optimizer step, timed on each process (max over processes), alternating the modes:
- native: micro-batches 1..k-1 under no_sync, the last one synced by DDP inside its backward (find_unused_parameters,
  as vlmrl builds DDP);
- deferred: every micro-batch under no_sync, then one all-reduce of the agreement flag (oom.Peers.who) and
  collectives.average_gradients (the used-parameter mask, then buckets of 25 MiB).
Also the gradients of both modes are compared (they are bit-identical: both scale by 1/W and sum).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _worker(rank: int, world: int, port: int, args: dict, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vlmrl.engine.collectives import Collectives, average_gradients

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [m for _ in range(args["layers"]) for m in (torch.nn.Linear(args["width"], args["width"]), torch.nn.Tanh())]
    ddp = DDP(torch.nn.Sequential(*layers), find_unused_parameters=True, broadcast_buffers=False)
    params = [p for p in ddp.parameters() if p.requires_grad]
    coll = Collectives.__new__(Collectives)
    coll.world_size, coll.rank = world, rank
    torch.manual_seed(1 + rank)
    xs = [torch.randn(args["batch"], args["width"]) for _ in range(args["micro"])]

    def step(mode: str) -> float:
        for p in params:
            p.grad = None
        dist.barrier()
        start = time.perf_counter()
        for k, x in enumerate(xs):
            synced = mode == "native" and k == len(xs) - 1
            with contextlib.nullcontext() if synced else ddp.no_sync():
                (ddp(x).pow(2).mean() * world).backward()
        if mode == "deferred":
            coll.ranks_where(False)  # the agreement
            average_gradients(params, world)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"native": [], "deferred": []}
    grads = {}
    for i in range(args["warmup"] + args["reps"]):
        for mode in ("native", "deferred") if i % 2 == 0 else ("deferred", "native"):
            t = step(mode)
            if i >= args["warmup"]:
                times[mode].append(t)
            grads[mode] = torch.cat([p.grad.reshape(-1) for p in params]).clone()
    t0 = time.perf_counter()
    for _ in range(args["reps"]):
        average_gradients(params, world)
    sync_only = (time.perf_counter() - t0) / args["reps"]
    queue.put((rank, times, sync_only, bool(torch.equal(grads["native"], grads["deferred"]))))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ns = ap.parse_args()
    if ns.quick:
        ns.layers, ns.width, ns.reps = 2, 256, 3
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    args = vars(ns)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, store.port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((item[0], item[1:]) for item in (queue.get(timeout=900) for _ in procs))
    for p in procs:
        p.join()
    per_step = {m: [max(results[r][0][m][i] for r in results) for i in range(ns.reps)] for m in ("native", "deferred")}
    native, deferred = statistics.median(per_step["native"]), statistics.median(per_step["deferred"])
    n_params = ns.layers * (ns.width * ns.width + ns.width)
    out = {
        "date": datetime.date.today().isoformat(),
        "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "args": args,
        "parameters": n_params,
        "gradient_MiB": n_params * 4 / 2**20,
        "median_step_s": {"native": native, "deferred": deferred},
        "deferred_over_native": deferred / native,
        "average_gradients_alone_s": max(results[r][1] for r in results),
        "bit_identical_gradients": all(results[r][2] for r in results),
        "steps_s": per_step,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "steps_s"}, indent=1))
    if not ns.quick:
        stem = ROOT / "benchmarks" / "results" / f"ddp_deferred_sync_cpu_{out['date']}"
        stem.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
