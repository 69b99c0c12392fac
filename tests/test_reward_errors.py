"""Reward errors say where (step, row, the line in the user's reward code); rewards outside float32's range are refused."""

import json
import math

import pytest

from vlmrl.cli import main
from vlmrl.rewards.combine import FLOAT32_MAX, compute_rewards
from vlmrl.rewards.guard import RewardError
from vlmrl.rewards.loading import load_reward

USER_REWARDS = """import json


def picky(prompts, completions, solution, **kwargs):
    out = []
    for c, s in zip(completions, solution):
        if s == "7":
            out.append(json.loads(c))  # line 8: the JSON library raises, the user's line is this one
        else:
            out.append(1.0)
    return out


def huge(prompts, completions, **kwargs):
    return [1e39 if i == 1 else 0.5 for i in range(len(completions))]
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_raise_names_step_row_solution_image_and_the_users_line(reward_file):
    fn = load_reward(f"{reward_file}:picky")
    columns = {"solution": ["3", "7"], "images": [["/data/a.png"], ["/data/b.png"]]}
    with pytest.raises(RewardError) as e:
        compute_rewards(
            {"picky": fn}, {"picky": 1.0}, ["p0", "p1"], ["c0", "{bad"], columns, when="step 4", sources=["data/train.jsonl:2", "data/train.jsonl:9"]
        )
    msg = str(e.value)
    assert msg.startswith("reward 'picky' raised on sample 1 at step 4 (row data/train.jsonl:9, solution '7', images ['/data/b.png'])")
    assert "JSONDecodeError" in msg and msg.endswith(f"(at {reward_file}:8 in picky)")
    assert "\n" not in msg


def test_callable_objects_are_located():
    class Scorer:
        def __call__(self, prompts, completions, **kwargs):
            raise KeyError("missing")  # this file and line are reported

    with pytest.raises(RewardError) as e:
        compute_rewards({"s": Scorer()}, {"s": 1.0}, ["p"], ["c"], {})
    line = Scorer.__call__.__code__.co_firstlineno + 1
    assert str(e.value) == f"reward 's' raised on sample 0, prompt 'p', completion 'c': KeyError: 'missing' (at {__file__}:{line} in __call__)"


@pytest.mark.parametrize("value", [1e39, -1e39, math.inf, -math.inf, 10**400])
def test_values_beyond_float32_are_refused_with_name_and_sample(value):
    rewards = {"big": lambda prompts, completions, **kw: [0.0, value]}
    with pytest.raises(
        RewardError,
        match=r"reward 'big' returned [-]?(inf|1e\+39) for sample 1 at step 2 \(row d.jsonl:5\); "
        r"rewards must be finite and within float32's range",
    ):
        compute_rewards(rewards, {"big": 1.0}, ["a", "b"], ["x", "y"], {}, when="step 2", sources=["d.jsonl:4", "d.jsonl:5"])


def test_float32_edge_and_nan_and_weighted_overflow():
    edge = {"edge": lambda prompts, completions, **kw: [FLOAT32_MAX, float("nan")]}
    total, per = compute_rewards(edge, {"edge": 1.0}, ["a", "b"], ["x", "y"], {})
    assert per["edge"] == [FLOAT32_MAX, None] and total == [FLOAT32_MAX, 0.0]  # NaN keeps TRL's meaning: not applicable
    with pytest.raises(RewardError, match=r"weighted total reward 3.40\d*e\+39 of sample 0 \(row r:1\) is outside float32's range \(edge="):
        compute_rewards(edge, {"edge": 10.0}, ["a", "b"], ["x", "y"], {}, sources=["r:1", "r:2"])


def test_training_reports_the_step_row_and_line(tiny_qwen25vl, reward_file, tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "a.png")
    rows = [{"image": "a.png", "problem": "How many?", "solution": s} for s in ("3", "7")]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        f"model.name_or_path={tiny_qwen25vl}",
        f"training.output_dir={tmp_path / 'out'}",
        f"data.train_path={data}",
        "data.shuffle=false",
        f"algorithm.reward_funcs=[{reward_file}:picky]",
        "training.max_steps=1",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=4",
        "rollout.max_completion_length=3",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
    ]
    # The check before training calls the reward on the rows (their solutions as completions) and finds it first.
    assert main(["train", *args]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert line.startswith(
        f"vlmrl train: reward 'picky' raised on sample 1 at the check before training (the row's solution as the "
        f"completion) (row {data}:2, solution '7', images ['{tmp_path / 'a.png'}'])"
    )
    assert line.endswith(f"(at {reward_file}:8 in picky)")
    # Inside the loop (no check before it) the step is named.
    from vlmrl.config import load_config
    from vlmrl.rewards.guard import RewardError
    from vlmrl.train import train

    with pytest.raises(RewardError) as raised:
        train(load_config(None, args))
    message = str(raised.value)
    assert message.startswith(f"reward 'picky' raised on sample 2 at step 1 (row {data}:2, solution '7', images ['{tmp_path / 'a.png'}'])")
    assert message.endswith(f"(at {reward_file}:8 in picky)")


def test_a_1e39_reward_stops_training_instead_of_poisoning_the_weights(tiny_qwen25vl, reward_file, tmp_path, capsys):
    out = tmp_path / "out"
    args = [
        f"model.name_or_path={tiny_qwen25vl}",
        f"training.output_dir={out}",
        f"algorithm.reward_funcs=[{reward_file}:huge]",
        "data.task_train_size=4",
        "data.task_test_size=0",
        "training.max_steps=1",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=2",
        "rollout.max_completion_length=3",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
    ]
    assert main(["train", *args]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    # Found by the check before training, before any weights load.
    assert line.startswith("vlmrl train: reward 'huge' returned 1e+39 for sample 1 at the check before training") and "float32" in line
    assert not (out / "final").exists()
    # Inside the loop (no check before it): refused at step 1, nothing trained on it.
    from vlmrl.config import load_config
    from vlmrl.rewards.guard import RewardError
    from vlmrl.train import train

    with pytest.raises(RewardError, match=r"returned 1e\+39 for sample 1 at step 1 \(row .*float32"):
        train(load_config(None, args))
    assert not (out / "final").exists()
