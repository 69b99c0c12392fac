"""Reward specs that call a factory (``module:get_x(arg=value)``, how TRL ships its length and repetition rewards),
and TRL's logging hooks ``log_extra`` / ``log_metric`` reaching samples.jsonl and metrics.jsonl."""

import json
import pathlib

import pytest

from vlmrl.config import load_config
from vlmrl.rewards.guard import RewardError
from vlmrl.rewards.protocol import RewardLog
from vlmrl.rewards.combine import compute_rewards
from vlmrl.rewards.loading import load_reward
from vlmrl.rewards.scoring import load_reward_funcs

HERE = pathlib.Path(__file__).parent
TEST_REWARDS = str(HERE / "rewards_for_tests.py")


def test_factory_spec_calls_the_factory_once_with_literal_arguments():
    fn = load_reward(f"{TEST_REWARDS}:length_penalty(scale=0.5)")
    assert fn(completion_ids=[[1, 2], [3]]) == [-1.0, -0.5]
    assert load_reward(f"{TEST_REWARDS}:length_penalty(2)")(completion_ids=[[1]]) == [-2.0]  # positional too
    cfg = load_config(None, [f"algorithm.reward_funcs=['{TEST_REWARDS}:length_penalty(scale=0.5)', accuracy]"])
    funcs, weights = load_reward_funcs(cfg)
    assert list(funcs) == ["length_penalty", "accuracy"]  # logged under the factory's name, not its arguments


@pytest.mark.parametrize(
    "args, message",
    [
        ("scale=__import__('os').getcwd()", "must be Python literals"),  # no code through a config file
        ("scale=0.5", None),
        ("**{'scale': 1}", "must be Python literals"),
        ("scale=", "must be Python literals"),
        ("nope=1", "calling the factory failed: TypeError"),
    ],
)
def test_factory_arguments_are_literals_only(args, message):
    spec = f"{TEST_REWARDS}:length_penalty({args})"
    if message is None:
        assert callable(load_reward(spec))
        return
    with pytest.raises(RewardError, match=message):
        load_reward(spec)


def test_factory_named_without_arguments_gets_a_hint():
    fn = load_reward(f"{TEST_REWARDS}:length_penalty")  # the factory itself, not the reward it builds
    with pytest.raises(RewardError, match=r"call it in the spec with its arguments: module:factory\(arg=value"):
        compute_rewards({"lp": fn}, {"lp": 1.0}, ["p"], ["c"], {})


def test_log_extra_and_log_metric_are_collected():
    fn = load_reward(f"{TEST_REWARDS}:logs_like_trl")
    log = RewardLog()
    total, _ = compute_rewards({"l": fn}, {"l": 1.0}, ["p", "p"], ["ab", "abcd"], {}, reward_log=log)
    assert total == [0.2, 0.4]
    assert log.metrics() == {"custom/mean_chars": 3.0}
    assert [log.sample_columns(i, 2) for i in range(2)] == [{"chars": 2}, {"chars": 4}]
    assert log.sample_columns(0, 3) == {}  # a column of another length is not attached to the wrong samples
    # Without a RewardLog the hooks are still there (TRL always passes them), their values dropped.
    assert compute_rewards({"l": fn}, {"l": 1.0}, ["p"], ["abc"], {})[0] == [pytest.approx(0.3)]


def test_grpo_run_logs_what_rewards_log(tiny_qwen25vl, tmp_path):
    from vlmrl.data.tasks import make_count_task
    from vlmrl.train import train

    data = make_count_task(tmp_path / "d", n_train=4, n_test=2, seed=0, image_size=56)
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_qwen25vl}",
            f"data.train_path={data['train']}",
            f"training.output_dir={out}",
            "training.max_steps=1",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=4",
            "rollout.generation_batch_size=4",
            "rollout.max_completion_length=4",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "logging.log_completions=4",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            f"algorithm.reward_funcs=['{TEST_REWARDS}:logs_like_trl', '{TEST_REWARDS}:length_penalty(scale=0.25)']",
        ],
    )
    train(cfg, log=lambda *_: None)
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert metrics["custom/mean_chars"] == pytest.approx(sum(len(s["completion"]) for s in samples) / len(samples))
    assert [s["chars"] for s in samples] == [len(s["completion"]) for s in samples]
    # completion_ids reached the factory's reward: -0.25 x tokens, so its mean follows the mean length.
    assert metrics["rewards/length_penalty/mean"] == pytest.approx(-0.25 * metrics["completions/mean_length"])


def test_factory_spec_cut_at_a_comma_says_to_quote_it():
    cfg = load_config(None, [f"algorithm.reward_funcs=[{TEST_REWARDS}:length_penalty(scale=1, extra=2)]"])  # YAML cuts it in two
    assert cfg.algorithm.reward_funcs[0].endswith("length_penalty(scale=1")
    with pytest.raises(RewardError, match=r"unbalanced parentheses; an unquoted list item is cut at each comma, so quote"):
        load_reward_funcs(cfg)
