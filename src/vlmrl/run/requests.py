"""What a step asks its sampler for (rollout/base.SampleRequest): the prompts of dataset rows and their seeds, the same
for the synchronous loop's backend (train.sample) and the rollout pipeline's producer (run/pipelined.py)."""

from __future__ import annotations

from vlmrl.engine.collectives import prompt_seed
from vlmrl.rollout.base import SampleRequest


def sample_request(run, step: int, row_indices: list[int], prompts: dict, prompts_per_call: int) -> SampleRequest:
    """What the backend (or the rollout pipeline's producer) samples for `step`: this process's prompts (dataset rows
    `row_indices`) with their seeds. `run`: the GRPO run (train.Run: cfg, dist, data, shard)."""
    cfg, dist = run.cfg, run.dist
    rows = [run.data.train[i] for i in row_indices]
    return SampleRequest(
        step=step,
        rows=rows,
        names=[f"step {step}, row {i} ({row.get('_source', 'built-in task')})" for i, row in zip(row_indices, rows)],
        prompts=prompts,
        seeds=[prompt_seed(cfg.training.seed, step, position) for position in run.shard.prompts],
        step_seed=(cfg.training.seed * 1_000_003 + step) * dist.data_world + dist.rank // dist.sp,  # an SP group's processes alike
        prompts_per_call=prompts_per_call,
    )
