"""GSPO, CISPO and REINFORCE++ (each one function in a dict): hand-computed values and naive per-sequence loops;
the config names and their TRL aliases; the optimizer step's non-finite skip; the schedule without transformers."""

import math

import pytest
import torch

from vlmrl.algo.advantages import ADVANTAGE_ESTIMATORS, group_advantages, reinforce_pp_advantages
from vlmrl.config import AlgorithmConfig, ConfigError, load_config
from vlmrl.algo.losses import AGGREGATIONS, POLICY_LOSSES, aggregate, per_token_loss, step_normaliser
from vlmrl.train import loss_mask_of

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    # batch mean 2/3; unbiased batch std sqrt((4/3)/5) = 0.5163978
    std = math.sqrt((4 / 3) / 5)
    expected = [(r - 2 / 3) / (std + 1e-4) for r in rewards.tolist()]
    assert reinforce_pp_advantages(rewards, 2).tolist() == pytest.approx(expected, rel=1e-6)
    # the all-ones group (rows 4, 5) gets a positive advantage: the baseline is the batch, not the group
    assert reinforce_pp_advantages(rewards, 2)[4] > 0 and group_advantages(rewards, 2)[4] == 0


def test_reinforce_pp_matches_naive_loop():
    torch.manual_seed(0)
    rewards = torch.rand(12)
    n = len(rewards)
    mean = sum(rewards.tolist()) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards.tolist()) / (n - 1))
    naive = [(r - mean) / (std + 1e-4) for r in rewards.tolist()]
    assert ADVANTAGE_ESTIMATORS["reinforce_pp"](rewards, 4, AlgorithmConfig()).tolist() == pytest.approx(naive, rel=1e-5)


