"""Reward files written for VLM-R1, EasyR1 and ms-swift, loaded unchanged and called their trainer's way (rewards/peers.py)."""

import sys
from pathlib import Path

import pytest

from vlmrl.rewards.peers import describe_call, detect_kind
from vlmrl.rewards.guard import RewardError
from vlmrl.rewards.protocol import RewardLog, TrainerState
from vlmrl.rewards.functions import accuracy
from vlmrl.rewards.combine import compute_rewards
from vlmrl.rewards.loading import load_reward

pytestmark = pytest.mark.unit
PEERS = Path(__file__).parent / "peers"
ROWS = {"solution": ["<answer>3</answer>", "<answer>2</answer>"], "answer": ["3", "2"]}
TEXTS = ["<think>a</think><answer>3</answer>", "<answer>5</answer>"]


def call(fn, texts=TEXTS, columns=None, completions=None):
    log = RewardLog()
    total, per = compute_rewards(
        {"r": fn},
        {"r": 1.0},
        ["q"] * len(texts),
        completions or list(texts),
        dict(columns or ROWS),
        completion_ids=[[1, 2, 3]] * len(texts),
        trainer_state=TrainerState(global_step=1, max_steps=2),
        reward_log=log,
    )
    return per["r"], log


def test_easyr1_batch_compute_score_dict_scores():
    fn = load_reward(f"{PEERS / 'easyr1_math.py'}:compute_score")
    values, log = call(fn)
    assert values == pytest.approx([1.0, 0.1])  # 0.9 * accuracy + 0.1 * format
    assert log.metrics() == {"compute_score/format": 1.0, "compute_score/accuracy": 0.5}


def test_easyr1_keyword_arguments_are_bound_not_called():
    fn = load_reward(f"{PEERS / 'easyr1_math.py'}:compute_score(format_weight=0.5)")
    assert call(fn)[0] == pytest.approx([1.0, 0.5])


def test_easyr1_sequential_per_sample_float():
    fn = load_reward(f"{PEERS / 'easyr1_sequential.py'}:compute_score(bonus=0.25)")
    assert call(fn)[0] == pytest.approx([1.25, 0.25])  # ground_truth = the `answer` column


def test_swift_registered_name_and_class_are_instantiated_once():
    by_name = load_reward(f"{PEERS / 'swift_plugin.py'}:external_count_acc")
    cls = sys.modules[[k for k in sys.modules if k.startswith("vlmrl_user_reward_swift_plugin")][0]].CountAccuracy
    before = cls.instances
    assert call(by_name)[0] == [1.0, 0.0]
    assert call(by_name)[0] == [1.0, 0.0]
    assert cls.instances == before  # created at load, not per call
    by_class = load_reward(f"{PEERS / 'swift_plugin.py'}:CountAccuracy")
    assert cls.instances == before + 1
    conversational = [[{"role": "assistant", "content": t}] for t in TEXTS]
    assert call(by_class, completions=conversational)[0] == [1.0, 0.0]  # ms-swift hands strings


def test_swift_unknown_name_lists_registered_ones():
    with pytest.raises(RewardError, match="names registered in orms: external_count_acc"):
        load_reward(f"{PEERS / 'swift_plugin.py'}:external_count")


def test_vlm_r1_reward_gets_conversational_completions_when_named():
    fn = load_reward(f"{PEERS / 'vlmr1_rewards.py'}:format_reward@vlm-r1")
    assert call(fn)[0] == [1.0, 0.0]  # text completions handed over as completion[0]["content"]
    plain = load_reward(f"{PEERS / 'vlmr1_rewards.py'}:format_reward")
    with pytest.raises(RewardError, match="completion_format=conversational"):
        call(plain)


def test_kind_is_detected_and_can_be_forced():
    import importlib.util

    spec = importlib.util.spec_from_file_location("easy", PEERS / "easyr1_math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert detect_kind(module.compute_score, module) == "easyr1"
    assert detect_kind(accuracy) == "trl"
    forced = load_reward(f"{PEERS / 'easyr1_math.py'}:compute_score@trl")
    with pytest.raises(RewardError, match="unexpected keyword argument"):
        call(forced)


def test_check_lines_say_what_each_reward_receives():
    columns = ["solution", "answer"]
    easy = describe_call("compute_score", load_reward(f"{PEERS / 'easyr1_math.py'}:compute_score"), columns, "text")
    assert "EasyR1 compute_score" in easy and "ground_truth=answer" in easy and "list of dicts" in easy
    swift = describe_call("external_count_acc", load_reward(f"{PEERS / 'swift_plugin.py'}:external_count_acc"), columns, "text")
    assert "ms-swift ORM" in swift and "solution, answer" in swift
    trl = describe_call("think_length", load_reward(f"{PEERS / 'trl_rewards.py'}:think_length"), columns, "conversational")
    assert trl == (
        "reward think_length (TRL signature): gets prompts, completions (conversational), solution, answer, "
        "completion_ids, trainer_state, log_extra, log_metric"
    )
    assert "not VLM-R1's accuracy_reward" in describe_call("accuracy", accuracy, columns, "text", builtin=True)


def test_builtin_accuracy_compares_math():
    """TRL's math datasets give LaTeX solutions: `$4$` and `<answer>4</answer>` are the same answer."""
    assert accuracy([""] * 3, ["<answer>4</answer>", "<answer>\\boxed{4}</answer>", "<answer>5</answer>"], ["$4$", "4", "$4$"]) == [1.0, 1.0, 0.0]
    pytest.importorskip("math_verify")
    assert accuracy([""], ["<answer>0.5</answer>"], ["$\\frac{1}{2}$"]) == [1.0]


def test_latex_wrappers_match_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # the optional extra not installed: import fails
    assert accuracy([""] * 2, ["<answer>4</answer>", "<answer>4</answer>"], ["$4$", "$\\boxed{5}$"]) == [1.0, 0.0]


def test_module_reward_type_does_not_turn_trl_functions_into_easyr1(tmp_path):
    """Issue 35 (small): a file with EasyR1's module-level REWARD_TYPE and a TRL-style function beside compute_score
    turned both into EasyR1 rewards, so the TRL one failed when called. TRL's parameter names decide."""
    path = tmp_path / "mixed_rewards.py"
    path.write_text(
        'REWARD_TYPE = "batch"\n\n\n'
        "def compute_score(reward_inputs):\n"
        '    return [{"overall": float(x["response"] == x["ground_truth"])} for x in reward_inputs]\n\n\n'
        "def length_bonus(completions, **kwargs):\n"
        "    return [len(c) / 10 for c in completions]\n\n\n"
        "def first_is_prompts(prompts, completions_text):\n"
        "    return [0.0 for _ in prompts]\n\n\n"
        "def helper(batch):\n"
        "    return [0.5 for _ in batch]\n"
    )
    trl_fn = load_reward(f"{path}:length_bonus")
    assert trl_fn.__reward_kind__ == "trl"
    assert load_reward(f"{path}:first_is_prompts").__reward_kind__ == "trl"
    assert load_reward(f"{path}:compute_score").__reward_kind__ == "easyr1"
    assert load_reward(f"{path}:helper").__reward_kind__ == "easyr1"  # neither TRL name: the module's flag holds
    assert trl_fn(prompts=["p", "p"], completions=["abc", "abcdefghij"]) == [0.3, 1.0]
