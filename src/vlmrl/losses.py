"""GRPO-family losses as pure tensor functions.

Shapes: N = sequences in a micro-batch (completions), T = completion length (padded).
The loss of one optimizer step is a sum over its micro-batches of `aggregate(...)`, where the
normaliser is computed once for the whole optimizer step. That makes the gradient independent of
how the step is cut into micro-batches (needed for exact OOM recovery and for accumulation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate (+ beta * k3 KL) per token.

    logps, old_logps, ref_logps: [N, T] per-token log-probs of the sampled tokens under the current,
    the rollout (old) and the reference policy. advantages: [N]. Returns (loss [N, T], parts) where
    parts holds `ratio`, `is_clipped` and `kl` ([N, T] each, detached) for logging.
    """
    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    adv = advantages.unsqueeze(1)
    surrogate = torch.min(ratio * adv, clipped * adv)
    loss = -surrogate
    parts = {"ratio": ratio.detach(), "is_clipped": (ratio * adv > clipped * adv).detach()}
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


def _grpo(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    per_seq = (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.sum() / norm.num_sequences


def _dapo(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    return (loss * mask).sum() / norm.num_tokens


def _dr_grpo(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    return (loss * mask).sum() / (norm.num_sequences * norm.max_completion_length)


# loss_type -> token aggregation. grpo: mean over each sequence's tokens, then over sequences.
# dapo: mean over all tokens of the step. dr_grpo: sum over tokens / (sequences x max length).
AGGREGATIONS = {"grpo": _grpo, "dapo": _dapo, "dr_grpo": _dr_grpo}


def aggregate(loss: torch.Tensor, mask: torch.Tensor, loss_type: str, norm: Normaliser) -> torch.Tensor:
    """loss, mask: [N, T] (mask 1 on completion tokens that count). Returns this micro-batch's share of
    the optimizer step's scalar loss."""
    try:
        fn = AGGREGATIONS[loss_type]
    except KeyError:
        raise ValueError(f"unknown loss_type {loss_type!r}; use one of {', '.join(AGGREGATIONS)}") from None
    return fn(loss, mask.to(loss.dtype), norm)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask==1 entries (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)
