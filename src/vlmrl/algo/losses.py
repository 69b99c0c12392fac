"""GRPO-family losses as pure tensor functions.

Shapes: N = sequences in a micro-batch (completions), T = completion length (padded).
The loss of one optimizer step is a sum over its micro-batches of `aggregate(...)`, where the
normaliser is computed once for the whole optimizer step. That makes the gradient independent of
how the step is cut into micro-batches (needed for exact OOM recovery and for accumulation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    """[N] (one advantage per sequence) or [N, T] (per token) -> broadcastable against [N, T]."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def epsilon_high(algo) -> float:
    """algorithm.epsilon_high, default algorithm.epsilon."""
    return algo.epsilon if algo.epsilon_high is None else algo.epsilon_high


# Every policy loss and KL estimator takes the algorithm config (config.AlgorithmConfig, or any object with its
# fields) as its last argument and reads its own hyperparameters from it, so a new loss with a new knob is one
# function, one config field and one dict entry.
def ppo_clip_loss(logps, old_logps, advantages, mask, algo):
    """PPO's clipped surrogate per token (GRPO, DAPO's clip-higher): -min(r A, clip(r, 1-eps_lo, 1+eps_hi) A),
    r = exp(logp - old). With algorithm.delta (INTELLECT-2's two-sided clipping) the unclipped term uses
    min(r, delta), which bounds the loss of a negative-advantage token whose ratio ran away.
    logps, old_logps, mask: [N, T]; advantages: [N] or [N, T]. Returns (loss [N, T], parts)."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1.0 - algo.epsilon, 1.0 + epsilon_high(algo))
    unclipped = ratio if algo.delta is None else torch.clamp(ratio, max=algo.delta)
    adv = _per_token(advantages)
    loss = -torch.min(unclipped * adv, clipped * adv)
    return loss, {"ratio": ratio.detach(), "is_clipped": (unclipped * adv > clipped * adv).detach()}


def sequence_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's importance ratio of each sequence: s = exp(mean over its masked tokens of (logp - old)), the geometric
    mean of its token ratios, with its gradient through every token (ds / dlogp_t = s / |y| on masked tokens).
    logps, old_logps, mask: [N, T]. Returns [N] (1 for a row without masked tokens)."""
    m = mask.to(logps.dtype)
    return torch.exp(((logps - old_logps) * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))


