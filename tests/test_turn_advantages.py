"""Turn-level advantages (algorithm.turn_advantage=per_turn, issue 39 part 5): discounted per-turn returns, normalised
over all turns of the GRPO group pooled, each sampled token given its turn's advantage. Hand-computed examples and a
naive Python loop."""

import math
import random

import numpy as np
import pytest
import torch

from vlmrl.algo.advantages import ADV_EPS
from vlmrl.algo.turn_advantages import (
    discounted_returns,
    numeric_reward,
    token_advantages,
    turn_advantages,
    turn_index,
    turn_reward_matrix,
)

pytestmark = pytest.mark.unit


def hand_example():
    # Group of G=2. Row 0: three turns, the environment gave 0.5 and 0.25 after the first two, the rollout's reward is
    # 1.0 (on its last turn). Row 1: one turn (an answer), reward 0.
    return turn_reward_matrix([[0.5, 0.25, 0.0], [0.0]], torch.tensor([1.0, 0.0]))


def test_reward_matrix_puts_the_rollout_reward_on_the_last_turn():
    rewards, mask = hand_example()
    assert rewards.tolist() == [[0.5, 0.25, 1.0], [0.0, 0.0, 0.0]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_discounted_returns_by_hand():
    rewards, mask = hand_example()
    # gamma 0.5: G_2 = 1.0, G_1 = 0.25 + 0.5 * 1.0 = 0.75, G_0 = 0.5 + 0.5 * 0.75 = 0.875
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[0.875, 0.75, 1.0], [0.0, 0.0, 0.0]]
    assert discounted_returns(rewards, mask, 1.0).tolist() == [[1.75, 1.25, 1.0], [0.0, 0.0, 0.0]]


def test_turn_advantages_by_hand_pooled_over_the_group():
    rewards, mask = hand_example()
    # The group's four turns have returns 0.875, 0.75, 1.0 and 0.0: mean 0.65625, deviations 0.21875, 0.09375, 0.34375,
    # -0.65625, squares summing to 0.60546875, unbiased variance 0.60546875 / 3.
    std = math.sqrt(0.60546875 / 3)
    expected = [[0.21875 / (std + ADV_EPS), 0.09375 / (std + ADV_EPS), 0.34375 / (std + ADV_EPS)], [-0.65625 / (std + ADV_EPS), 0.0, 0.0]]
    got = turn_advantages(rewards, mask, 2, 0.5, "group")
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6), got
    assert torch.allclose(turn_advantages(rewards, mask, 2, 0.5, "none"), torch.tensor([[0.21875, 0.09375, 0.34375], [-0.65625, 0, 0]]))


def test_turn_index_and_token_advantages_by_hand():
    # Row 0: turn 0 (2 tokens), a tool turn (2 tokens), turn 1 (1 token), a tool turn, turn 2 (2 tokens).
    # Row 1: one turn of 3 tokens, then padding.
    loss_mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0]])
    index = turn_index(loss_mask)
    assert index.tolist() == [[0, 0, -1, -1, 1, -1, 2, 2], [0, 0, 0, -1, -1, -1, -1, -1]]
    rewards, mask = hand_example()
    adv = turn_advantages(rewards, mask, 2, 0.5)
    tokens = token_advantages(adv, mask, index)
    a = adv.tolist()
    assert tokens.tolist() == [[a[0][0], a[0][0], 0, 0, a[0][1], 0, a[0][2], a[0][2]], [a[1][0]] * 3 + [0] * 5]
    assert len({a[0][0], a[0][1], a[0][2]}) == 3, "the turns of one rollout get different advantages"


def naive(step_rewards, final, G, gamma, scale):
    """The estimator as a plain loop over Python floats."""
    returns = []
    for steps, r in zip(step_rewards, final):
        rs = list(steps) or [0.0]
        rs[-1] += r
        out, running = [0.0] * len(rs), 0.0
        for t in reversed(range(len(rs))):
            running = rs[t] + gamma * running
            out[t] = running
        returns.append(out)
    everything = [g for row in returns for g in row]
    batch_std = float(np.std(everything, ddof=1)) if len(everything) > 1 else 0.0
    adv = []
    for start in range(0, len(returns), G):
        pooled = [g for row in returns[start : start + G] for g in row]
        mean = sum(pooled) / len(pooled)
        std = float(np.std(pooled, ddof=1)) if len(pooled) > 1 else 0.0
        div = {"group": std + ADV_EPS, "batch": batch_std + ADV_EPS, "none": 1.0}[scale]
        adv += [[(g - mean) / div for g in row] for row in returns[start : start + G]]
    return adv


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_turn_advantages_equal_a_naive_loop(scale, gamma):
    rng = random.Random(f"{scale}{gamma}")
    G = 3
    steps = [[rng.choice([0.0, 0.1, -0.2, 1.0]) for _ in range(rng.randint(1, 4))] for _ in range(4 * G)]
    for s in steps:
        s[-1] = 0.0  # the engine records 0.0 for the step that ended the rollout
    final = [rng.choice([0.0, 1.0, 0.5]) for _ in steps]
    rewards, mask = turn_reward_matrix(steps, torch.tensor(final))
    got = turn_advantages(rewards, mask, G, gamma, scale)
    want = naive(steps, final, G, gamma, scale)
    for i, row in enumerate(want):
        assert got[i, : len(row)].tolist() == pytest.approx(row, abs=1e-5), (i, got[i], row)
        assert (got[i, len(row) :] == 0).all()


