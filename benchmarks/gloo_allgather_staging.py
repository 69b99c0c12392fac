"""How much a gloo all-gather into one flat tensor stages on the CPU (the planner's zero_allgather_staging).

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/gloo_allgather_staging.py

Each of 2 ranks holds a 25,000,000-element float32 partition of a flat tensor (95.4 MiB) and all-gathers it into the
flat tensor, as DeepSpeed ZeRO-1/2 do after their optimizer step (all_gather_into_tensor), then again as a list of
shards; printed: each rank's peak RSS above its resident set before the call (VmHWM reset through clear_refs).
"""

from pathlib import Path

import torch
import torch.distributed as dist


def _kib(field: str) -> int:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))


def _peak_above(fn) -> float:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _kib("VmRSS")
    fn()
    return (_kib("VmHWM") - base) / 1024


def main(n: int = 25_000_000) -> None:
    dist.init_process_group("gloo")
    r, world = dist.get_rank(), dist.get_world_size()
    flat = torch.zeros(world * n)
    shards = [flat.narrow(0, i * n, n) for i in range(world)]
    shards[r].fill_(r + 1)
    into = _peak_above(lambda: dist.all_gather_into_tensor(flat, shards[r]))
    listed = _peak_above(lambda: dist.all_gather(shards, shards[r]))
    print(f"rank {r}: partition {n * 4 / 2**20:.1f} MiB; peak above start: all_gather_into_tensor {into:.1f} MiB, all_gather list {listed:.1f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