def gspo_loss(logps, old_logps, advantages, mask, algo):
    """GSPO: one importance ratio per sequence (sequence_ratio), clipped per sequence; with algorithm.delta the
    unclipped term uses min(s, delta), as TRL's two-sided clipping at importance_sampling_level=sequence. Every token
    of a row carries its sequence's value -min(s A, clip(s) A), broadcast from one [N, 1] term with its gradient
    through s, so any per-token weight w_t applied afterwards (rollout correction, entropy mask) gives the gradient of
    the weighted loss: the row's mean weight times -A grad(s), as in TRL (not token t's own weight times token t's
    share). GSPO's clip ranges are ~1e3 x smaller than GRPO's (the paper uses 3e-4 / 4e-4).
    Shapes as ppo_clip_loss; advantages [N] (per-token advantages are averaged per sequence by the mask)."""
    m = mask.to(logps.dtype)
    ratio = sequence_ratio(logps, old_logps, mask).unsqueeze(1).expand_as(logps)  # [N, T], one value per row
    clipped = torch.clamp(ratio, 1.0 - algo.epsilon, 1.0 + epsilon_high(algo))
    unclipped = ratio if algo.delta is None else torch.clamp(ratio, max=algo.delta)
    adv = advantages if advantages.dim() == 1 else (advantages * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
    adv = adv.unsqueeze(1)
    loss = -torch.min(unclipped * adv, clipped * adv)
    return loss, {"ratio": ratio.detach(), "is_clipped": (unclipped * adv > clipped * adv).detach()}


def cispo_loss(logps, old_logps, advantages, mask, algo):
    """CISPO: REINFORCE with a clipped, stopped-gradient importance weight, -sg(min(r, 1+eps_hi)) * A * logp, so
    every token keeps a gradient (clipping bounds the weight instead of dropping the token). Only the upper bound
    clips, as in MiniMax-M1; epsilon is unused. The cap is 1 + epsilon_high (MiniMax-M1's notation; TRL's
    epsilon_high for loss_type=cispo is the cap itself: TRL's 5.0 is vlmrl's 4.0). Always aggregated by token_mean
    (POLICY_LOSS_AGGREGATION), as in MiniMax-M1. Shapes as ppo_clip_loss."""
    ratio = torch.exp(logps - old_logps)
    cap = 1.0 + epsilon_high(algo)
    weight = torch.clamp(ratio, max=cap).detach()
    loss = -weight * _per_token(advantages) * logps
    return loss, {"ratio": ratio.detach(), "is_clipped": (ratio > cap).detach()}


def sapo_loss(logps, old_logps, advantages, mask, algo):
    """SAPO (soft adaptive policy optimisation): hard clipping replaced by a smooth gate,
    -(4 / tau) * sigmoid(tau * (r - 1)) * A, tau = sapo_temperature_pos where A > 0 else sapo_temperature_neg. At
    r = 1 the gradient is PPO's (-A grad r); it fades as r leaves 1, faster for the larger temperature. No token is
    counted as clipped. Shapes as ppo_clip_loss."""
    ratio = torch.exp(logps - old_logps)
    adv = _per_token(advantages)
    tau = torch.where(adv > 0, algo.sapo_temperature_pos, algo.sapo_temperature_neg).to(logps.dtype)
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    return loss, {"ratio": ratio.detach(), "is_clipped": torch.zeros_like(ratio, dtype=torch.bool)}


# algorithm.policy_loss -> per-token loss, all with the signature
# (logps, old_logps, advantages, mask, algo) -> (loss [N, T], {"ratio", "is_clipped"}).
POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss, "sapo": sapo_loss}
# Policy losses whose paper fixes the aggregation: the first is used whatever loss_type says, the others only when
# algorithm.loss_aggregation names them (config refuses any other explicit choice). CISPO: MiniMax-M1's token mean
# (token_mean_rollout: TRL's version of it).
POLICY_LOSS_AGGREGATION = {"cispo": ("token_mean", "token_mean_rollout")}


def k1_kl(logps, ref_logps, old_logps, mask=None):
    """k1 = logp - ref per token: unbiased for KL(policy || ref) but signed and high-variance (verl's "kl" / "k1")."""
    return logps - ref_logps


def k2_kl(logps, ref_logps, old_logps, mask=None):
    """k2 = (logp - ref)^2 / 2 per token, >= 0 (verl's "mse" / "k2"); its gradient is that of KL(policy || ref)
    on samples from the policy."""
    return 0.5 * (logps - ref_logps) ** 2


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor, old_logps: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref) per token: exp(r - p) - (r - p) - 1, >= 0. [N, T]."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1.0


def low_var_kl(logps, ref_logps, old_logps, mask=None):
    """k3 with its log-ratio clamped to [-20, 20] and the value to [-10, 10] (verl's "low_var_kl"): k3 that cannot
    overflow when the policy and the reference are far apart."""
    delta = torch.clamp(ref_logps - logps, -20.0, 20.0)
    return torch.clamp(torch.exp(delta) - delta - 1.0, -10.0, 10.0)


def k3_ratio_kl(logps, ref_logps, old_logps, mask=None):
    """k3 times the token's importance ratio r = exp(logp - old), r not detached (DeepSeek-V3.2; TRL's
    use_bias_correction_kl with a token-level policy loss, its default): the expected gradient is that of
    KL(policy || ref) even on-policy (r = 1 in value), and stays unbiased when the rows were sampled by an older
    policy. The same per-token estimator whatever the policy loss (with gspo too)."""
    return k3_kl(logps, ref_logps) * torch.exp(logps - old_logps)


def k3_seq_ratio_kl(logps, ref_logps, old_logps, mask=None):
    """k3 times GSPO's sequence ratio s = sequence_ratio(logps, old, mask), s not detached: TRL's
    use_bias_correction_kl under importance_sampling_level=sequence (TRL multiplies k3 by the ratio its policy loss
    uses). On-policy its value is k3 (s = 1) but its gradient adds k3_t * grad(s), which spreads each token's term
    over every token of its sequence / |y|. mask [N, T] (default all) picks the tokens s averages over. [N, T]."""
    mask = torch.ones_like(logps) if mask is None else mask
    return k3_kl(logps, ref_logps) * sequence_ratio(logps, old_logps, mask).unsqueeze(1)


