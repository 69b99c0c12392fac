"""Advantages and losses: hand-computed values and a naive per-sample reference loop."""

import math

import pytest
import torch

from vlmrl.algo.advantages import ADV_EPS, group_advantages
from vlmrl.config import AlgorithmConfig
from vlmrl.algo.losses import Normaliser, aggregate, k3_kl, per_token_loss, step_normaliser


def algo(**kw):
    """The algorithm config the losses read their hyperparameters from (defaults: epsilon 0.2, beta 0, ppo_clip)."""
    return AlgorithmConfig(**kw)


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    adv = group_advantages(r, 2, "none")
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]
    scaled = group_advantages(r, 2, "group")
    std = math.sqrt(0.5)  # unbiased std of {1, 0}
    assert torch.allclose(scaled, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]) / torch.tensor([std + ADV_EPS] * 4 + [ADV_EPS] * 2))
    batch = group_advantages(r, 2, "batch")
    assert torch.allclose(batch, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]) / (r.std() + ADV_EPS))


def test_group_advantages_naive_loop():
    torch.manual_seed(0)
    r = torch.rand(12)
    adv = group_advantages(r, 4, "group")
    for g in range(3):
        grp = r[g * 4 : g * 4 + 4].tolist()
        mean = sum(grp) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / 3)
        for i, x in enumerate(grp):
            assert adv[g * 4 + i].item() == pytest.approx((x - mean) / (std + ADV_EPS), rel=1e-5)


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), 2, "groupp")


def test_k3_hand_computed():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    # exp(ref - logp) - (ref - logp) - 1 = 0.5 - ln(0.5) - 1
    assert k3_kl(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)
    assert k3_kl(ref, ref).item() == 0.0


def test_clipped_surrogate_hand_computed():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))  # ratios
    loss_pos, parts = per_token_loss(logp, old, torch.tensor([1.0]), algo(epsilon_high=0.28))
    # A > 0: min(r, clip(r, 0.8, 1.28)) -> [1.28, 0.5, 1.1, 0.7]
    assert torch.allclose(loss_pos, -torch.tensor([[1.28, 0.5, 1.1, 0.7]]))
    assert parts["is_clipped"].tolist() == [[True, False, False, False]]
    loss_neg, parts = per_token_loss(logp, old, torch.tensor([-2.0]), algo(epsilon_high=0.28))
    # A < 0: min(-2r, -2 clip(r)) = -2 max(r, clip(r)) -> [1.5, 0.8, 1.1, 0.8]
    assert torch.allclose(loss_neg, 2 * torch.tensor([[1.5, 0.8, 1.1, 0.8]]))
    assert parts["is_clipped"].tolist() == [[False, True, False, True]]


def test_kl_term_added_with_beta():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    loss, parts = per_token_loss(logp, logp.detach(), torch.tensor([0.0]), algo(beta=0.1), ref)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    with pytest.raises(ValueError):
        per_token_loss(logp, logp, torch.tensor([0.0]), algo(beta=0.1), None)


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2),
        ("dapo", (1 + 2 + 4 + 5 + 6) / 5),
        ("dr_grpo", (1 + 2 + 4 + 5 + 6) / (2 * 4)),
    ],
)
def test_aggregation_hand_computed(loss_type, expected):
    norm = step_normaliser([MASK], max_completion_length=4)
    assert aggregate(LOSS, MASK, loss_type, norm).item() == pytest.approx(expected)


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="unknown loss_type"):
        aggregate(LOSS, MASK, "ppo", Normaliser(2, 5, 4))


def naive_loss(logps, old, ref, adv, mask, loss_type, eps_lo, eps_hi, beta, max_len):
    """Per-sample, per-token Python loop: the reference the vectorised path must match."""
    per_seq, tok_sum, n_tok = [], 0.0, 0
    for i in range(logps.shape[0]):
        seq_terms = []
        for t in range(logps.shape[1]):
            if not mask[i, t]:
                continue
            ratio = torch.exp(logps[i, t] - old[i, t])
            clipped = torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi)
            term = -torch.min(ratio * adv[i], clipped * adv[i])
            if beta:
                d = ref[i, t] - logps[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            seq_terms.append(term)
        tok_sum = tok_sum + sum(seq_terms)
        n_tok += len(seq_terms)
        per_seq.append(sum(seq_terms) / max(1, len(seq_terms)))
    if loss_type == "grpo":
        return sum(per_seq) / len(per_seq)
    if loss_type == "dapo":
        return tok_sum / n_tok
    return tok_sum / (logps.shape[0] * max_len)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_vectorised_matches_naive_loop_and_microbatching(loss_type, beta):
    torch.manual_seed(1)
    n, t, max_len = 6, 5, 7
    logps = (-torch.rand(n, t) * 3).requires_grad_(True)
    old = logps.detach() + 0.3 * torch.randn(n, t)
    ref = logps.detach() + 0.3 * torch.randn(n, t)
    adv = torch.randn(n)
    mask = (torch.rand(n, t) > 0.3).long()
    mask[:, 0] = 1

    expected = naive_loss(logps, old, ref, adv, mask, loss_type, 0.2, 0.28, beta, max_len)
    (g_naive,) = torch.autograd.grad(expected, logps)

    # Same optimizer step cut into micro-batches of 4 and 2 rows: identical loss and gradient.
    micro = [list(range(0, 4)), list(range(4, 6))]
    norm = step_normaliser([mask[m] for m in micro], max_len)
    total = 0.0
    for m in micro:
        tok, _ = per_token_loss(logps[m], old[m], adv[m], algo(epsilon_high=0.28, beta=beta), ref[m])
        total = total + aggregate(tok, mask[m], loss_type, norm)
    (g_fast,) = torch.autograd.grad(total, logps)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(g_fast, g_naive, atol=1e-7)


def test_pure_modules_import_without_engines():
    """config, advantages, losses and rewards stay importable without accelerate / deepspeed / vllm / transformers."""
    import subprocess
    import sys

    code = (
        "import sys; import vlmrl.config, vlmrl.algo.advantages, vlmrl.algo.losses, vlmrl.rewards.functions; "
        "bad = [m for m in ('accelerate', 'deepspeed', 'vllm', 'transformers', 'peft') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
