"""The processes of a run and the collective operations the loop needs (world size, rank, gather, broadcast,
all-reduce), with the pure helpers behind them (unit-tested in one process). With one process every operation
returns its input unchanged. The engine (how the model is wrapped, stepped and saved) is engines.py;
distributed.py puts the two together.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from vlmrl.config import ConfigError
from vlmrl.algo.losses import step_normaliser
from vlmrl.checkpoints.files import restore_rng, rng_file, rng_state
from vlmrl.engine.device import seed_everything
import dataclasses
import torch.distributed as dist
from pathlib import Path

# Memory keys whose per-process values are also logged (`mem/<key>/rank<r>`); the plain key is the max.
PER_RANK_MEMORY = ("mem/host_peak_rss", "mem/gpu_peak_allocated", "mem/gpu_peak_reserved")


class DistributedError(ConfigError):
    """A multi-process setting cannot work (batch not divisible, unsupported engine feature); the message says why."""


# ---------------------------------------------------------------- pure helpers (unit-tested in one process)
def shard_prompts(prompts_per_step: int, num_generations: int, rows_per_opt_step: int, world_size: int, rank: int) -> list[int]:
    """Positions (in the step's global prompt order) of the prompts `rank` rolls out.

    The rollout of one step is cut into optimizer steps of `rows_per_opt_step` completions (whole
    prompts); each optimizer step's prompts are split into W equal contiguous blocks, block r to rank r.
    So every optimizer step holds the same global rows as with one process, and every rank gets whole
    prompts (its G completions stay together). One process: all positions, in order.
    """
    if world_size == 1:
        return list(range(prompts_per_step))
    G, W = num_generations, world_size
    if prompts_per_step % W:
        raise DistributedError(
            f"{prompts_per_step} prompts per step (rollout.generation_batch_size / rollout.num_generations) cannot be split "
            f"over {W} processes: make it a multiple of {W} (batch sizes in the config are global, for all processes together)"
        )
    if rows_per_opt_step % (G * W):
        raise DistributedError(
            f"each optimizer step holds per_device_train_batch_size x gradient_accumulation_steps = {rows_per_opt_step} completions "
            f"(global); with {W} processes it must be a multiple of num_generations x processes = {G * W} so that each "
            f"process gets whole prompts of every optimizer step: raise training.gradient_accumulation_steps or "
            f"per_device_train_batch_size (the batch sizes in the config are global)"
        )
    per_opt = rows_per_opt_step // G  # prompts per optimizer step
    share = per_opt // W
    steps = prompts_per_step // per_opt
    return [s * per_opt + rank * share + j for s in range(steps) for j in range(share)]


def rows_of(prompt_positions: list[int], num_generations: int) -> list[int]:
    """Global completion rows of the given prompt positions (prompt p owns rows p*G .. p*G+G-1)."""
    return [p * num_generations + g for p in prompt_positions for g in range(num_generations)]


def merge_rows(per_rank: list[list], rows_per_rank: list[list[int]]) -> list:
    """Put every rank's local rows back into global order (inverse of the sharding)."""
    total = sum(len(r) for r in rows_per_rank)
    out: list = [None] * total
    for values, rows in zip(per_rank, rows_per_rank):
        if len(values) != len(rows):
            raise ValueError(f"{len(values)} values for {len(rows)} rows")
        for v, i in zip(values, rows):
            out[i] = v
    return out


def prompt_seed(seed: int, step: int, position: int) -> int:
    """Seed of one prompt's sampling stream (rollout.sampling_seed=prompt): depends on the run seed, the step
    and the prompt's position in the step's global batch, never on the process that samples it."""
    return ((seed * 1_000_003 + step) * 100_003 + position) % (2**63 - 1)


def reduce_metric_dicts(per_rank: list[dict], sum_keys: tuple[str, ...] = (), max_keys: tuple[str, ...] = ()) -> dict:
    """Combine the metrics of every rank: `sum_keys` summed; `mem/*` and `time/*` the max over ranks (the
    slowest / fullest process is what matters), plus `mem/<key>/rank<r>` for the peaks in PER_RANK_MEMORY;
    a value equal on every rank kept as it is; other numbers averaged; non-numbers taken from rank 0."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    out: dict = {}
    for key, first in per_rank[0].items():
        values = [m.get(key) for m in per_rank]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if not numeric:
            out[key] = first
        elif key in sum_keys:
            out[key] = sum(values)
        elif key in max_keys or key.startswith(("mem/", "time/")):
            out[key] = max(values)
        elif all(v == first for v in values):
            out[key] = first
        else:
            out[key] = sum(values) / len(values)
        if key in PER_RANK_MEMORY:
            for r, v in enumerate(values):
                out[f"{key}/rank{r}"] = v
    return out


def average_gradients(params: list[torch.Tensor], world_size: int, bucket_bytes: int = 25 * 2**20) -> None:
    """Each process's locally accumulated `.grad`s replaced by their mean over the processes, as DDP's reducer makes
    them (every gradient times 1/W, then summed across processes; buckets of ~25 MiB, DDP's default, so there are few
    collectives). A parameter without a gradient on some process counts as zeros there; one without a gradient on
    every process keeps none (DDP leaves globally unused parameters alone, and AdamW then skips them)."""

    if not params:
        return
    has = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(has)
    used = [p for p, n in zip(params, has.tolist()) if n > 0]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in _buckets([p.grad for p in used], bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        flat.mul_(1.0 / world_size)
        dist.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, up to `bucket_bytes` each (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or size + nbytes > bucket_bytes or (out[-1][0].dtype, out[-1][0].device) != (t.dtype, t.device):
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


@dataclass
class Shard:
    """This rank's part of one step: prompt positions, completion rows, and every rank's rows."""

    prompts: list[int]
    rows: list[int]
    rows_per_rank: list[list[int]]
    rows_per_opt_step: int  # local completions per optimizer step


class Collectives:
    """World size, rank and the collective operations of this run's processes (one process: all trivial).

    Sequence parallelism (`sp` > 1, engine/ulysses.py): the sp processes of an SP group hold the SAME rows and split
    each row's sequence. Only sp = world size runs yet, so there is one data-parallel rank (`data_world` 1): the
    row-level operations below (shard, gather_rows, gather_rollout, all_values, local, all_sum, step_normaliser) are
    those of one process, while the process-level ones (any, ranks_where, barrier, broadcast, RNG) span every process."""

    sp: int = 1  # processes per sequence-parallel group (set by Distributed.use_sequence_parallel)

    def __init__(self, accelerator=None):
        self.accelerator = accelerator
        if accelerator is None:
            self.world_size, self.rank, self.local_rank = 1, 0, 0
            return
        state = accelerator.state
        self.world_size, self.rank, self.local_rank = state.num_processes, state.process_index, state.local_process_index

    # -- identity ----------------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: processes holding different rows (world size / sp)."""
        return self.world_size // self.sp

    def device(self, configured: torch.device) -> torch.device:
        """The configured device, made per-process: cuda -> cuda:<local rank>."""
        if self.world_size > 1 and configured.type == "cuda":
            return self.accelerator.device
        return configured

    # -- sharding ----------------------------------------------------------------------------------------
    def shard(self, prompts_per_step: int, num_generations: int, rows_per_opt_step: int) -> Shard:
        W, rank = self.data_world, self.rank // self.sp
        per_rank = [rows_of(shard_prompts(prompts_per_step, num_generations, rows_per_opt_step, W, r), num_generations) for r in range(W)]
        prompts = shard_prompts(prompts_per_step, num_generations, rows_per_opt_step, W, rank)
        return Shard(prompts=prompts, rows=per_rank[rank], rows_per_rank=per_rank, rows_per_opt_step=rows_per_opt_step // W)

    def gather_rows(self, shard: Shard, *columns: list) -> tuple[list, ...]:
        """Every rank's per-row lists in global row order; one process (or one SP group): the same objects."""
        if self.data_world == 1:
            return columns

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, [list(c) for c in columns])
        return tuple(merge_rows([g[i] for g in gathered], shard.rows_per_rank) for i in range(len(columns)))

    def gather_rollout(self, shard: Shard, total: list, per_reward: dict, comp) -> tuple[list, dict, torch.Tensor, torch.Tensor]:
        """(rewards, per-reward values, completion lengths, truncated flags) of the whole step in global row order;
        one process: the local objects unchanged. Under sequence parallelism, first a check that every SP rank sampled
        the same rows (DistributedError on every process otherwise)."""
        if self.sp > 1:
            self.check_same_rows(total, comp.ids)
        if self.data_world == 1:
            return total, per_reward, comp.lengths, comp.truncated
        names = list(per_reward)
        cols = self.gather_rows(shard, total, comp.lengths.tolist(), comp.truncated.tolist(), *(per_reward[n] for n in names))
        return cols[0], dict(zip(names, cols[3:])), torch.tensor(cols[1]), torch.tensor(cols[2], dtype=torch.bool)

    def all_values(self, values: torch.Tensor) -> torch.Tensor:
        """Every process's 1-D `values` concatenated (rank order, on this process's device); one process: `values`."""
        if self.data_world == 1:
            return values

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, values.detach().cpu())
        return torch.cat(gathered).to(values.device)

    def local(self, shard: Shard, global_tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor in global row order; one process: the tensor itself."""
        if self.data_world == 1:
            return global_tensor
        return global_tensor[torch.tensor(shard.rows, device=global_tensor.device)]

    # -- reductions --------------------------------------------------------------------------------------
    def all_sum(self, values: list[float]) -> list[float]:
        """`values` summed over the data-parallel ranks (the rows' counts); one process or one SP group: unchanged."""
        if self.data_world == 1:
            return list(values)
        return self._sum_over_processes(values)

    def _sum_over_processes(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(t)
        return t.tolist()

    def step_normaliser(self, masks: list[torch.Tensor], max_completion_length: int, chunk_rows: int | None = None):
        """One optimizer step's loss normaliser over the rows of every process (losses.step_normaliser for one); the
        nominal micro-batches' token counts (bnpo) stay this process's own, their number is the global one."""

        local = step_normaliser(masks, max_completion_length, chunk_rows)
        if self.data_world == 1:
            return local
        seqs, toks, chunks = self.all_sum([local.num_sequences, sum(int(m.sum()) for m in masks), local.num_chunks])
        return dataclasses.replace(local, num_sequences=int(seqs), num_tokens=max(1, int(toks)), num_chunks=int(chunks))

    def reduce_metrics(self, metrics: dict, sum_keys: tuple[str, ...] = (), max_keys: tuple[str, ...] = ()) -> dict:
        if self.world_size == 1:
            return metrics

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, metrics)
        # One SP group: every process holds the whole loss (the same rows), so nothing is summed.
        return reduce_metric_dicts(gathered, sum_keys if self.data_world > 1 else (), max_keys)

    def broadcast(self, obj: Any) -> Any:
        """The main process's value of `obj` on every process."""
        if self.world_size == 1:
            return obj

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every process when `flag` is true on at least one."""
        return bool(flag) if self.world_size == 1 else self._sum_over_processes([float(bool(flag))])[0] > 0

    def ranks_where(self, flag: bool) -> list[int]:
        """The ranks whose `flag` is true, the same list on every process (one all-reduce); one process: [0] or []."""
        if self.world_size == 1:
            return [0] if flag else []
        mine = [0.0] * self.world_size
        mine[self.rank] = float(bool(flag))
        return [r for r, v in enumerate(self._sum_over_processes(mine)) if v > 0]

    def check_same_rows(self, rewards: list, ids: torch.Tensor) -> None:
        """DistributedError on every process when the processes' rollouts differ (their completion ids or rewards):
        under sequence parallelism every SP rank must hold the same rows, sampled identically from the per-prompt
        seeds; a sampler that is not deterministic across processes would otherwise train on a mix silently."""
        import hashlib

        import torch.distributed as dist

        digest = hashlib.sha256(ids.detach().cpu().numpy().tobytes() + repr([float(r) for r in rewards]).encode()).hexdigest()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, digest)
        if len(set(gathered)) > 1:
            raise DistributedError(
                "training.sequence_parallel_size: the sequence-parallel processes sampled different completions this step "
                "(they must hold the same rows); use rollout.sampling_seed=prompt and a deterministic sampler"
            )

    @contextlib.contextmanager
    def main_first(self):
        """The main process runs the block first (e.g. writes files), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def barrier(self) -> None:
        if self.world_size > 1:
            self.accelerator.wait_for_everyone()

    def _collective_device(self) -> torch.device:

        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- RNG ---------------------------------------------------------------------------------------------
    def gather_rng_states(self) -> dict[int, dict] | None:
        """{rank: RNG state} of every process on the main process (None elsewhere); one process: {0: its state}."""

        mine = rng_state()
        if self.world_size == 1:
            return {0: mine}

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        return dict(enumerate(gathered)) if self.is_main else None

    def restore_rng(self, path, saved_world_size: int, seed: int, warn) -> None:
        """This rank's RNG streams from `rng_state_<rank>.pt`; a rank the checkpoint has no file for (more processes
        than when it was saved) is seeded from (seed, rank) instead, with a warning."""

        if (Path(path) / rng_file(self.rank)).exists():
            restore_rng(path, rank=self.rank, warn=warn)
            return
        seed_everything(seed * 1_000_003 + self.rank)
        warn(
            f"{path} was saved by {saved_world_size} process(es) and has no RNG state for rank {self.rank}; "
            f"rank {self.rank} starts a fresh stream (rollouts with rollout.sampling_seed=prompt do not use it)"
        )