# ---------------------------------------------------------------- GSPO
def test_gspo_hand_computed_value_and_gradient():
    """One sequence, two tokens, mean log-ratio 0.5: s = e^0.5 = 1.6487."""
    old = torch.tensor([[-1.5, -2.5]])
    mask = torch.ones(1, 2)
    norm = step_normaliser([mask], 2)
    s = math.exp(0.5)
    # A = +1: min(s, 1.2) = 1.2 (clipped): loss -1.2 and no gradient.
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = aggregate(
        per_token_loss(logps, old, torch.tensor([1.0]), AlgorithmConfig(policy_loss="gspo"), mask=mask)[0], mask, "seq_mean_token_mean", norm
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert logps.grad.abs().max().item() == 0
    # A = -1: min(-s, -1.2) = -s (unclipped): loss s, d loss / d logp_t = s / 2 per token (the sequence mean's 1/|y|).
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = aggregate(
        per_token_loss(logps, old, torch.tensor([-1.0]), AlgorithmConfig(policy_loss="gspo"), mask=mask)[0], mask, "seq_mean_token_mean", norm
    )
    loss.backward()
    assert loss.item() == pytest.approx(s, rel=1e-6)
    assert logps.grad[0].tolist() == pytest.approx([s / 2, s / 2], rel=1e-6)


def test_gspo_matches_naive_sequence_loop_values_and_gradients():
    torch.manual_seed(1)
    n, t = 5, 7
    logps0 = -torch.rand(n, t) * 3
    old = logps0 + 0.05 * torch.randn(n, t)
    adv = torch.randn(n)
    mask = (torch.rand(n, t) > 0.3).float()
    mask[:, 0] = 1
    eps_lo, eps_hi = 0.03, 0.04

    logps = logps0.clone().requires_grad_(True)
    tok, _ = per_token_loss(logps, old, adv, AlgorithmConfig(epsilon=eps_lo, epsilon_high=eps_hi, policy_loss="gspo"), mask=mask)
    fast = aggregate(tok, mask, "seq_mean_token_mean", step_normaliser([mask], t))
    fast.backward()

    ref_logps = logps0.clone().requires_grad_(True)
    total = 0.0
    for i in range(n):
        idx = mask[i].bool()
        s = torch.exp((ref_logps[i][idx] - old[i][idx]).mean())
        total = total - torch.min(s * adv[i], torch.clamp(s, 1 - eps_lo, 1 + eps_hi) * adv[i])
    naive = total / n
    naive.backward()
    assert fast.item() == pytest.approx(naive.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(logps.grad * mask, ref_logps.grad * mask, rtol=1e-5, atol=1e-7)


def _gspo_step(logps0, old, adv, weights, aggregation, **algo_kw):
    """vlmrl's GSPO loss of one step with per-token weights (train.policy_weights' role) and its gradient."""
    logps = logps0.clone().requires_grad_(True)
    mask = torch.ones_like(logps0) if "mask" not in algo_kw else algo_kw.pop("mask")
    tok, _ = per_token_loss(logps, old, adv, AlgorithmConfig(policy_loss="gspo", **algo_kw), mask=mask, is_weights=weights)
    loss = aggregate(tok, mask, aggregation, step_normaliser([mask], logps0.shape[1]))
    loss.backward()
    return loss.item(), logps.grad


def test_gspo_with_per_token_weights_hand_computed():
    """Issue 35, finding 8. One sequence of two tokens, s = e^0.5 unclipped (A = -1): loss_t = w_t s. The step's
    loss is the weights' mean times s, so each token's gradient is mean(w) * ds/dlogp_t = mean(w) * s / 2, whatever
    its own weight (TRL's broadcast of the sequence's term). Before the fix token t got w_t * s / 2."""
    old, logps0 = torch.tensor([[-1.5, -2.5]]), torch.tensor([[-1.0, -2.0]])
    s = math.exp(0.5)
    # entropy mask keeps token 0 only; grpo's per-sequence mean: loss = (1 s + 0 s) / 2
    loss, grad = _gspo_step(logps0, old, torch.tensor([-1.0]), torch.tensor([[1.0, 0.0]]), "seq_mean_token_mean")
    assert loss == pytest.approx(s / 2, rel=1e-6)
    assert grad[0].tolist() == pytest.approx([s / 4, s / 4], rel=1e-6)  # not [s / 2, 0]
    # rollout-correction weights 0.5, 1.5 (mean 1): loss s, gradient s / 2 each (as without weights)
    loss, grad = _gspo_step(logps0, old, torch.tensor([-1.0]), torch.tensor([[0.5, 1.5]]), "token_mean")
    assert loss == pytest.approx(s, rel=1e-6)
    assert grad[0].tolist() == pytest.approx([s / 2, s / 2], rel=1e-6)  # not [s / 4, 3 s / 4]


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
def test_gspo_with_per_token_weights_is_the_gradient_of_its_loss(aggregation):
    """Random per-token weights, padding, both advantage signs: vlmrl's value and gradient equal a naive loop over
    sequences of sum_t c w_t f(s) (c: the aggregation's weight of a token of the row, f: GSPO's clipped term)."""
    torch.manual_seed(3)
    n, t = 6, 5
    logps0 = -torch.rand(n, t, dtype=torch.float64) * 3
    old = logps0 + 0.3 * torch.randn(n, t, dtype=torch.float64)
    adv = torch.randn(n, dtype=torch.float64)
    mask = (torch.rand(n, t) > 0.3).double()
    mask[:, 0] = 1
    weights = torch.rand(n, t, dtype=torch.float64) * 2
    eps_lo, eps_hi = 0.03, 0.04
    value, grad = _gspo_step(logps0, old, adv, weights, aggregation, epsilon=eps_lo, epsilon_high=eps_hi, mask=mask)

    ref = logps0.clone().requires_grad_(True)
    lengths = mask.sum(dim=1)
    ones = torch.ones(n, dtype=torch.float64)
    coeff = {"seq_mean_token_mean": 1 / (n * lengths), "token_mean": ones / mask.sum(), "seq_mean_token_sum_norm": ones / (n * t)}
    total = 0.0
    for i in range(n):
        idx = mask[i].bool()
        s = torch.exp((ref[i][idx] - old[i][idx]).mean())
        f = -torch.min(s * adv[i], torch.clamp(s, 1 - eps_lo, 1 + eps_hi) * adv[i])
        total = total + coeff[aggregation][i] * weights[i][idx].sum() * f
    total.backward()
    assert value == pytest.approx(total.item(), rel=1e-12)
    torch.testing.assert_close(grad * mask, ref.grad * mask, rtol=1e-12, atol=1e-15)
    assert (grad * mask).abs().max() > 0  # some rows unclipped: the comparison sees gradients


def test_gspo_delta_caps_the_sequence_ratio():
    """TRL's delta under importance_sampling_level=sequence: A < 0, s = e^0.5 = 1.65 > delta = 1.5: the term is
    -min(1.5 A, clip(s) A) = 1.5, no gradient; without delta it is s with gradient s / 2 per token."""
    old, logps0 = torch.tensor([[-1.5, -2.5]]), torch.tensor([[-1.0, -2.0]])
    loss, grad = _gspo_step(logps0, old, torch.tensor([-1.0]), None, "seq_mean_token_mean", delta=1.5)
    assert loss == pytest.approx(1.5) and grad.abs().max().item() == 0
    loss, grad = _gspo_step(logps0, old, torch.tensor([-1.0]), None, "seq_mean_token_mean")
    assert loss == pytest.approx(math.exp(0.5), rel=1e-6) and grad[0].tolist() == pytest.approx([math.exp(0.5) / 2] * 2, rel=1e-6)
    assert load_config(None, ["algorithm.policy_loss=gspo", "algorithm.delta=1.5"]).algorithm.delta == 1.5
    with pytest.raises(ConfigError, match="delta applies to policy_loss=ppo_clip or gspo only"):
        load_config(None, ["algorithm.policy_loss=sapo", "algorithm.delta=1.5"])


# ---------------------------------------------------------------- CISPO
def test_cispo_hand_computed():
    """ratio e^0.5 = 1.65 > 1 + 0.28: the weight is clipped to 1.28 but the token keeps its gradient -w A."""
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]])  # ratios e^0.5, 1
    mask = torch.ones(1, 2)
    tok, parts = per_token_loss(logps, old, torch.tensor([2.0]), AlgorithmConfig(epsilon_high=0.28, policy_loss="cispo"), mask=mask)
    assert tok[0].tolist() == pytest.approx([-1.28 * 2 * -1.0, -1.0 * 2 * -2.0])
    assert parts["is_clipped"].tolist() == [[True, False]]
    tok.sum().backward()
    assert logps.grad[0].tolist() == pytest.approx([-1.28 * 2, -2.0])


