"""Reward parsing, built-in rewards, user rewards from files, and the weighted combination."""

import math

import pytest

from vlmrl.rewards.functions import BUILTIN_REWARDS, accuracy, answer_format, box_iou, extract_answer, format_reward, iou, parse_box
from vlmrl.rewards.guard import RewardError
from vlmrl.rewards.combine import compute_rewards, reward_stats
from vlmrl.rewards.loading import load_reward


@pytest.mark.parametrize(
    "text, expected",
    [
        ("no tags here", None),
        ("<answer>3</answer>", "3"),
        ("<answer> 3 \n</answer>", "3"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last one counts
        ("<think>maybe <answer>7</answer>?</think><answer>8</answer>", "8"),
        ("<answer>a\nb</answer>", "a\nb"),
        ("<answer></answer>", ""),
        ("<answer>3", None),  # unclosed
        (None, None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_accuracy_numbers_choices_text():
    completions = [
        "<answer>3</answer>",
        "<answer>3.0</answer>",
        "<answer> 3 </answer>",
        "<answer>three</answer>",
        "3",
        "<answer>4</answer>",
        "<answer>2.50</answer>",
        "<answer>(b)</answer>",
        "<answer>C</answer>",
        "<answer>Paris.</answer>",
        "<answer>1</answer><answer>3</answer>",
    ]
    solution = ["3", "3", "3", "3", "3", "3", "2.5", "B", "b", "paris", "3"]
    assert accuracy(None, completions, solution) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]


def test_accuracy_solution_forms_and_none():
    completions = ["<answer>3</answer>"] * 5
    # VLM-R1 style solution with tags, a number, and unusable solutions (None).
    assert accuracy([], completions, ["<answer> 3 </answer>", 3, "", None, "<answer> </answer>"]) == [1.0, 1.0, None, None, None]


def test_conversational_completions():
    conv = [
        [{"role": "assistant", "content": "<answer>3</answer>"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "<answer>"}, {"type": "text", "text": "4</answer>"}]}],
    ]
    assert accuracy(None, conv, ["3", "3"]) == [1.0, 0.0]
    assert answer_format(None, conv) == [1.0, 1.0]
    with pytest.raises(TypeError, match="completion must be"):
        accuracy(None, [42], ["3"])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>[1, 2, 3, 4]</answer>", [1.0, 2.0, 3.0, 4.0]),
        ("<answer>[ 1.5 ,2,  30.25,40 ]</answer>", [1.5, 2.0, 30.25, 40.0]),
        ("<answer>[1 2 3 4]</answer>", [1.0, 2.0, 3.0, 4.0]),
        ('<answer>{"bbox_2d": [10, 20, 30, 40], "label": "x"}</answer>', [10.0, 20.0, 30.0, 40.0]),
        ("box is [5, 6, 7, 8] I think", [5.0, 6.0, 7.0, 8.0]),  # fallback: no answer tag
        ("[0, 0, 9, 9] <answer>[1, 1, 2, 2]</answer>", [1.0, 1.0, 2.0, 2.0]),  # the answer wins
        ("<answer>[3, 2, 1, 4]</answer>", None),  # x2 < x1
        ("<answer>[1, 2, 1, 4]</answer>", None),  # zero width
        ("<answer>[1, 5, 3, 4]</answer>", None),  # y2 < y1
        ("<answer>[1, 2, 3]</answer>", None),
        ("<answer>[1, 2, 3, 4, 5]</answer>", None),
        ("<answer>[a, b, c, d]</answer>", None),
        ("<answer>none</answer> [1, 2, 3, 4]", None),  # an answer without a box does not fall back
        ("", None),
    ],
)
def test_parse_box(text, expected):
    assert parse_box(text) == expected


def test_box_iou_hand_computed():
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
    assert box_iou([0, 0, 10, 10], [10, 0, 20, 10]) == 0.0  # touching edges
    # overlap 5x10 = 50; union 100 + 100 - 50 = 150
    assert box_iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(1 / 3)
    # overlap 2x2 = 4; union 16 + 4 - 4 = 16
    assert box_iou([0, 0, 4, 4], [1, 1, 3, 3]) == 0.25


def test_iou_reward():
    completions = ["<answer>[0, 0, 10, 10]</answer>", "<answer>[5, 0, 15, 10]</answer>", "no box", "<answer>[0,0,10,10]</answer>"]
    out = iou(None, completions, ["[0, 0, 10, 10]", "<answer>[0, 0, 10, 10]</answer>", "[0, 0, 10, 10]", "garbage"])
    assert out[0] == 1.0 and out[1] == pytest.approx(1 / 3) and out[2] == 0.0 and out[3] is None


