"""SAPO, two-sided clipping (delta), bnpo (local_token_mean), CISPO's fixed token normalisation and the KL
estimators: hand-computed values, naive per-token loops, and the KL estimators' exact expected gradients."""

import math

import pytest
import torch

from vlmrl.config import AlgorithmConfig, ConfigError, load_config
from vlmrl.algo.losses import KL_ESTIMATORS, aggregate, kl_estimator_name, per_token_loss, step_normaliser

pytestmark = pytest.mark.unit


def algo(**kw):
    return AlgorithmConfig(**kw)


# ---------------------------------------------------------------- SAPO
def test_sapo_hand_computed():
    """r = e^0.5 with A = +2 (tau 1.0) and r = 1 with A = -1 (tau 1.05): -(4/tau) sigmoid(tau (r - 1)) A."""
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]])
    r = math.exp(0.5)
    sig = 1 / (1 + math.exp(-(r - 1)))
    loss, parts = per_token_loss(logps, old, torch.tensor([2.0]), algo(policy_loss="sapo"))
    assert loss[0, 0].item() == pytest.approx(-4 * sig * 2, rel=1e-6)
    loss.sum().backward()
    # d/dlogp of -(4/tau) sigmoid(tau (r-1)) A = -4 sigmoid' (tau (r-1)) r A
    assert logps.grad[0, 0].item() == pytest.approx(-4 * sig * (1 - sig) * r * 2, rel=1e-6)
    assert parts["is_clipped"].sum() == 0
    # A < 0 at r = 1: value -(4/1.05) * 0.5 * -1, gradient PPO's (-A r = 1) whatever tau is
    logps = torch.tensor([[-2.0]], requires_grad=True)
    loss, _ = per_token_loss(logps, torch.tensor([[-2.0]]), torch.tensor([-1.0]), algo(policy_loss="sapo"))
    loss.sum().backward()
    assert loss.item() == pytest.approx(4 / 1.05 * 0.5, rel=1e-6)
    assert logps.grad.item() == pytest.approx(1.0, rel=1e-6)


def test_sapo_matches_naive_token_loop():
    torch.manual_seed(3)
    n, t = 4, 5
    logps0, adv = -torch.rand(n, t) * 2, torch.randn(n)
    old = logps0 + 0.4 * torch.randn(n, t)
    mask = (torch.rand(n, t) > 0.2).float()
    a = algo(policy_loss="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=3.0)
    logps = logps0.clone().requires_grad_(True)
    fast = aggregate(per_token_loss(logps, old, adv, a, mask=mask)[0], mask, "seq_mean_token_mean", step_normaliser([mask], t))
    fast.backward()
    ref = logps0.clone().requires_grad_(True)
    total = 0.0
    for i in range(n):
        terms = []
        for j in range(t):
            if mask[i, j]:
                r = torch.exp(ref[i, j] - old[i, j])
                tau = 2.0 if adv[i] > 0 else 3.0
                terms.append(-torch.sigmoid(tau * (r - 1)) * 4 / tau * adv[i])
        total = total + (sum(terms) / max(1, len(terms)) if terms else 0.0)
    (total / n).backward()
    assert fast.item() == pytest.approx((total / n).item(), rel=1e-5)
    torch.testing.assert_close(logps.grad, ref.grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- two-sided clipping
def test_delta_caps_the_unclipped_ratio_hand_computed():
    """A < 0: PPO keeps max(r, clip(r)) -> r = 5 unbounded; with delta = 3 the term is min(r, 3) = 3 (no gradient)."""
    old = torch.zeros(1, 3)
    logps = torch.log(torch.tensor([[5.0, 2.0, 0.5]])).requires_grad_(True)
    plain, _ = per_token_loss(logps, old, torch.tensor([-1.0]), algo())
    capped, parts = per_token_loss(logps, old, torch.tensor([-1.0]), algo(delta=3.0))
    assert plain[0].tolist() == pytest.approx([5.0, 2.0, 0.8])
    assert capped[0].tolist() == pytest.approx([3.0, 2.0, 0.8])
    assert parts["is_clipped"].tolist() == [[False, False, True]]
    capped.sum().backward()
    assert logps.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0])
    # A > 0: the clip already bounds the term at 1 + eps_hi < delta: delta changes nothing
    a, _ = per_token_loss(logps, old, torch.tensor([1.0]), algo())
    b, _ = per_token_loss(logps, old, torch.tensor([1.0]), algo(delta=3.0))
    torch.testing.assert_close(a, b)


