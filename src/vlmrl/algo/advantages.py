"""Group-relative advantages (pure tensor functions, no model code)."""

from __future__ import annotations

import torch

ADV_EPS = 1e-4  # added to the std, as in TRL, so a group with equal rewards gives zeros, not NaN


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group") -> torch.Tensor:
    """Advantages for a rollout laid out as consecutive groups.

    rewards: [B*G] float, completions of prompt b at rows b*G .. b*G+G-1.
    scale:   "group" -> (r - group mean) / (group std + eps)   (GRPO)
             "batch" -> (r - group mean) / (batch std + eps)
             "none"  -> r - group mean                          (Dr.GRPO)
    Std is the unbiased (n-1) estimate, like TRL. Returns [B*G].
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be 1-D with a multiple of {num_generations} entries, got shape {tuple(rewards.shape)}")
    grouped = rewards.view(-1, num_generations)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + ADV_EPS)
    elif scale == "batch":
        centred = centred / (rewards.std() + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"unknown scale_rewards {scale!r}; use group, batch or none")
    return centred.reshape(-1)


def reinforce_pp_advantages(rewards: torch.Tensor, num_generations: int, algo=None) -> torch.Tensor:
    """REINFORCE++: the baseline is the whole batch, not the group: (r - batch mean) / (batch std + eps).
    rewards: [B*G] (the global batch: every process's rows). Returns [B*G]."""
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be 1-D with a multiple of {num_generations} entries, got shape {tuple(rewards.shape)}")
    return (rewards - rewards.mean()) / (rewards.std() + ADV_EPS)


# algorithm.advantage_estimator -> fn(rewards [B*G], num_generations, algo) -> advantages [B*G] (or [B*G, T] per
# token); algo is the algorithm config (config.AlgorithmConfig), where an estimator reads its own hyperparameters.
# TRL's scale_rewards picks among the first three: group -> grpo, batch -> grpo_batch_std, none -> dr_grpo.
def grpo_advantages(rewards: torch.Tensor, num_generations: int, algo=None) -> torch.Tensor:
    """(r - group mean) / (group std + eps): GRPO."""
    return group_advantages(rewards, num_generations, "group")


def grpo_batch_std_advantages(rewards: torch.Tensor, num_generations: int, algo=None) -> torch.Tensor:
    """(r - group mean) / (batch std + eps)."""
    return group_advantages(rewards, num_generations, "batch")


def dr_grpo_advantages(rewards: torch.Tensor, num_generations: int, algo=None) -> torch.Tensor:
    """r - group mean, unscaled: Dr.GRPO."""
    return group_advantages(rewards, num_generations, "none")


ADVANTAGE_ESTIMATORS = {
    "grpo": grpo_advantages,
    "grpo_batch_std": grpo_batch_std_advantages,
    "dr_grpo": dr_grpo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
SCALE_REWARDS_ESTIMATOR = {"group": "grpo", "batch": "grpo_batch_std", "none": "dr_grpo"}


def group_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[B*G] -> [B] reward std per group; a zero means the group carries no learning signal."""
    return rewards.view(-1, num_generations).std(dim=1)
