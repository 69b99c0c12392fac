"""Entropy-quantile token masking (algorithm.top_entropy_quantile; Beyond the 80/20 rule, TRL's top_entropy_quantile):
the pure mask on a hand-computed example and against a naive loop, the entropies from the chunked LM head against a
full-vocabulary computation, and the training run's per-step mask."""

import json
import math

import pytest
import torch

from vlmrl.algo.losses import entropy_quantile_mask
from vlmrl.models.logprobs import entropies_collected, selective_logps

pytestmark = pytest.mark.unit


def test_mask_by_hand():
    """Masked entropies 0.1 0.5 0.9 | 0.3 0.7 (the 9.0 is padding): sorted 0.1 0.3 0.5 0.7 0.9.
    top 0.5 -> the 0.5 quantile is 0.5: keep 0.5, 0.9, 0.7 (a tie at the threshold is kept).
    top 0.2 -> the 0.8 quantile is 0.7 + 0.2 * (0.9 - 0.7) = 0.74: keep 0.9 only."""
    ent = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert entropy_quantile_mask(ent, mask, 0.5).tolist() == [[False, True, True], [False, True, False]]
    assert entropy_quantile_mask(ent, mask, 0.2).tolist() == [[False, False, True], [False, False, False]]
    assert entropy_quantile_mask(ent, mask, 1.0).tolist() == mask.bool().tolist()  # off: the mask itself
    assert not entropy_quantile_mask(ent, torch.zeros_like(mask), 0.2).any()  # no token counts: none kept
    # A quantile over more tokens than these rows' (every process's): threshold 0.8 quantile of 0.1 .. 1.0 = 0.82.
    pooled = torch.linspace(0.1, 1.0, 10)
    assert entropy_quantile_mask(ent, mask, 0.2, pooled=pooled).tolist() == [[False, False, True], [False, False, False]]


def _naive_quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's / torch's default)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (pos - lo) * (v[hi] - v[lo])


@pytest.mark.parametrize("top", [0.05, 0.2, 0.5, 0.9])
def test_mask_equals_a_naive_loop(top):
    g = torch.Generator().manual_seed(int(top * 100))
    ent = torch.rand(6, 9, generator=g) * 3  # float32, as the scoring pass's
    lengths = torch.randint(0, 10, (6,), generator=g)
    mask = (torch.arange(9)[None] < lengths[:, None]).long()
    values = [float(ent[i, t]) for i in range(6) for t in range(9) if mask[i, t]]
    threshold = _naive_quantile(values, 1 - top)
    want = [[bool(mask[i, t]) and float(ent[i, t]) >= threshold for t in range(9)] for i in range(6)]
    got = entropy_quantile_mask(ent, mask, top)
    assert got.tolist() == want
    assert abs(int(got.sum()) - top * len(values)) <= 1 + 1e-9  # about the top fraction


@pytest.mark.parametrize("chunk", [0, 4, 100])
def test_entropies_from_the_chunked_lm_head(chunk):
    """selective_logps' entropies (chunks of `chunk` tokens; 0 = one block) equal the full-vocabulary entropies of
    softmax(logits / T); collecting them changes neither the log-probs nor their gradients."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 5), generator=g)
    logits = head(hidden).detach() / 0.7
    want = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    with entropies_collected() as out:
        logps = selective_logps(hidden, head, targets, temperature=0.7, chunk_tokens=chunk)
    assert len(out) == 1 and not out[0].requires_grad
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-6)
    logps.sum().backward()
    grad_with = hidden.grad.clone()
    hidden.grad = None
    plain = selective_logps(hidden, head, targets, temperature=0.7, chunk_tokens=chunk)
    plain.sum().backward()
    torch.testing.assert_close(logps.detach(), plain.detach(), rtol=0, atol=0)
    torch.testing.assert_close(grad_with, hidden.grad, rtol=0, atol=0)


@pytest.mark.integration
def test_training_keeps_the_top_fraction_per_step(tiny_qwen25vl, tmp_path, monkeypatch):
    """A run with top_entropy_quantile=0.25: each optimizer step's policy loss keeps about a quarter of its loss tokens
    (one threshold over the step's tokens), and the run's loss differs from the unmasked run's."""
    import vlmrl.train as train_module
    from test_integration import grpo_cfg
    from vlmrl.data.tasks import make_count_task

    kept = []
    real = train_module.step_entropy_masks

    def spy(run, entropies, loss_mask):
        out = real(run, entropies, loss_mask)
        per = run.shard.rows_per_opt_step
        for s in range(0, loss_mask.shape[0], per):
            kept.append((int(out[s : s + per].sum()), int(loss_mask[s : s + per].sum())))
        assert not (out & ~loss_mask.bool()).any()
        return out

    monkeypatch.setattr(train_module, "step_entropy_masks", spy)
    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    losses = {}
    for q in (1.0, 0.25):
        out = tmp_path / f"q{q}"
        train_module.train(grpo_cfg(tiny_qwen25vl, data, out, f"algorithm.top_entropy_quantile={q}", "rollout.max_completion_length=12"))
        losses[q] = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(kept) == 4  # 2 steps x a rollout of 2 optimizer steps
    for k, n in kept:
        assert n > 0 and abs(k - 0.25 * n) <= max(2, 0.1 * n), (k, n)
    assert losses[0.25] != losses[1.0]


def test_scoring_computes_entropies_only_when_a_mask_needs_them(tiny_qwen25vl, tmp_path, monkeypatch):
    """The reference scoring of a beta > 0 run without an entropy mask opens no entropy sink (each one costs a second
    pass over the LM head per chunk); with a mask, the policy's scoring does."""
    import vlmrl.train as train_module
    from test_integration import grpo_cfg
    from vlmrl.data.tasks import make_count_task

    opened = []
    real = train_module.entropies_collected

    def spy():
        opened.append(1)
        return real()

    monkeypatch.setattr(train_module, "entropies_collected", spy)
    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    counts = {}
    for q in (1.0, 0.25):
        opened.clear()
        out = tmp_path / f"q{q}"
        train_module.train(
            grpo_cfg(tiny_qwen25vl, data, out, f"algorithm.top_entropy_quantile={q}", "algorithm.beta=0.04", "rollout.max_completion_length=8")
        )
        counts[q] = len(opened)
    assert counts[1.0] == 0 and counts[0.25] > 0, counts


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5"])
def test_quantile_outside_0_1_refused(value):
    from vlmrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"algorithm.top_entropy_quantile={float(value)} must be in \\(0, 1\\]"):
        load_config(None, [f"algorithm.top_entropy_quantile={value}"])