# algorithm.kl_estimator -> fn(logps, ref_logps, old_logps, mask) -> [N, T] per-token KL term (times beta in the loss).
KL_ESTIMATORS = {"k1": k1_kl, "k2": k2_kl, "k3": k3_kl, "low_var_kl": low_var_kl, "k3_ratio": k3_ratio_kl, "k3_seq_ratio": k3_seq_ratio_kl}
# Other frameworks' names for the same estimators (verl's kl_loss_type names).
KL_ALIASES = {"kl": "k1", "mse": "k2"}


def kl_estimator_name(algo) -> str:
    """algorithm.kl_estimator (an alias resolved), else k3 when TRL's use_bias_correction_kl is not true, else TRL's
    meaning of it: k3 times the ratio its policy loss uses, k3_seq_ratio with gspo (TRL's importance_sampling_level=
    sequence), k3_ratio otherwise."""
    if algo.kl_estimator is not None:
        return KL_ALIASES.get(algo.kl_estimator, algo.kl_estimator)
    if not algo.use_bias_correction_kl:
        return "k3"
    return "k3_seq_ratio" if algo.policy_loss == "gspo" else "k3_ratio"


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    algo,
    ref_logps: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss (POLICY_LOSSES[algo.policy_loss]) + algo.beta * the KL estimator (KL_ESTIMATORS), per token.

    logps, old_logps, ref_logps, mask: [N, T] per-token log-probs of the sampled tokens under the current, the
    rollout (old) and the reference policy, and the tokens that count (default all). advantages: [N] or [N, T].
    algo: the algorithm config (config.AlgorithmConfig). is_weights: [N, T] detached rollout-correction weights
    (mismatch.ROLLOUT_CORRECTIONS) multiplying the policy loss, not the KL, as TRL does (gspo: the gradient is the weighted
    loss's, see gspo_loss). Returns (loss [N, T], parts)
    where parts holds `ratio`, `is_clipped` and, with beta > 0, `kl` ([N, T] each, detached).
    """
    mask = torch.ones_like(logps) if mask is None else mask
    loss, parts = POLICY_LOSSES[algo.policy_loss](logps, old_logps, advantages, mask, algo)
    if is_weights is not None:
        loss = loss * is_weights
    if algo.beta > 0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        kl = KL_ESTIMATORS[kl_estimator_name(algo)](logps, ref_logps, old_logps, mask)
        loss = loss + algo.beta * kl
        parts["kl"] = kl.detach()
    return loss, parts


@dataclass(frozen=True)
class Normaliser:
    """What one optimizer step divides by; built from the whole step's masks before any micro-batch."""

    num_sequences: int
    num_tokens: int
    max_completion_length: int
    # bnpo: tokens of the nominal micro-batch (per_device_train_batch_size rows of this process) each row belongs
    # to, one entry per row of the step (or of the slice `for_rows` cut), and how many nominal micro-batches the
    # step has over every process. Nominal, not actual: OOM halving and token packing do not change the loss.
    chunk_tokens: tuple[int, ...] = ()
    num_chunks: int = 1
    # token_mean_rollout: the rollout's tokens (every process) / its optimizer steps (TRL's dapo normaliser); 0 = unset
    rollout_tokens_per_step: float = 0.0

    def for_rows(self, positions: list[int]) -> "Normaliser":
        """This normaliser for the rows at `positions` of the step (the micro-batch aggregate is called on)."""
        if not self.chunk_tokens:
            return self
        return dataclasses.replace(self, chunk_tokens=tuple(self.chunk_tokens[p] for p in positions))


def step_normaliser(masks: list[torch.Tensor], max_completion_length: int, chunk_rows: int | None = None) -> Normaliser:
    """masks: the [n_i, T_i] completion masks of every micro-batch in one optimizer step (rows in step order).
    chunk_rows: rows of one nominal micro-batch (bnpo's local batch; default the whole step)."""
    per_row = [int(t) for m in masks for t in m.sum(dim=1)]
    chunk_rows = chunk_rows or max(1, len(per_row))
    chunks = [per_row[i : i + chunk_rows] for i in range(0, len(per_row), chunk_rows)]
    return Normaliser(
        num_sequences=len(per_row),
        num_tokens=max(1, sum(per_row)),
        max_completion_length=max_completion_length,
        chunk_tokens=tuple(max(1, sum(c)) for c in chunks for _ in c),
        num_chunks=max(1, len(chunks)),
    )


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    per_seq = (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.sum() / norm.num_sequences


def token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    return (loss * mask).sum() / norm.num_tokens


def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    return (loss * mask).sum() / (norm.num_sequences * norm.max_completion_length)


def token_mean_rollout(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    return (loss * mask).sum() / (norm.rollout_tokens_per_step or norm.num_tokens)


def local_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    chunk_tokens = torch.tensor(norm.chunk_tokens, dtype=loss.dtype, device=loss.device)
    return ((loss * mask).sum(dim=1) / chunk_tokens).sum() / norm.num_chunks


# algorithm.loss_aggregation -> how an optimizer step's [N, T] token losses become one scalar.
# seq_mean_token_mean: mean over each sequence's tokens, then over sequences (GRPO). token_mean: mean over all
# tokens of the step (DAPO). seq_mean_token_sum_norm: sum over tokens / (sequences x max length) (Dr.GRPO).
# local_token_mean: token mean within each nominal micro-batch of per_device_train_batch_size rows, then the mean
# over those micro-batches (TRL's bnpo: depends on the micro-batch size, not on OOM halving or token packing).
# token_mean_rollout: sum over the step's tokens / (the rollout's tokens / its optimizer steps): TRL's dapo, whose
# normaliser is the generation batch's token count spread evenly over the optimizer steps it feeds; token_mean
# when a rollout is one optimizer step.
AGGREGATIONS = {
    "seq_mean_token_mean": seq_mean_token_mean,
    "token_mean": token_mean,
    "token_mean_rollout": token_mean_rollout,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
    "local_token_mean": local_token_mean,
}
# TRL's algorithm.loss_type names for the same aggregations.
LOSS_TYPE_AGGREGATION = {"grpo": "seq_mean_token_mean", "dapo": "token_mean", "dr_grpo": "seq_mean_token_sum_norm", "bnpo": "local_token_mean"}


def aggregate(loss: torch.Tensor, mask: torch.Tensor, aggregation: str, norm: Normaliser) -> torch.Tensor:
    """loss, mask: [N, T] (mask 1 on completion tokens that count). Returns this micro-batch's share of
    the optimizer step's scalar loss. aggregation: an AGGREGATIONS key or a TRL loss_type."""
    name = LOSS_TYPE_AGGREGATION.get(aggregation, aggregation)
    if name not in AGGREGATIONS:
        raise ValueError(f"unknown loss_type {aggregation!r}; use one of {', '.join([*LOSS_TYPE_AGGREGATION, *AGGREGATIONS])}")
    return AGGREGATIONS[name](loss, mask.to(loss.dtype), norm)


def entropy_quantile_mask(entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float, pooled: torch.Tensor | None = None) -> torch.Tensor:
    """The high-entropy "forking" tokens (Wang et al. 2025, Beyond the 80/20 rule; TRL's top_entropy_quantile):
    entropies, mask: [N, T] (mask 1 on the tokens that count). Returns [N, T] bool, true on the tokens under the mask
    whose entropy is >= the (1 - top_quantile) quantile of the masked entropies (torch.quantile's linear
    interpolation, as TRL), so about top_quantile of them; ties at the threshold are all kept. top_quantile 1.0
    returns the mask; an empty mask returns all false. pooled: the 1-D entropies the quantile is taken over when
    they are more than these rows' (every process's tokens of the optimizer step); default entropies[mask]."""
    keep = mask.bool()
    if top_quantile >= 1.0:
        return keep
    values = (entropies[keep] if pooled is None else pooled).float()
    if values.numel() == 0:
        return torch.zeros_like(keep)
    threshold = torch.quantile(values, 1.0 - top_quantile)  # float32, compared in the entropies' dtype (as TRL)
    return keep & (entropies >= threshold)


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
