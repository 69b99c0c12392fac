"""TRL's own reward functions (``trl.rewards``) named in algorithm.reward_funcs and run inside `vlmrl train`
unchanged. Skipped when TRL is not installed (`pip install trl`); accuracy_reward also needs math_verify."""

import importlib.util
import json

import pytest

from vlmrl.config import load_config

trl_rewards = pytest.importorskip("trl.rewards", reason="TRL is not installed (pip install trl)")

MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
THINK = "trl.rewards:think_format_reward"
# Lengths in (2, 100] get (2 - length) / 98: linear in the length, so the mean reward follows the mean length.
OVERLONG = "trl.rewards:get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=98)"
REPETITION = "trl.rewards:get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)"


def test_trl_rewards_read_vlmrl_conversational_inputs():
    from vlmrl.rewards.combine import compute_rewards
    from vlmrl.rewards.loading import load_reward
    from vlmrl.rewards.protocol import reward_inputs

    rows = [{"problem": "How many?", "solution": "3", "images": ["/a.png"]}]
    prompts, completions = reward_inputs(rows, ["<think>two and one</think><answer>3</answer>", "<answer>3</answer>"], 2, "conversational")
    funcs = {"think": load_reward(THINK), "overlong": load_reward(OVERLONG), "rep": load_reward(REPETITION)}
    _, per = compute_rewards(
        funcs, dict.fromkeys(funcs, 1.0), prompts, completions, {"solution": ["3", "3"]}, completion_ids=[[1, 2, 1, 2, 5], [7, 8, 9]]
    )
    assert per["think"] == [1.0, 0.0]
    assert per["overlong"] == pytest.approx([(2 - 5) / 98, (2 - 3) / 98])
    assert per["rep"] == pytest.approx([-0.25, 0.0])  # ngrams (1,2) (2,1) (1,2) (2,5): 1 - 3/4 repeated


def _train(tiny_model, tmp_path, rewards):
    from vlmrl.data.tasks import make_count_task
    from vlmrl.train import train

    data = make_count_task(tmp_path / "d", n_train=4, n_test=2, seed=0, image_size=56)
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_model}",
            f"data.train_path={data['train']}",
            f"training.output_dir={out}",
            "training.max_steps=2",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=4",
            "rollout.generation_batch_size=4",
            "rollout.min_completion_length=3",
            "rollout.max_completion_length=5",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            "algorithm.completion_format=conversational",  # TRL's rewards read completion[0]["content"]
            f"algorithm.reward_funcs={json.dumps(rewards)}",
        ],
    )
    train(cfg, log=lambda *_: None)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trl_rewards_inside_vlmrl_train(tiny_qwen25vl, tmp_path):
    rows = _train(tiny_qwen25vl, tmp_path, [THINK, OVERLONG, REPETITION])
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rewards/think_format_reward/mean"] == 0.0  # a random tiny model never writes <think>
        assert row["rewards/get_soft_overlong_punishment/mean"] == pytest.approx((2 - row["completions/mean_length"]) / 98)
        assert -1.0 <= row["rewards/get_repetition_penalty_reward/mean"] <= 0.0
        assert row["reward"] == pytest.approx(row["rewards/get_soft_overlong_punishment/mean"] + row["rewards/get_repetition_penalty_reward/mean"])


@pytest.mark.skipif(not MATH_VERIFY, reason="trl.rewards.accuracy_reward needs math_verify (pip install math-verify)")
def test_trl_accuracy_reward_inside_vlmrl_train(tiny_qwen25vl, tmp_path):
    rows = _train(tiny_qwen25vl, tmp_path, ["trl.rewards:accuracy_reward", THINK])
    assert all(0.0 <= r["rewards/accuracy_reward/mean"] <= 1.0 for r in rows if "rewards/accuracy_reward/mean" in r)


@pytest.mark.skipif(MATH_VERIFY, reason="math_verify is installed: accuracy_reward runs (the test above)")
def test_trl_accuracy_reward_without_math_verify_fails_in_the_check(tiny_qwen25vl, tmp_path):
    """The check before training calls every reward on real rows: the missing package is one line before the model loads."""
    from vlmrl.run.preflight import check_rewards_on_rows
    from vlmrl.rewards.guard import RewardError
    from vlmrl.rewards.loading import load_reward

    cfg = load_config(None, ["algorithm.completion_format=conversational"])
    with pytest.raises(RewardError, match=r"'acc' raised on sample 0 .*ImportError: Please install the `math_verify` package"):
        check_rewards_on_rows(cfg, {"acc": load_reward("trl.rewards:accuracy_reward")}, {"acc": 1.0}, [{"problem": "2+1?", "solution": "3"}])


def test_vlmrl_overlong_shaping_equals_trls_soft_overlong_punishment():
    """algorithm.overlong_shaping's term (rewards.functions.overlong_penalty) against TRL's own function, every length
    from 0 to past L_max."""
    from vlmrl.rewards.functions import soft_overlong_punishment

    ids = [[1] * n for n in range(0, 23)]
    theirs = trl_rewards.get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=6)(completion_ids=ids)
    ours = soft_overlong_punishment(max_completion_len=20, soft_punish_cache=6)(["p"] * len(ids), ["c"] * len(ids), completion_ids=ids)
    assert ours == pytest.approx(theirs)
