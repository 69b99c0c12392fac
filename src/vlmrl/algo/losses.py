"""GRPO-family losses as pure tensor functions.

Shapes: N = sequences in a micro-batch (completions), T = completion length (padded).
The loss of one optimizer step is a sum over its micro-batches of `aggregate(...)`, where the
normaliser is computed once for the whole optimizer step. That makes the gradient independent of
how the step is cut into micro-batches (needed for exact OOM recovery and for accumulation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    """[N] (one advantage per sequence) or [N, T] (per token) -> broadcastable against [N, T]."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def ppo_clip_loss(logps, old_logps, advantages, mask, epsilon_low: float, epsilon_high: float):
    """PPO's clipped surrogate per token (GRPO, DAPO's clip-higher): -min(r A, clip(r, 1-eps_lo, 1+eps_hi) A),
    r = exp(logp - old). logps, old_logps, mask: [N, T]; advantages: [N] or [N, T]. Returns (loss [N, T], parts)."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    adv = _per_token(advantages)
    loss = -torch.min(ratio * adv, clipped * adv)
    return loss, {"ratio": ratio.detach(), "is_clipped": (ratio * adv > clipped * adv).detach()}


def gspo_loss(logps, old_logps, advantages, mask, epsilon_low: float, epsilon_high: float):
    """GSPO: one importance ratio per sequence, s = exp(mean over its completion tokens of (logp - old)), clipped
    per sequence. Written in the token form s_t = sg(s) * exp(logp_t - sg(logp_t)): every token carries the value
    s, and after a per-sequence mean (loss_aggregation=seq_mean_token_mean) the gradient is GSPO's
    -A * grad(s). GSPO's clip ranges are ~1e3 x smaller than GRPO's (the paper uses 3e-4 / 4e-4).
    Shapes as ppo_clip_loss; advantages [N] (per-token advantages are averaged per sequence by the mask)."""
    m = mask.to(logps.dtype)
    lengths = m.sum(dim=1).clamp(min=1)
    seq_log_ratio = ((logps - old_logps) * m).sum(dim=1) / lengths  # [N]
    token_log_ratio = seq_log_ratio.detach().unsqueeze(1) + logps - logps.detach()  # value: seq ratio; grad: token's
    ratio = torch.exp(token_log_ratio)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    adv = advantages if advantages.dim() == 1 else (advantages * m).sum(dim=1) / lengths
    adv = adv.unsqueeze(1)
    loss = -torch.min(ratio * adv, clipped * adv)
    return loss, {"ratio": ratio.detach(), "is_clipped": (ratio * adv > clipped * adv).detach()}


def cispo_loss(logps, old_logps, advantages, mask, epsilon_low: float, epsilon_high: float):
    """CISPO: REINFORCE with a clipped, stopped-gradient importance weight, -sg(min(r, 1+eps_hi)) * A * logp, so
    every token keeps a gradient (clipping bounds the weight instead of dropping the token). Only the upper bound
    clips, as in MiniMax-M1; epsilon_low is unused. Shapes as ppo_clip_loss."""
    ratio = torch.exp(logps - old_logps)
    weight = torch.clamp(ratio, max=1.0 + epsilon_high).detach()
    loss = -weight * _per_token(advantages) * logps
    return loss, {"ratio": ratio.detach(), "is_clipped": (ratio > 1.0 + epsilon_high).detach()}


# algorithm.policy_loss -> per-token loss, all with the signature
# (logps, old_logps, advantages, mask, epsilon_low, epsilon_high) -> (loss [N, T], {"ratio", "is_clipped"}).
POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    mask: torch.Tensor | None = None,
    policy_loss: str = "ppo_clip",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss (POLICY_LOSSES[policy_loss]) + beta * k3 KL to the reference, per token.

    logps, old_logps, ref_logps, mask: [N, T] per-token log-probs of the sampled tokens under the current, the
    rollout (old) and the reference policy, and the tokens that count (default all). advantages: [N] or [N, T].
    Returns (loss [N, T], parts) where parts holds `ratio`, `is_clipped` and `kl` ([N, T] each, detached).
    """
    mask = torch.ones_like(logps) if mask is None else mask
    loss, parts = POLICY_LOSSES[policy_loss](logps, old_logps, advantages, mask, epsilon_low, epsilon_high)
    if beta > 0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        kl = k3_kl(logps, ref_logps)
        loss = loss + beta * kl
        parts["kl"] = kl.detach()
    return loss, parts


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref) per token: exp(r - p) - (r - p) - 1, >= 0. [N, T]."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1.0