def test_a_group_of_equal_returns_gives_zeros_not_nan():
    rewards, mask = turn_reward_matrix([[0.0], [0.0]], torch.tensor([1.0, 1.0]))
    assert turn_advantages(rewards, mask, 2, 0.9).tolist() == [[0.0], [0.0]]


@pytest.mark.parametrize(
    "value,expected",
    [(1, (1.0, True)), (0.25, (0.25, True)), (np.float32(2.0), (2.0, True)), (torch.tensor(0.5), (0.5, True)), (True, (1.0, True))]
    + [("1.0", (0.0, False)), (None, (0.0, False)), (float("nan"), (0.0, False)), (float("inf"), (0.0, False))]
    + [(object(), (0.0, False)), ([1.0], (0.0, False)), (torch.tensor([1.0, 2.0]), (0.0, False)), (10**400, (0.0, False))],
)
def test_a_step_reward_that_is_not_a_finite_number_counts_as_zero(value, expected):
    assert numeric_reward(value) == expected


def test_a_reward_whose_float_raises_counts_as_zero():
    class Hostile:
        def __float__(self):
            raise KeyError("no")

    assert numeric_reward(Hostile()) == (0.0, False)


def test_the_setting_is_validated_naming_the_field():
    from vlmrl.config import ConfigError, load_config

    tools = ["tools.tools=[zoom]", "rollout.engine=continuous", "rollout.max_completion_length=8"]
    assert load_config(None, []).algorithm.turn_advantage == "trajectory"  # the default: today's behaviour
    cfg = load_config(None, [*tools, "algorithm.turn_advantage=per_turn", "algorithm.turn_discount=0.9"])
    assert cfg.algorithm.turn_advantage == "per_turn" and cfg.algorithm.turn_discount == 0.9
    with pytest.raises(ConfigError, match=r"algorithm\.turn_advantage=per_turn .* needs tools\.tools"):
        load_config(None, ["algorithm.turn_advantage=per_turn"])  # a single-turn run has one turn
    with pytest.raises(ConfigError, match=r"advantage_estimator is reinforce_pp"):
        load_config(None, [*tools, "algorithm.turn_advantage=per_turn", "algorithm.advantage_estimator=reinforce_pp"])
    with pytest.raises(ConfigError, match=r"per_turn with algorithm\.policy_loss=gspo"):
        load_config(None, [*tools, "algorithm.turn_advantage=per_turn", "algorithm.policy_loss=gspo"])
    with pytest.raises(ConfigError, match=r"algorithm\.turn_discount=1\.5 must be in \[0, 1\]"):
        load_config(None, [*tools, "algorithm.turn_advantage=per_turn", "algorithm.turn_discount=1.5"])
    with pytest.raises(ConfigError, match=r"turn_advantage"):
        load_config(None, [*tools, "algorithm.turn_advantage=per_token"])


def test_the_plain_loop_records_each_turns_step_reward(monkeypatch):
    """models/tool_loop.run_tool_loop (the evaluation loop) records the rewards as the engine does: a step reward per
    turn that went on, 0.0 for the last, text counted as 0.0 and named."""
    import vlmrl.models.tool_loop as tool_loop
    from vlmrl.tools.environment import ToolEnvironment
    from vlmrl.tools.registry import load_tools

    class Rewarding(ToolEnvironment):
        def step(self, action_text):
            observation, reward, done = super().step(action_text)
            return observation, (reward if done else ("oops" if len(self._steps) == 2 else 0.25 * len(self._steps))), done

    zoom = '<tool_call>{"name": "zoom", "arguments": {"bbox_2d": [0, 0, 8, 8]}}</tool_call>'
    texts = iter([[zoom], [zoom], ["the answer is 2"]])
    monkeypatch.setattr(tool_loop, "_turn", lambda model, processor, conversations, settings, tools=None: next(texts))
    from PIL import Image

    env = Rewarding(load_tools(["zoom"]), max_turns=4)
    (trajectory,) = tool_loop.run_tool_loop(None, None, [env], [{"problem": "how many?", "images": [Image.new("RGB", (16, 16))]}])
    assert trajectory.num_turns == 3 and trajectory.turn_rewards == [0.25, 0.0, 0.0] and trajectory.bad_turn_rewards == ["'oops'"]
