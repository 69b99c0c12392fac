"""Turn-level advantages for multi-turn rollouts (algorithm.turn_advantage=per_turn): pure tensor functions.

Turn t of a rollout has a reward r_t: the reward its environment's `step` returned for a turn that did not end the
rollout, and, on the last turn, the trainer's reward of the whole rollout (algorithm.reward_funcs) added. Each turn's
return is discounted over the turns after it, G_t = r_t + gamma * G_{t+1}, and the returns are normalised over every
turn of every rollout of the GRPO group, pooled (ROLL's `step_reinforce` with `reward_normalization.grouping:
traj_group_id, method: mean_std`): A_t = (G_t - mean) / (std + eps). Each token the model sampled in turn t gets A_t.
"""

from __future__ import annotations

import math

import torch

from vlmrl.algo.advantages import ADV_EPS

# algorithm.advantage_estimator -> the scale its per-turn form uses (turn_advantages); reinforce_pp has none.
TURN_SCALES = {"grpo": "group", "grpo_batch_std": "batch", "dr_grpo": "none"}


def turn_reward_matrix(step_rewards: list[list[float]], final_rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-turn rewards as a padded matrix.

    step_rewards: N lists, row i's reward of each of its turns from the environment (K_i >= 1 entries; a row with
    none is given one turn). final_rewards: [N] the trainer's reward of each rollout, added to its last turn.
    Returns (rewards [N, K] float32, mask [N, K] bool), K = max K_i; mask is True on a row's turns (a prefix)."""
    n = len(step_rewards)
    if final_rewards.shape != (n,):
        raise ValueError(f"final_rewards must be [{n}], got {tuple(final_rewards.shape)}")
    k = max([1] + [len(r) for r in step_rewards])
    rewards = torch.zeros(n, k, dtype=torch.float32)
    mask = torch.zeros(n, k, dtype=torch.bool)
    for i, row in enumerate(step_rewards):
        turns = max(1, len(row))
        rewards[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        mask[i, :turns] = True
        rewards[i, turns - 1] += final_rewards[i].float()
    return rewards, mask


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} within each row's turns. rewards, mask: [N, K] (mask a prefix of each row).
    Returns [N, K], 0 off the mask."""
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, torch.zeros_like(running))
        out[:, t] = running
    return out


def turn_advantages(rewards: torch.Tensor, mask: torch.Tensor, num_generations: int, gamma: float, scale: str = "group") -> torch.Tensor:
    """Advantages per turn, the returns normalised over all turns of each group pooled.

    rewards, mask: [B*G, K] (turn_reward_matrix); rows b*G .. b*G+G-1 are prompt b's group.
    scale: "group" -> (G_t - group mean) / (group std + eps); "batch" -> (G_t - group mean) / (std of every turn of
    the batch + eps); "none" -> G_t - group mean. Means and stds are over the group's (batch's) valid turns, std the
    unbiased estimate (0 with a single turn). Returns [B*G, K], 0 off the mask."""
    N, K = rewards.shape
    if N % num_generations or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards must be [B*{num_generations}, K] with a mask of the same shape, got {tuple(rewards.shape)} and {tuple(mask.shape)}"
        )
    returns = discounted_returns(rewards.double(), mask, gamma)
    m = mask.double().view(-1, num_generations * K)
    g = returns.view(-1, num_generations * K)
    count = m.sum(dim=1, keepdim=True)
    mean = (g * m).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = (g - mean) * m
    if scale == "group":
        std = ((centred**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + ADV_EPS)
    elif scale == "batch":
        valid = returns[mask]
        std = valid.std() if valid.numel() > 1 else torch.zeros((), dtype=valid.dtype)
        centred = centred / (std + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}; use group, batch or none")
    return centred.view(N, K).float()


def turn_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """[N, T] which turn each sampled token belongs to (-1 off the mask): a multi-turn rollout's loss mask holds one
    run of ones per assistant turn (every tool turn between two of them is at least one token off the mask)."""
    on = loss_mask.bool()
    before = torch.zeros_like(on)
    before[:, 1:] = on[:, :-1]
    starts = on & ~before
    return torch.where(on, starts.long().cumsum(dim=1) - 1, torch.full_like(on, -1, dtype=torch.long))


def token_advantages(turn_adv: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[N, T] each token's advantage: turn_adv [N, K] at its turn (index [N, T], turn_index's; -1 -> 0). mask: [N, K]
    the rows' turns; an index past a row's last turn (not expected: one run per turn) takes its last turn's."""
    last = (mask.long().sum(dim=1, keepdim=True) - 1).clamp(min=0).to(turn_adv.device)
    idx = torch.minimum(index.clamp(min=0).to(turn_adv.device), last)
    out = turn_adv.gather(1, idx)
    return out.masked_fill(index.to(turn_adv.device) < 0, 0.0)


def numeric_reward(value) -> tuple[float, bool]:
    """(the float an environment's step reward counts as, whether it was a finite number): anything else (text, None,
    NaN, an object) counts as 0.0, so a hostile environment result cannot end a run."""
    if isinstance(value, (str, bytes)):
        return 0.0, False
    try:
        out = float(value)
    except Exception:  # noqa: BLE001 - whatever the environment returned, it is not a reward
        return 0.0, False
    return (out, True) if math.isfinite(out) else (0.0, False)
