"""Rollout-training mismatch: the sampler's per-token log-probs, the mismatch metrics, and the importance-sampling
correction (truncated / masked, token / sequence level): hand-computed values, a naive loop, and the loop."""

import json
import math
import pathlib

import pytest
import torch
from test_logprobs import model_cfg, prompt_batch

from vlmrl.config import AlgorithmConfig, ConfigError, load_config
from vlmrl.algo.losses import per_token_loss
from vlmrl.algo.mismatch import ROLLOUT_CORRECTIONS, log_ratios, mismatch_metrics

LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"

# Two rows of two tokens: log(train / sampler) = [[ln 2, ln 0.5], [ln 4, 0]], the second row's last token masked.
TRAIN = torch.log(torch.tensor([[0.4, 0.1], [0.8, 0.3]]))
SAMPLER = torch.log(torch.tensor([[0.2, 0.2], [0.2, 0.3]]))
MASK = torch.tensor([[1, 1], [1, 0]])


@pytest.mark.unit
@pytest.mark.parametrize(
    "mode, lo, hi, want",
    [
        ("token_truncate", None, 3.0, [[2.0, 0.5], [3.0, 1.0]]),
        ("token_truncate", 0.6, 3.0, [[2.0, 0.6], [3.0, 1.0]]),
        ("token_mask", None, 3.0, [[2.0, 0.5], [0.0, 1.0]]),
        ("token_mask", 0.6, 3.0, [[2.0, 0.0], [0.0, 1.0]]),
        # per sequence: the product of the row's masked ratios (1 and 4), on every token of the row
        ("sequence_truncate", None, 3.0, [[1.0, 1.0], [3.0, 3.0]]),
        ("sequence_mask", None, 3.0, [[1.0, 1.0], [0.0, 0.0]]),
        ("sequence_mask", None, 5.0, [[1.0, 1.0], [4.0, 4.0]]),
    ],
)
def test_rollout_correction_weights_hand_computed(mode, lo, hi, want):
    w = ROLLOUT_CORRECTIONS[mode](TRAIN, SAMPLER, MASK, lo, hi)
    torch.testing.assert_close(w, torch.tensor(want))
    assert not w.requires_grad


@pytest.mark.unit
def test_mismatch_metrics_hand_computed():
    d = log_ratios(SAMPLER, TRAIN, MASK)  # ln 2, ln 0.5, ln 4
    m = mismatch_metrics(d)
    k3 = [math.exp(x) - x - 1 for x in (math.log(2), math.log(0.5), math.log(4))]
    assert m["mismatch/kl"] == pytest.approx(sum(k3) / 3)
    assert (m["mismatch/max_ratio"], m["mismatch/min_ratio"]) == pytest.approx((4.0, 0.5))
    assert m["mismatch/max_abs_logp_diff"] == pytest.approx(math.log(4))
    assert mismatch_metrics(log_ratios(TRAIN, TRAIN, MASK))["mismatch/kl"] == 0.0


@pytest.mark.unit
def test_weights_multiply_the_policy_loss_not_the_kl_naive_loop():
    torch.manual_seed(7)
    logps0, old, ref = -torch.rand(3, 4), -torch.rand(3, 4), -torch.rand(3, 4)
    adv, w = torch.randn(3), torch.rand(3, 4) * 2
    algo = AlgorithmConfig(beta=0.1)
    logps = logps0.clone().requires_grad_(True)
    loss, _ = per_token_loss(logps, old, adv, algo, ref, is_weights=w)
    loss.sum().backward()
    naive_logps = logps0.clone().requires_grad_(True)
    total = 0.0
    for i in range(3):
        for j in range(4):
            r = torch.exp(naive_logps[i, j] - old[i, j])
            policy = -torch.min(r * adv[i], torch.clamp(r, 0.8, 1.2) * adv[i])
            d = ref[i, j] - naive_logps[i, j]
            total = total + w[i, j] * policy + 0.1 * (torch.exp(d) - d - 1)
    total.backward()
    assert loss.sum().item() == pytest.approx(total.item(), rel=1e-6)
    torch.testing.assert_close(logps.grad, naive_logps.grad)


@pytest.mark.unit
def test_rollout_correction_config():
    assert load_config(None, ["algorithm.rollout_correction=token_mask"]).scores_old_logps
    with pytest.raises(ConfigError, match="did you mean 'token_mask'"):
        load_config(None, ["algorithm.rollout_correction=token_msk"])
    with pytest.raises(ConfigError, match="rollout_correction_min"):
        load_config(None, ["algorithm.rollout_correction_min=4", "algorithm.rollout_correction_max=3"])


