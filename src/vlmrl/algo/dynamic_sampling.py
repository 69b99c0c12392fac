"""DAPO's dynamic sampling (arXiv 2503.14476, section 3.2) as pure functions: which groups carry a learning signal,
and which sampled groups fill the step's batch.

A group whose G rewards are all equal has zero advantage under every group baseline, so it adds no policy gradient;
DAPO drops such groups and samples further prompts until the batch is full again. The loop (train.dynamic_sample)
draws the rounds; these functions decide, from the rewards of every process, the same answer on every process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_keep_mask(values: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[B*G] per-completion values (rewards, or one reward's values; NaN where a reward does not apply) -> [B] bool:
    True where the group's values are not all equal. A group holding a NaN is kept: nothing says it has no signal."""
    grouped = values.double().reshape(-1, num_generations)
    spread = grouped.max(dim=1).values != grouped.min(dim=1).values
    return spread | torch.isnan(grouped).any(dim=1)


@dataclass(frozen=True)
class Picks:
    """The step's batch after dynamic sampling: for each global prompt position k of the batch, the (round, position)
    whose group fills it."""

    sources: list[tuple[int, int]]  # [B] (round, position in that round's batch)
    filled: int  # positions filled with groups that were filtered (the rounds ran out before the batch was full)

    @property
    def identity(self) -> bool:
        """The first round's batch unchanged (every group of it kept)."""
        return all(src == (0, k) for k, src in enumerate(self.sources))


def _survivors(keeps: list[torch.Tensor], positions: list[int], keep: bool) -> list[tuple[int, int]]:
    """(round, position) of `positions`' groups whose keep flag is `keep`, round by round, in `positions`' order."""
    return [(r, p) for r, mask in enumerate(keeps) for p in positions if bool(mask[p]) == keep]


def shares_full(keeps: list[torch.Tensor], shards: list[list[int]]) -> bool:
    """Whether every process has kept at least as many groups as its share of the batch.

    keeps: per round [B] bool (group_keep_mask of the whole step's rewards); shards: each process's prompt positions
    in the batch (one process: [[0 .. B-1]]). A process fills its share from the groups it sampled itself, so no
    completion moves between processes."""
    return all(len(_survivors(keeps, positions, True)) >= len(positions) for positions in shards)


def pick_groups(keeps: list[torch.Tensor], shards: list[list[int]]) -> Picks:
    """The batch from the rounds sampled so far: each process's share takes its kept groups in (round, position) order;
    a share still short (the rounds ran out) is topped up with its filtered groups in the same order, which carry no
    gradient under a group baseline but keep every shape of the step as configured.

    keeps: per round [B] bool; shards: each process's positions (they partition 0 .. B-1). One process: the first B
    kept groups of the rounds, in order."""
    batch = len(keeps[0])
    sources: list[tuple[int, int] | None] = [None] * batch
    filled = 0
    for positions in shards:
        kept = _survivors(keeps, positions, True)[: len(positions)]
        short = len(positions) - len(kept)
        chosen = kept + _survivors(keeps, positions, False)[:short]
        filled += short
        for k, src in zip(positions, chosen):
            sources[k] = src
    if any(s is None for s in sources):
        raise ValueError(f"shards {shards} do not cover the batch of {batch} positions")
    return Picks(sources=sources, filled=filled)


def source_rows(picks: Picks, batch: int, num_generations: int) -> list[int]:
    """[B*G] for each completion row of the picked batch, its row in the rounds' rows concatenated (round r's row i
    is r*B*G + i)."""
    G = num_generations
    return [r * batch * G + p * G + g for r, p in picks.sources for g in range(G)]