def test_delta_matches_naive_loop():
    torch.manual_seed(4)
    logps0, adv = -torch.rand(3, 6) * 2, torch.tensor([1.0, -1.0, -0.5])
    old = logps0 + torch.randn(3, 6)  # wide ratios: some beyond delta
    assert ((torch.exp(logps0 - old) > 1.5) & (adv[:, None] < 0)).any()
    logps = logps0.clone().requires_grad_(True)
    fast = per_token_loss(logps, old, adv, algo(epsilon_high=0.28, delta=1.5))[0].sum()
    fast.backward()
    ref = logps0.clone().requires_grad_(True)
    total = 0.0
    for i in range(3):
        for j in range(6):
            r = torch.exp(ref[i, j] - old[i, j])
            total = total - torch.min(torch.clamp(r, max=1.5) * adv[i], torch.clamp(r, 0.8, 1.28) * adv[i])
    total.backward()
    assert fast.item() == pytest.approx(total.item(), rel=1e-5)
    torch.testing.assert_close(logps.grad, ref.grad)


# ---------------------------------------------------------------- bnpo
def test_bnpo_hand_computed():
    """Two nominal micro-batches of 2 rows: tokens {2, 3} and {1, 4}: each micro-batch's token mean, then their mean."""
    loss = torch.tensor([[1.0, 2.0, 0.0, 0.0], [3.0, 4.0, 5.0, 0.0], [6.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    norm = step_normaliser([mask], 4, chunk_rows=2)
    want = ((1 + 2 + 3 + 4 + 5) / 5 + (6 + 4) / 5) / 2
    assert aggregate(loss, mask, "bnpo", norm).item() == pytest.approx(want)
    # cut into micro-batches of 1 row (an OOM halving twice) or of 3 and 1: the same total
    for cuts in ([[0], [1], [2], [3]], [[0, 1, 2], [3]]):
        total = sum(aggregate(loss[c], mask[c], "bnpo", norm.for_rows(c)).item() for c in cuts)
        assert total == pytest.approx(want)
    # one nominal micro-batch: bnpo is DAPO's token mean
    assert aggregate(loss, mask, "bnpo", step_normaliser([mask], 4)).item() == pytest.approx(aggregate(loss, mask, "dapo", norm).item())


def test_bnpo_matches_a_naive_accumulation_loop():
    """TRL's bnpo: per micro-batch (per_device_train_batch_size rows) sum(loss*mask)/sum(mask), divided by the
    gradient accumulation steps; vlmrl's gradient equals it for any actual micro-batching."""
    torch.manual_seed(5)
    n, t, per_device = 6, 5, 2
    logps0, adv = -torch.rand(n, t) * 2, torch.randn(n)
    old = logps0 + 0.2 * torch.randn(n, t)
    mask = (torch.rand(n, t) > 0.4).float()
    mask[:, 0] = 1
    ref = logps0.clone().requires_grad_(True)
    naive = 0.0
    for start in range(0, n, per_device):
        rows = slice(start, start + per_device)
        tok = -torch.min(
            torch.exp(ref[rows] - old[rows]) * adv[rows, None], torch.clamp(torch.exp(ref[rows] - old[rows]), 0.8, 1.2) * adv[rows, None]
        )
        naive = naive + (tok * mask[rows]).sum() / mask[rows].sum() / (n // per_device)
    naive.backward()
    norm = step_normaliser([mask], t, chunk_rows=per_device)
    for cuts in ([[0, 1, 2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]], [[i] for i in range(n)]):
        logps = logps0.clone().requires_grad_(True)
        total = sum(aggregate(per_token_loss(logps[c], old[c], adv[c], algo())[0], mask[c], "bnpo", norm.for_rows(c)) for c in cuts)
        total.backward()
        assert total.item() == pytest.approx(naive.item(), rel=1e-6)
        torch.testing.assert_close(logps.grad, ref.grad)


# ---------------------------------------------------------------- CISPO's normalisation
def test_cispo_is_token_normalised_whatever_loss_type():
    assert load_config(None, ["algorithm.policy_loss=cispo"]).loss_aggregation == "token_mean"
    assert load_config(None, ["algorithm.policy_loss=cispo", "algorithm.loss_type=dapo"]).loss_aggregation == "token_mean"
    for bad in (["algorithm.loss_type=dr_grpo"], ["algorithm.loss_aggregation=seq_mean_token_mean"]):
        with pytest.raises(ConfigError, match="always aggregated by token_mean or token_mean_rollout"):
            load_config(None, ["algorithm.policy_loss=cispo", *bad])
    assert load_config(None, ["algorithm.policy_loss=cispo", "algorithm.preset=trl"]).loss_aggregation == "token_mean_rollout"


# ---------------------------------------------------------------- KL estimators
def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    old = torch.tensor([[math.log(0.4)]])
    d = math.log(0.25) - math.log(0.5)  # ref - logp
    k3 = math.exp(d) - d - 1
    want = {"k1": -d, "k2": 0.5 * d * d, "k3": k3, "low_var_kl": k3, "k3_ratio": k3 * 0.5 / 0.4, "k3_seq_ratio": k3 * 0.5 / 0.4}
    for name, value in want.items():
        assert KL_ESTIMATORS[name](logp, ref, old).item() == pytest.approx(value, rel=1e-6), name
    # low_var_kl clamps: a log-ratio of 30 gives at most 10
    assert KL_ESTIMATORS["low_var_kl"](torch.tensor([[-30.0]]), torch.tensor([[0.0]]), None).item() == 10.0


def test_k3_seq_ratio_hand_computed_value_and_gradient():
    """Issue 35, finding 9. Two tokens, p = 0.5 each, ref 0.25 and 0.5, old 0.4 and 0.5 (the second token padding in
    a second call): s = exp(mean(log 1.25, 0)) = sqrt(1.25); value k3_t * s; d/dlogp_t = (1 - ref_t / p_t) s +
    (k3_0 + k3_1) s / 2 (the sum over both tokens' terms of ds / dlogp_t = s / 2). k3_ratio: k3_t * r_t instead."""
    logp = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.5]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.4, 0.5]], dtype=torch.float64))
    k3_0 = 0.5 + math.log(2) - 1  # exp(d) - d - 1, d = log(0.25 / 0.5); k3_1 = 0
    s = math.sqrt(1.25)
    kl = KL_ESTIMATORS["k3_seq_ratio"](logp, ref, old, torch.ones(1, 2))
    assert kl[0].tolist() == pytest.approx([k3_0 * s, 0.0], rel=1e-12)
    kl.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([(1 - 0.5) * s + k3_0 * s / 2, k3_0 * s / 2], rel=1e-12)
    # the token ratio instead: token 1's ratio is 1 and its k3 is 0, so it gets no gradient
    logp.grad = None
    KL_ESTIMATORS["k3_ratio"](logp, ref, old).sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([(1 - 0.5) * 1.25 + k3_0 * 1.25, 0.0], rel=1e-12)
    # a mask leaves padding out of s: with token 1 masked, s = 1.25 (token 0's ratio)
    assert KL_ESTIMATORS["k3_seq_ratio"](logp, ref, old, torch.tensor([[1.0, 0.0]]))[0, 0].item() == pytest.approx(k3_0 * 1.25)