# ---------------------------------------------------------------- the sampler's log-probs against the scoring pass
@pytest.fixture(scope="module")
def qwen(tiny_qwen25vl):
    from vlmrl.models.loading import load_model
    from vlmrl.models.processing import load_processor

    processor = load_processor(tiny_qwen25vl)
    return load_model(model_cfg(tiny_qwen25vl)).eval(), processor, prompt_batch(processor, [1, 2, 1], seed=3)


@pytest.mark.integration
@pytest.mark.parametrize("engine, decode_batch_size", [("loop", 0), ("continuous", 1), ("continuous", 0)])
def test_sampler_logps_equal_the_scoring_pass(qwen, engine, decode_batch_size):
    """fp32 on CPU: the decode step's log-prob of each sampled token equals the scoring forward's to float32
    rounding, whatever the decode batch (the mismatch the metric reports is that rounding)."""
    from vlmrl.models.logprobs import group_rows
    from vlmrl.models.prefix import LogprobOptions, completion_logps_for
    from vlmrl.models.rollout import generate

    model, processor, prompts = qwen
    torch.manual_seed(0)
    comp = generate(
        model,
        processor.tokenizer,
        prompts,
        num_generations=3,
        max_new_tokens=6,
        temperature=0.7,
        engine=engine,
        decode_batch_size=decode_batch_size,
        prompt_seeds=[11, 22, 33],
    )
    assert comp.sampling_logps is not None and comp.sampling_logps.shape == comp.ids.shape
    assert (comp.sampling_logps[comp.mask == 0] == 0).all() and (comp.sampling_logps[comp.mask == 1] < 0).all()
    _, row_prompt = group_rows(torch.arange(3).repeat_interleave(3))
    with torch.no_grad():
        scored = completion_logps_for(model, prompts, row_prompt, comp.ids, comp.mask, LogprobOptions(temperature=0.7, chunk_tokens=0))
    m = mismatch_metrics(log_ratios(comp.sampling_logps, scored, comp.mask))
    assert m["mismatch/max_abs_logp_diff"] < 1e-4, m
    # A wrong temperature on either side shows up: the comparison can fail.
    with torch.no_grad():
        wrong = completion_logps_for(model, prompts, row_prompt, comp.ids, comp.mask, LogprobOptions(temperature=1.0, chunk_tokens=0))
    assert mismatch_metrics(log_ratios(comp.sampling_logps, wrong, comp.mask))["mismatch/max_abs_logp_diff"] > 1e-2


@pytest.mark.integration
def test_hf_generate_path_reports_no_sampler_logps(qwen):
    from vlmrl.models.rollout import generate

    model, processor, prompts = qwen
    comp = generate(model, processor.tokenizer, prompts, num_generations=2, max_new_tokens=3, shared_prefix=False)
    assert comp.sampling_logps is None


@pytest.mark.integration
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["algorithm.rollout_correction=sequence_mask", "algorithm.rollout_correction_max=2.0"],
        # every ratio (~1) is above 0.5: every token is masked, so the update has no gradient (the weights are applied)
        ["algorithm.rollout_correction=token_mask", "algorithm.rollout_correction_max=0.5"],
    ],
)
def test_train_logs_the_mismatch_every_step(tiny_qwen25vl, tmp_path, extra):
    """The metric is logged with and without scored old log-probs (then from the first step's own forward); with a
    correction the run trains with the weights (near 1 with max 2: nothing masked; all 0 with max 0.5)."""
    from vlmrl.data.tasks import make_count_task
    from vlmrl.train import train

    data = make_count_task(tmp_path / "count", n_train=4, n_test=0, seed=0, image_size=56)
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_qwen25vl}",
            f"data.train_path={data['train']}",
            "data.eval_path=",
            f"training.output_dir={out}",
            "training.max_steps=2",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=4",
            "rollout.max_completion_length=4",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "training.save_final_model=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            f"algorithm.reward_funcs=['{LENGTH_REWARD}']",
            *extra,
        ],
    )
    train(cfg, log=lambda *_: None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert 0 <= r["mismatch/kl"] < 1e-8 and r["mismatch/max_abs_logp_diff"] < 1e-4, r
        assert r["mismatch/min_ratio"] <= 1 <= r["mismatch/max_ratio"] and math.isfinite(r["loss"])
        assert (r["grad_norm"] == 0.0) == ("algorithm.rollout_correction_max=0.5" in extra), r["grad_norm"]