def test_cispo_matches_naive_token_loop():
    torch.manual_seed(2)
    n, t = 4, 6
    logps0 = -torch.rand(n, t) * 2
    old = logps0 + 0.3 * torch.randn(n, t)
    adv = torch.randn(n)
    mask = (torch.rand(n, t) > 0.2).float()
    logps = logps0.clone().requires_grad_(True)
    fast = aggregate(
        per_token_loss(logps, old, adv, AlgorithmConfig(epsilon_high=0.28, policy_loss="cispo"), mask=mask)[0],
        mask,
        "token_mean",
        step_normaliser([mask], t),
    )
    fast.backward()
    ref_logps = logps0.clone().requires_grad_(True)
    total, count = 0.0, 0
    for i in range(n):
        for j in range(t):
            if mask[i, j]:
                w = min(math.exp(float(logps0[i, j] - old[i, j])), 1.28)
                total = total - w * adv[i] * ref_logps[i, j]
                count += 1
    naive = total / count
    naive.backward()
    assert fast.item() == pytest.approx(naive.item(), rel=1e-5)
    torch.testing.assert_close(logps.grad, ref_logps.grad, rtol=1e-5, atol=1e-7)


def test_policy_losses_accept_per_token_advantages():
    logps = -torch.rand(2, 3)
    adv_seq = torch.tensor([0.5, -1.0])
    adv_tok = adv_seq.unsqueeze(1).expand(2, 3)
    mask = torch.ones(2, 3)
    for name, fn in POLICY_LOSSES.items():
        a, _ = fn(logps, logps + 0.1, adv_seq, mask, AlgorithmConfig())
        b, _ = fn(logps, logps + 0.1, adv_tok, mask, AlgorithmConfig())
        torch.testing.assert_close(a, b, msg=name)