def test_kl_estimator_names_and_trl_switch():
    assert kl_estimator_name(algo()) == "k3"
    assert kl_estimator_name(algo(use_bias_correction_kl=True)) == "k3_ratio"
    # TRL's use_bias_correction_kl multiplies by the ratio of its policy loss: the sequence ratio under GSPO
    assert kl_estimator_name(algo(use_bias_correction_kl=True, policy_loss="gspo")) == "k3_seq_ratio"
    assert kl_estimator_name(algo(kl_estimator="k3_ratio", policy_loss="gspo")) == "k3_ratio"  # vlmrl's name: token ratio
    assert load_config(None, ["algorithm.preset=trl", "algorithm.policy_loss=gspo", "algorithm.beta=0.04"]).kl_estimator == "k3_seq_ratio"
    assert load_config(None, ["algorithm.preset=trl", "algorithm.beta=0.04"]).kl_estimator == "k3_ratio"
    assert kl_estimator_name(algo(kl_estimator="mse")) == "k2"
    assert load_config(None, ["algorithm.use_bias_correction_kl=true"]).kl_estimator == "k3_ratio"
    with pytest.raises(ConfigError, match="set only one"):
        load_config(None, ["algorithm.use_bias_correction_kl=true", "algorithm.kl_estimator=k3"])
    with pytest.raises(ConfigError, match="did you mean 'k3_ratio'"):
        load_config(None, ["algorithm.kl_estimator=k3_ratoi"])