def test_format_rewards():
    texts = [
        "<think>x</think><answer>3</answer>",
        "  <think>a\nb</think>\n<answer>3</answer>\n",
        "<answer>3</answer>",
        "<think>x</think><answer>3</answer> trailing",
        "<think>x</think>",
        "<answer>1</answer><answer>2</answer>",
        "<think>x</think><answer></answer>",  # empty answers earn nothing (a reward hack otherwise)
        "<answer> \n</answer>",
    ]
    assert format_reward(None, texts) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert answer_format(None, texts) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_load_reward_builtin_and_file(tmp_path, monkeypatch):
    assert load_reward("accuracy") is BUILTIN_REWARDS["accuracy"]
    f = tmp_path / "my_rewards.py"
    f.write_text("LIMIT = 3\n\ndef short(prompts, completions, **kw):\n    return [float(len(c) <= LIMIT) for c in completions]\n")
    fn = load_reward(f"{f}:short")
    assert fn(["p", "p"], ["ab", "abcd"]) == [1.0, 0.0]
    monkeypatch.chdir(tmp_path)
    assert load_reward("my_rewards.py:short")(["p"], ["a"]) == [1.0]  # relative to the current directory
    with pytest.raises(RewardError, match="file not found"):
        load_reward(str(tmp_path / "nope.py") + ":short")
    with pytest.raises(RewardError, match="has no 'long'.*short"):
        load_reward(f"{f}:long")
    with pytest.raises(RewardError, match="LIMIT is a int, not a function"):
        load_reward(f"{f}:LIMIT")
    with pytest.raises(RewardError, match="unknown reward 'acc'"):
        load_reward("acc")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no such lib')\n")
    with pytest.raises(RewardError, match="importing .*broken.py failed: ImportError: no such lib"):
        load_reward(f"{broken}:f")


def test_compute_rewards_weights_and_none():
    def half(prompts, completions, **kw):
        return [0.5, None, None]

    def maybe(prompts, completions, solution, **kw):
        return [1.0 if s else None for s in solution]

    total, per = compute_rewards(
        {"half": half, "maybe": maybe}, {"half": 2.0, "maybe": 3.0}, ["a", "b", "c"], ["x", "y", "z"], {"solution": ["s", "s", ""]}
    )
    assert per == {"half": [0.5, None, None], "maybe": [1.0, 1.0, None]}
    assert total == [4.0, 3.0, 0.0]  # None counts 0; sample 2 has no reward at all -> 0
    stats = reward_stats(per)
    assert stats == {
        "rewards/half/mean": 0.5,
        "rewards/half/std": 0.0,
        "rewards/half/none_frac": 2 / 3,
        "rewards/maybe/mean": 1.0,
        "rewards/maybe/std": 0.0,
        "rewards/maybe/none_frac": 1 / 3,
        "rewards/all_none_frac": 1 / 3,
    }


def test_compute_rewards_passes_columns_and_accepts_nan_and_numpy_like():
    seen = {}

    def spy(prompts, completions, solution, extra, **kw):
        seen.update(prompts=prompts, completions=completions, solution=solution, extra=extra)
        return [float("nan"), 1]

    total, per = compute_rewards({"spy": spy}, {"spy": 1.0}, ["p0", "p1"], ["c0", "c1"], {"solution": ["1", "2"], "extra": [7, 8]})
    assert seen == {"prompts": ["p0", "p1"], "completions": ["c0", "c1"], "solution": ["1", "2"], "extra": [7, 8]}
    assert per == {"spy": [None, 1.0]} and total == [0.0, 1.0]
    assert reward_stats(per)["rewards/spy/none_frac"] == 0.5


def test_raising_reward_names_reward_and_sample():
    def picky(prompts, completions, **kw):
        return [float(int(c)) for c in completions]

    with pytest.raises(RewardError) as err:
        compute_rewards({"picky": picky}, {"picky": 1.0}, ["p0", "p1", "p2"], ["1", "oops", "2"], {})
    msg = str(err.value)
    assert "reward 'picky' raised on sample 1" in msg and "'p1'" in msg and "'oops'" in msg
    assert "ValueError: invalid literal for int()" in msg
    assert isinstance(err.value.__cause__, ValueError)


def test_bad_return_values():
    with pytest.raises(RewardError, match="reward 'short' returned 1 values for 2 completions"):
        compute_rewards({"short": lambda prompts, completions, **kw: [1.0]}, {"short": 1.0}, ["a", "b"], ["x", "y"], {})
    with pytest.raises(RewardError, match=r"reward 'text' returned 'yes' \(str\) for sample 0"):
        compute_rewards({"text": lambda prompts, completions, **kw: ["yes"]}, {"text": 1.0}, ["a"], ["x"], {})
    with pytest.raises(RewardError, match="reward 'scalar' returned a float"):
        compute_rewards({"scalar": lambda prompts, completions, **kw: 1.0}, {"scalar": 1.0}, ["a"], ["x"], {})
    with pytest.raises(RewardError, match="must be finite"):
        compute_rewards({"inf": lambda prompts, completions, **kw: [math.inf]}, {"inf": 1.0}, ["a"], ["x"], {})


def test_builtins_through_compute_rewards():
    comps = ["<answer>3</answer>", "<answer>4</answer><answer>3</answer>"]
    total, per = compute_rewards(
        {"accuracy": accuracy, "answer_format": answer_format}, {"accuracy": 1.0, "answer_format": 0.5}, ["q", "q"], comps, {"solution": ["3", "3"]}
    )
    assert per == {"accuracy": [1.0, 1.0], "answer_format": [1.0, 0.0]}
    assert total == [1.5, 1.0]


def test_a_number_written_as_text_is_not_read_as_mathematics():
    """math-verify reads "4 apples" as 4; a numeric or choice solution keeps its plain rules unless the answer is
    written as mathematics (the demo's count task scored such answers 0 before math-verify and must still)."""
    from vlmrl.rewards.functions import answers_match

    assert not answers_match("4 apples", "4") and not answers_match("4 7", "4") and not answers_match("B or C", "B")
    assert answers_match("$4$", "4") and answers_match("4.0", "4")
    pytest.importorskip("math_verify", reason="math-verify (the `math` extra) not installed")
    assert answers_match("\\frac{8}{2}", "4") and answers_match("1/2", "0.5")
