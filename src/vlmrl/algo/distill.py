"""On-policy distillation from a teacher model (pure tensor functions, no model code).

The student samples; the frozen teacher scores the student's sampled tokens; each token's reverse-KL estimate
log pi_student(y_t) - log pi_teacher(y_t) (Agarwal et al. 2024, GKD; Thinking Machines' on-policy distillation, 2025)
becomes a per-token penalty on the advantage, detached, so the policy-gradient loss (losses.POLICY_LOSSES, which take
[N, T] advantages) minimises the reverse KL KL(student || teacher) on the student's own samples.
"""

from __future__ import annotations

import torch


def reverse_kl_per_token(student_logps: torch.Tensor, teacher_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T] the sampled-token estimate of KL(student || teacher): log pi_s(y_t) - log pi_t(y_t) where mask is 1, else 0.
    student_logps, teacher_logps, mask: [N, T] (the tokens were sampled by the student)."""
    return (student_logps - teacher_logps) * mask.to(student_logps.dtype)


def distill_advantages(
    advantages: torch.Tensor,
    student_logps: torch.Tensor,
    teacher_logps: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    with_rewards: bool = True,
) -> torch.Tensor:
    """Per-token advantages of on-policy distillation: A_t = A - coef * (log pi_s(y_t) - log pi_t(y_t)) (slime's
    --opd-kl-coef, added after the estimator's normalisation), or without the reward's advantage
    (with_rewards=False) -coef * (log pi_s - log pi_t) alone (Thinking Machines' recipe, discount 0).

    advantages: [N] (one per sequence) or [N, T]; student_logps: [N, T] log-probs of the sampled tokens under the
    policy that sampled them (no gradient); teacher_logps, mask: [N, T]. Returns [N, T] detached; tokens outside the
    mask keep the reward's advantage (or 0) and carry no distillation term."""
    penalty = coef * reverse_kl_per_token(student_logps, teacher_logps, mask)
    base = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    base = base.to(penalty.dtype) if with_rewards else torch.zeros_like(base, dtype=penalty.dtype)
    return (base - penalty).detach()


def distill_metrics(student_logps: torch.Tensor, teacher_logps: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """distill/reverse_kl: the mean over masked tokens of log pi_s - log pi_t (0 when the student matches the teacher
    on its own samples); distill/teacher_logp: the teacher's mean log-prob of the student's tokens."""
    m = mask.to(student_logps.dtype)
    n = m.sum().clamp(min=1)
    return {
        "distill/reverse_kl": float(reverse_kl_per_token(student_logps, teacher_logps, mask).sum() / n),
        "distill/teacher_logp": float((teacher_logps * m).sum() / n),
    }