def _expected_kl_gradient(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact expectation over a 5-token vocabulary, x ~ old = the current policy (on-policy), of the gradient of
    the estimator w.r.t. the policy's logits; and the gradients of KL(pi || ref) and KL(ref || pi)."""
    torch.manual_seed(6)
    theta = torch.randn(5, requires_grad=True)
    ref = torch.log_softmax(torch.randn(5), 0)
    logp = torch.log_softmax(theta, 0)
    old = logp.detach()
    expected = (old.exp() * KL_ESTIMATORS[name](logp, ref, old)).sum()  # E_{x ~ old}[k(x)], old held fixed
    (g,) = torch.autograd.grad(expected, theta)
    fresh = torch.log_softmax(theta, 0)
    reverse = (fresh.exp() * (fresh - ref)).sum()
    (g_rev,) = torch.autograd.grad(reverse, theta)
    forward = (ref.exp() * (ref - torch.log_softmax(theta, 0))).sum()
    (g_fwd,) = torch.autograd.grad(forward, theta)
    return g, g_rev, g_fwd


@pytest.mark.parametrize("name, target", [("k3_ratio", "reverse"), ("k2", "reverse"), ("k1", "reverse"), ("k3", "forward")])
def test_kl_estimator_expected_gradients(name, target):
    """k3 x ratio (TRL's default) and k2 give KL(pi || ref)'s gradient; plain k3 gives KL(ref || pi)'s; k1's
    expected gradient is that of KL(pi || ref) only through the score function (here: held-fixed sampling)."""
    g, g_rev, g_fwd = _expected_kl_gradient(name)
    if name == "k1":  # E_old[grad logp] = sum_x old grad logp = 0 at old = pi: k1 gives no gradient this way
        torch.testing.assert_close(g, torch.zeros_like(g), atol=1e-6, rtol=0)
        return
    torch.testing.assert_close(g, g_rev if target == "reverse" else g_fwd, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(g_rev, g_fwd, atol=1e-3)  # the two targets differ: the check can fail


# ---------------------------------------------------------------- TRL's normaliser and the trl preset
def test_token_mean_rollout_hand_computed():
    """TRL's dapo: a rollout of 2 optimizer steps with 5 and 11 tokens divides each step's sum by 16 / 2 = 8."""
    from vlmrl.algo.losses import Normaliser

    loss, mask = torch.ones(2, 4), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    norm = Normaliser(num_sequences=2, num_tokens=5, max_completion_length=4, rollout_tokens_per_step=8.0)
    assert aggregate(loss, mask, "token_mean_rollout", norm).item() == pytest.approx(5 / 8)
    assert aggregate(loss, mask, "token_mean", norm).item() == pytest.approx(1.0)


def test_trl_preset_fills_only_unset_fields():
    cfg = load_config(None, ["algorithm.preset=trl", "algorithm.beta=0.04"])
    assert (cfg.loss_aggregation, cfg.kl_estimator, cfg.optim.adam_beta2, cfg.optim.lr_scheduler_type) == (
        "token_mean_rollout",
        "k3_ratio",
        0.999,
        "linear",
    )
    mine = load_config(
        None,
        [
            "algorithm.preset=trl",
            "algorithm.loss_type=grpo",
            "algorithm.kl_estimator=k3",
            "optim.adam_beta2=0.99",
            "optim.lr_scheduler_type=constant",
        ],
    )
    assert (mine.loss_aggregation, mine.kl_estimator, mine.optim.adam_beta2, mine.optim.lr_scheduler_type) == (
        "seq_mean_token_mean",
        "k3",
        0.99,
        "constant",
    )
    plain = load_config(None, [])
    assert (plain.loss_aggregation, plain.kl_estimator, plain.optim.adam_beta2) == ("seq_mean_token_mean", "k3", 0.99)