@dataclass(frozen=True)
class Normaliser:
    """What one optimizer step divides by; built from the whole step's masks before any micro-batch."""

    num_sequences: int
    num_tokens: int
    max_completion_length: int


def step_normaliser(masks: list[torch.Tensor], max_completion_length: int) -> Normaliser:
    """masks: the [n_i, T_i] completion masks of every micro-batch in one optimizer step."""
    return Normaliser(
        num_sequences=sum(int(m.shape[0]) for m in masks),
        num_tokens=max(1, sum(int(m.sum()) for m in masks)),
        max_completion_length=max_completion_length,
    )


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    per_seq = (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.sum() / norm.num_sequences


def token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    return (loss * mask).sum() / norm.num_tokens


def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    return (loss * mask).sum() / (norm.num_sequences * norm.max_completion_length)


# algorithm.loss_aggregation -> how an optimizer step's [N, T] token losses become one scalar.
# seq_mean_token_mean: mean over each sequence's tokens, then over sequences (GRPO). token_mean: mean over all
# tokens of the step (DAPO). seq_mean_token_sum_norm: sum over tokens / (sequences x max length) (Dr.GRPO).
AGGREGATIONS = {"seq_mean_token_mean": seq_mean_token_mean, "token_mean": token_mean, "seq_mean_token_sum_norm": seq_mean_token_sum_norm}
# TRL's algorithm.loss_type names for the same aggregations.
LOSS_TYPE_AGGREGATION = {"grpo": "seq_mean_token_mean", "dapo": "token_mean", "dr_grpo": "seq_mean_token_sum_norm"}


def aggregate(loss: torch.Tensor, mask: torch.Tensor, aggregation: str, norm: Normaliser) -> torch.Tensor:
    """loss, mask: [N, T] (mask 1 on completion tokens that count). Returns this micro-batch's share of
    the optimizer step's scalar loss. aggregation: an AGGREGATIONS key or a TRL loss_type."""
    name = LOSS_TYPE_AGGREGATION.get(aggregation, aggregation)
    if name not in AGGREGATIONS:
        raise ValueError(f"unknown loss_type {aggregation!r}; use one of {', '.join([*LOSS_TYPE_AGGREGATION, *AGGREGATIONS])}")
    return AGGREGATIONS[name](loss, mask.to(loss.dtype), norm)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask==1 entries (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def load_balancing_loss(router_logits: list[torch.Tensor], weights: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss of MoE routers, with a weight per routed token.

    router_logits: one [n_i, E] tensor per (forward call, MoE layer); weights: the matching [n_i] token weights
    (0 = padding; a prompt shared by k rows and run once carries weight k, so the value equals running every row).
    Returns E * sum_e f_e * p_e, f_e = weighted share of top-k assignments to expert e, p_e = weighted mean router
    probability of e, both over every token of every layer. With 0/1 weights it is transformers'
    load_balancing_loss_func with an attention mask (Qwen3-VL-MoE, Qwen3.5-MoE)."""
    device = router_logits[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for logits, w in zip(router_logits, weights, strict=True):
        w = w.to(device=device, dtype=torch.float32).reshape(-1)
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = probs.topk(top_k, dim=-1).indices  # [n, k]
        assigned = assigned.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * w.unsqueeze(-1)).sum(dim=0)
        total = total + w.sum()
    total = total.clamp(min=1e-12)
    return num_experts * ((assigned / total) * (prob_sum / total)).sum()
