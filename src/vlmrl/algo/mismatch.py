"""Rollout-training mismatch: how far the sampler's per-token log-probs are from the trainer's, and the
importance-sampling correction for it (pure tensor functions).

vlmrl samples in-process with the weights it trains, so the two should agree; they do not exactly, because the
decode loop and the scoring forward run different kernels (a batch of one new token per row against a KV cache vs
the whole completion at once, a different batch composition under continuous batching, bf16 rounding). The
rollout records, for every sampled token, log_softmax(logits / temperature) of the decode step that chose it
(`Completions.sampling_logps`); the scoring pass computes the same quantity for the same token.

Shapes: N rows, T completion tokens; mask [N, T] marks the tokens that count.
"""

from __future__ import annotations

import math

import torch


def log_ratios(sampling_logps: torch.Tensor, train_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi_train / pi_sampler) of every token under the mask, flattened: [K] float64. All [N, T]."""
    return (train_logps.double() - sampling_logps.double())[mask.bool()]


def mismatch_metrics(log_ratio: torch.Tensor) -> dict[str, float]:
    """From log_ratios (one or several micro-batches' concatenated): mismatch/kl, the k3 estimate of
    KL(sampler || trainer) per token (>= 0, 0 when equal); mismatch/max_ratio, mismatch/min_ratio, the extremes of
    trainer / sampler probability; mismatch/max_abs_logp_diff."""
    if log_ratio.numel() == 0:
        return {"mismatch/kl": 0.0, "mismatch/max_ratio": 1.0, "mismatch/min_ratio": 1.0, "mismatch/max_abs_logp_diff": 0.0}
    d = log_ratio.double()
    return {
        "mismatch/kl": float((torch.exp(d) - d - 1.0).mean()),  # k3 on the sampler's tokens
        "mismatch/max_ratio": float(torch.exp(d.max())),
        "mismatch/min_ratio": float(torch.exp(d.min())),
        "mismatch/max_abs_logp_diff": float(d.abs().max()),
    }


def _log_ratio(train_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, sequence: bool) -> torch.Tensor:
    diff = (train_logps - sampling_logps) * mask.to(train_logps.dtype)
    return diff.sum(dim=1, keepdim=True).expand_as(diff) if sequence else diff


def truncated_weights(train_logps, sampling_logps, mask, clip_min, clip_max, sequence: bool) -> torch.Tensor:
    """Truncated importance sampling (TIS): w = clamp(pi_train / pi_sampler, clip_min, clip_max), per token or per
    sequence (the product of its tokens' ratios, broadcast over them). Returns [N, T], detached."""
    w = torch.exp(_log_ratio(train_logps, sampling_logps, mask, sequence))
    return torch.clamp(w, min=clip_min, max=clip_max).detach()


def masked_weights(train_logps, sampling_logps, mask, clip_min, clip_max, sequence: bool) -> torch.Tensor:
    """Masked importance sampling (MIS): w = pi_train / pi_sampler where it lies in [clip_min, clip_max], else 0 (the
    token, or the whole sequence, leaves the loss). Returns [N, T], detached."""
    w = torch.exp(_log_ratio(train_logps, sampling_logps, mask, sequence))
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return w.masked_fill((w < lo) | (w > hi), 0.0).detach()


# algorithm.rollout_correction -> fn(train_logps, sampling_logps, mask, clip_min, clip_max) -> weights [N, T] that
# multiply the policy loss per token (TRL's vllm_importance_sampling_mode names).
ROLLOUT_CORRECTIONS = {
    "token_truncate": lambda t, s, m, lo, hi: truncated_weights(t, s, m, lo, hi, sequence=False),
    "token_mask": lambda t, s, m, lo, hi: masked_weights(t, s, m, lo, hi, sequence=False),
    "sequence_truncate": lambda t, s, m, lo, hi: truncated_weights(t, s, m, lo, hi, sequence=True),
    "sequence_mask": lambda t, s, m, lo, hi: masked_weights(t, s, m, lo, hi, sequence=True),
}