# ---------------------------------------------------------------- config names and aliases
def test_trl_names_are_aliases_of_the_explicit_ones():
    cfg = load_config(None, ["algorithm.loss_type=dapo", "algorithm.scale_rewards=none"])
    assert (cfg.loss_aggregation, cfg.advantage_estimator) == ("token_mean", "dr_grpo")
    cfg = load_config(None, ["algorithm.advantage_estimator=reinforce_pp", "algorithm.policy_loss=cispo", "algorithm.loss_aggregation=token_mean"])
    assert (cfg.advantage_estimator, cfg.algorithm.policy_loss, cfg.loss_aggregation) == ("reinforce_pp", "cispo", "token_mean")
    assert set(AGGREGATIONS) == {"seq_mean_token_mean", "token_mean", "token_mean_rollout", "seq_mean_token_sum_norm", "local_token_mean"}
    assert load_config(None, ["algorithm.loss_type=bnpo"]).loss_aggregation == "local_token_mean"


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.policy_loss=gpso", "did you mean 'gspo'"),
        ("algorithm.advantage_estimator=reinforce", "did you mean 'reinforce_pp'"),
        ("algorithm.loss_aggregation=token-mean", "did you mean 'token_mean'"),
    ],
)
def test_unknown_algorithm_names_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_alias_and_explicit_name_together_are_refused():
    with pytest.raises(ConfigError, match="set only one"):
        load_config(None, ["algorithm.scale_rewards=batch", "algorithm.advantage_estimator=grpo"])
    with pytest.raises(ConfigError, match="set only one"):
        load_config(None, ["algorithm.loss_type=dapo", "algorithm.loss_aggregation=token_mean"])


# ---------------------------------------------------------------- the loss mask
def test_loss_mask_hand_made():
    completion_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    truncated = torch.tensor([False, True, False])
    assert loss_mask_of(completion_mask, truncated, mask_truncated=False).tolist() == completion_mask.tolist()
    assert loss_mask_of(completion_mask, truncated, mask_truncated=True).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    assert completion_mask[1].sum() == 4  # the input is not changed in place


def test_the_readme_example_algorithm_plugs_in(monkeypatch):
    """The "Adding an algorithm" diff, taken from docs/algorithms.md itself: the function it adds, registered in
    POLICY_LOSSES, is accepted by the config and used by per_token_loss."""
    import pathlib
    import re

    import vlmrl.algo.losses as losses

    page = (pathlib.Path(__file__).parents[1] / "docs" / "algorithms.md").read_text()
    diff = re.search(r"```diff\n(.*?)```", page, re.S).group(1)
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    code = "\n".join(line for line in added if not line.startswith("POLICY_LOSSES"))
    namespace = {"torch": torch, "_per_token": losses._per_token, "epsilon_high": losses.epsilon_high}
    exec(code, namespace)  # noqa: S102 - our own docs
    monkeypatch.setitem(losses.POLICY_LOSSES, "masked_ratio", namespace["masked_ratio_loss"])
    assert load_config(None, ["algorithm.policy_loss=masked_ratio"]).algorithm.policy_loss == "masked_ratio"
    logps = torch.tensor([[-1.0, -1.0]])
    old = torch.tensor([[-1.0, -2.0]])  # ratios 1 (inside) and e (outside)
    loss, parts = per_token_loss(logps, old, torch.tensor([2.0]), AlgorithmConfig(policy_loss="masked_ratio"))
    assert loss[0].tolist() == pytest.approx([-2.0, 0.0]) and parts["is_clipped"].tolist() == [[False, True]]
