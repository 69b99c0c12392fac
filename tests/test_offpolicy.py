"""Off-policy correctness of the update: the importance ratio is taken against the policy that sampled the rows.

A rollout that spans two optimizer steps (rollout.generation_batch_size = 2 x the rows of one step,
num_iterations=1): the second step sees rows sampled before the first step changed the policy, so its ratio is
not 1 and its gradient is PPO's clipped-surrogate gradient against the sampling policy. The loop's gradients of
both steps are checked against a naive PPO loop (one row per forward, old log-probs from a copy of the policy
taken before the update).
"""

import copy
import pathlib

import pytest
import torch

from vlmrl.config import load_config
from vlmrl.models.prefix import completion_logps_for
from vlmrl.models.processing import select_rows
from vlmrl.data.tasks import make_count_task
from vlmrl import train as loop

pytestmark = pytest.mark.integration
LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"


def _config(model, data, out, *extra):
    return load_config(
        None,
        [
            f"model.name_or_path={model}",
            f"data.train_path={data['train']}",
            "data.eval_path=",
            f"training.output_dir={out}",
            "training.max_steps=1",
            "rollout.num_generations=4",
            "training.per_device_train_batch_size=4",
            "rollout.generation_batch_size=8",  # two optimizer steps per rollout
            "rollout.max_completion_length=5",
            "optim.learning_rate=5e-2",
            "optim.max_grad_norm=0",
            "algorithm.epsilon=0.2",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            f"algorithm.reward_funcs=['{LENGTH_REWARD}']",
            "training.seed=3",
            *extra,
        ],
    )


def _naive_ppo_grads(policy, samples, advantages, old, rows, opts, eps_lo, eps_hi):
    """GRPO loss of one optimizer step, one row per forward: mean over rows of the token mean of
    -min(r A, clip(r) A), r = exp(logp - old). Returns {name: grad}."""
    policy.zero_grad(set_to_none=True)
    comp = samples.completions
    total = 0.0
    for i in rows:
        n = int(comp.lengths[i])
        prompt = select_rows(samples.prompts, [int(samples.prompt_of_row[i])])
        logp = completion_logps_for(policy, prompt, torch.tensor([0]), comp.ids[i : i + 1, :n], comp.mask[i : i + 1, :n], opts)[0]
        ratio = torch.exp(logp - old[i, :n])
        a = advantages[i]
        total = total - torch.min(ratio * a, torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi) * a).mean() / len(rows)
    total.backward()
    return {name: p.grad.detach().clone() for name, p in policy.named_parameters() if p.grad is not None}


def test_second_step_of_a_rollout_uses_the_sampling_policy(tiny_qwen25vl, tmp_path):
    data = make_count_task(tmp_path / "count", n_train=8, n_test=0, seed=0, image_size=56)
    cfg = _config(tiny_qwen25vl, data, tmp_path / "run")
    assert cfg.reuses_rollout and cfg.optimizer_steps_per_rollout == 2
    run = loop.start_run(cfg, lambda *_: None)
    sampler_copy = copy.deepcopy(run.model)
    samples = loop.rollout(run, 1)
    rewards = loop.reward_and_advantages(run, samples, 1)
    scores = loop.score(run, samples, rewards)
    assert scores.old_logps is not None  # on main before the fix: None (num_iterations == 1)

    recorded = []  # (weights before the step, gradients) of each optimizer step
    original = run.dist.optimizer_step

    def recording_step(optimizer, scheduler, max_grad_norm):
        named = list(run.model.named_parameters())
        recorded.append(({n: p.detach().clone() for n, p in named}, {n: p.grad.detach().clone() for n, p in named if p.grad is not None}))
        return original(optimizer, scheduler, max_grad_norm)

    run.dist.optimizer_step = recording_step
    stats = loop.update(run, samples, rewards, scores)
    assert len(recorded) == 2
    assert stats.ratio_dev[0] > 1e-3  # the second step's ratio is not 1

    # Old log-probs of the naive loop: the sampling policy, one row per forward.
    old = _current_logps(sampler_copy, samples, run.opts)
    naive = copy.deepcopy(sampler_copy).train()
    for step, rows in enumerate([range(0, 4), range(4, 8)]):
        weights, grads = recorded[step]
        naive.load_state_dict(weights, strict=False)
        want = _naive_ppo_grads(naive, samples, rewards.advantages, old, rows, run.opts, 0.2, 0.2)
        assert set(want) == set(grads)
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-4, atol=1e-6, msg=f"step {step + 1}: {name}")
    # The stale step's gradient is not the on-policy one (ratio taken as 1): the check above can fail.
    weights, grads = recorded[1]
    naive.load_state_dict(weights, strict=False)
    on_policy = _naive_ppo_grads(naive, samples, rewards.advantages, _current_logps(naive, samples, run.opts), range(4, 8), run.opts, 0.2, 0.2)
    assert max(float((on_policy[n] - grads[n]).abs().max()) for n in grads) > 1e-4


def _current_logps(policy, samples, opts):
    """[N, T] log-probs of the rollout's rows under `policy`, one row per forward, no gradient."""
    comp = samples.completions
    out = torch.zeros(comp.ids.shape)
    with torch.no_grad():
        for i in range(comp.ids.shape[0]):
            n = int(comp.lengths[i])
            prompt = select_rows(samples.prompts, [int(samples.prompt_of_row[i])])
            out[i, :n] = completion_logps_for(policy, prompt, torch.tensor([0]), comp.ids[i : i + 1, :n], comp.mask[i : i + 1, :n], opts)[0]
    return out


@pytest.mark.parametrize(
    "extra, reused",
    [
        ([], True),  # 8 rows, 4 per step: two steps per rollout
        (["rollout.generation_batch_size=4"], False),  # one step per rollout, used once: ratio 1 by construction
        (["rollout.generation_batch_size=4", "algorithm.num_iterations=2"], True),
        (["training.gradient_accumulation_steps=2"], False),  # 8 rows in one step of two micro-batches
        (["training.gradient_accumulation_steps=2", "algorithm.num_iterations=3"], True),
    ],
)
def test_reuses_rollout_predicate(extra, reused, tmp_path):
    data = {"train": "x.jsonl"}
    assert _config("m", data, tmp_path, *extra).reuses_rollout is reused
