"""Reward functions written the TRL way and the VLM-R1 way run unchanged (rewards.py, runtime.score_rollout)."""

import asyncio
import re
import threading
import time

import pytest
import torch

from vlmrl.config import load_config
from vlmrl.rewards.guard import RewardError
from vlmrl.rewards.protocol import TrainerState, reward_inputs
from vlmrl.rewards.functions import accuracy
from vlmrl.rewards.combine import compute_rewards
from vlmrl.rewards.loading import load_reward
from vlmrl.models.rollout import Completions
from vlmrl.rewards.scoring import score_rollout


# -- rewards as a VLM-R1 user writes them: conversational completions, solutions with <answer> tags ------------------
def vlmr1_style_accuracy(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, sol in zip(contents, solution):
        truth = re.search(r"<answer>(.*?)</answer>", sol)
        truth = truth.group(1).strip() if truth else sol.strip()
        got = re.search(r"<answer>(.*?)</answer>", content)
        rewards.append(1.0 if got and got.group(1).strip() == truth else 0.0)
    return rewards


def vlmr1_style_format(completions, **kwargs):
    pattern = r"<think>.*?</think>\s*<answer>.*?</answer>"
    return [1.0 if re.fullmatch(pattern, c[0]["content"], re.DOTALL) else 0.0 for c in completions]


# -- rewards as a TRL user writes them: completion_ids, trainer_state, **kwargs -----------------------------------
def trl_style_length_penalty(completions, completion_ids, **kwargs):
    return [-len(ids) / 10 for ids in completion_ids]


def trl_style_schedule(completions, trainer_state, **kwargs):
    weight = trainer_state.global_step / trainer_state.max_steps
    return [weight] * len(completions)


def plain_string_reward(prompts, completions, solution):  # no **kwargs: must not get completion_ids / trainer_state
    return [float(c.endswith(s)) for c, s in zip(completions, solution)]


ROWS = [
    {"problem": "How many?", "solution": "<answer>3</answer>", "images": ["/a.png"], "_source": "x:1"},
    {"problem": "Which?", "solution": "B", "images": [], "_source": "x:2"},
]
TEXTS = ["<think>hm</think><answer>3</answer>", "<answer>4</answer>", "<answer>B</answer>", "B"]


def test_vlmr1_rewards_run_on_conversational_completions():
    prompts, completions = reward_inputs(ROWS, TEXTS, 2, "conversational", system_prompt="Be brief.")
    assert completions[0] == [{"role": "assistant", "content": TEXTS[0]}]
    # prompts are the chat the model saw: system, then the user turn with the image placeholder first.
    assert prompts[0] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
    ]
    assert prompts[2][-1]["content"] == [{"type": "text", "text": "Which?"}]
    funcs = {"acc": vlmr1_style_accuracy, "fmt": vlmr1_style_format, "builtin": accuracy}
    columns = {"solution": [r["solution"] for r in ROWS for _ in range(2)]}
    total, per = compute_rewards(funcs, {"acc": 1.0, "fmt": 0.5, "builtin": 1.0}, prompts, completions, columns)
    assert per["acc"] == [1.0, 0.0, 1.0, 0.0]
    assert per["fmt"] == [1.0, 0.0, 0.0, 0.0]
    assert per["builtin"] == per["acc"]  # the built-in reward reads both forms
    assert total == [2.5, 0.0, 2.0, 0.0]


def test_text_mode_error_points_to_completion_format():
    prompts, completions = reward_inputs(ROWS, TEXTS, 2, "text")
    assert completions == TEXTS and prompts == ["How many?"] * 2 + ["Which?"] * 2
    with pytest.raises(RewardError, match=r"raised on sample 0 .*algorithm.completion_format=conversational"):
        compute_rewards({"acc": vlmr1_style_accuracy}, {"acc": 1.0}, prompts, completions, {"solution": ["3"] * 4})


def test_trl_keyword_arguments_are_passed_only_where_taken():
    ids = [[5, 6, 2], [7, 2], [8], [9, 9, 9, 2]]
    state = TrainerState(global_step=3, max_steps=12, epoch=0.5)
    funcs = {"len": trl_style_length_penalty, "sched": trl_style_schedule, "plain": plain_string_reward}
    total, per = compute_rewards(
        funcs, dict.fromkeys(funcs, 1.0), ["p"] * 4, TEXTS, {"solution": ["3", "3", "B", "B"]}, completion_ids=ids, trainer_state=state
    )
    assert per["len"] == [-0.3, -0.2, -0.1, -0.4]
    assert per["sched"] == [0.25] * 4
    assert per["plain"] == [0.0, 0.0, 0.0, 1.0]
    assert total == pytest.approx([-0.05, 0.05, 0.15, 0.85])


def test_failing_trl_reward_is_located_with_its_sliced_ids():
    def picky(completions, completion_ids, **kwargs):
        if any(len(ids) > 3 for ids in completion_ids):
            raise ValueError("too long")
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"'picky' raised on sample 2\b.*too long"):
        compute_rewards(
            {"picky": picky}, {"picky": 1.0}, ["p"] * 3, ["a", "b", "c"], {}, completion_ids=[[1], [1, 2], [1, 2, 3, 4]], trainer_state=TrainerState()
        )


def test_async_rewards_are_awaited_concurrently():
    async def slow_judge(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [float(len(c)) for c in completions]

    async def slow_judge_2(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    t0 = time.perf_counter()
    total, per = compute_rewards(
        {"a": slow_judge, "b": slow_judge_2, "sync": plain_string_reward},
        {"a": 1.0, "b": 2.0, "sync": 1.0},
        ["p", "p"],
        ["xy", "3"],
        {"solution": ["3", "3"]},
    )
    elapsed = time.perf_counter() - t0
    assert per == {"a": [2.0, 1.0], "b": [1.0, 1.0], "sync": [0.0, 1.0]}
    assert total == [4.0, 4.0]
    assert elapsed < 0.55, f"two 0.3 s async rewards took {elapsed:.2f} s: not concurrent"


def test_async_reward_inside_a_running_event_loop_and_its_failure():
    async def bad(completions, **kwargs):
        await asyncio.sleep(0)
        if "boom" in completions:
            raise KeyError("judge down")
        return [1.0] * len(completions)

    async def caller():  # a notebook: an event loop is already running in this thread
        return compute_rewards({"bad": bad}, {"bad": 1.0}, ["p", "p"], ["ok", "fine"], {})

    assert asyncio.run(caller())[0] == [1.0, 1.0]
    with pytest.raises(RewardError, match=r"'bad' raised on sample 1\b.*judge down"):
        compute_rewards({"bad": bad}, {"bad": 1.0}, ["p", "p"], ["ok", "boom"], {})
    assert threading.active_count() < 10  # helper threads are joined


def test_reserved_column_names_are_refused():
    with pytest.raises(ValueError, match="completion_ids.*rename the column"):
        compute_rewards({"acc": accuracy}, {"acc": 1.0}, ["p"], ["c"], {"completion_ids": [1]})


def test_score_rollout_passes_what_trl_passes():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, solution, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, state=trainer_state, solution=solution, extra=kwargs)
        return [0.0] * len(completions)

    cfg = load_config(
        None,
        [
            "model.defaults=pretrained",  # the field defaults (G=4), not the embedded model's
            "algorithm.completion_format=conversational",
            "training.max_steps=40",
            "training.per_device_train_batch_size=4",
            "rollout.num_generations=2",
        ],
    )
    rows = [{**ROWS[0], "difficulty": 2}, {**ROWS[1], "difficulty": 5}]
    ids = torch.tensor([[5, 2, 0], [6, 7, 8], [2, 0, 0], [9, 2, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    comp = Completions(ids=ids, mask=mask, truncated=torch.tensor([False, True, False, False]))
    score_rollout(cfg, {"spy": spy}, {"spy": 1.0}, rows, 2, TEXTS, comp, step=6, num_rows=8)
    assert seen["ids"] == [[5, 2], [6, 7, 8], [2], [9, 2]]  # up to and including EOS, no padding
    assert seen["state"] == TrainerState(global_step=6, max_steps=40, epoch=1.5)  # 6 steps x 2 prompts / 8 rows
    assert seen["completions"][1] == [{"role": "assistant", "content": TEXTS[1]}]
    assert seen["prompts"][3][-1]["content"][-1]["text"] == "Which?"
    hooks = {k: seen["extra"].pop(k) for k in ("log_extra", "log_metric")}  # TRL's logging hooks, as TRL passes them
    assert all(callable(h) for h in hooks.values())
    assert seen["extra"] == {"problem": ["How many?"] * 2 + ["Which?"] * 2, "images": [["/a.png"]] * 2 + [[]] * 2, "difficulty": [2, 2, 5, 5]}


def test_reward_spec_typos_get_did_you_mean(tmp_path):
    with pytest.raises(RewardError, match="did you mean 'accuracy'"):
        load_reward("acuracy")
    f = tmp_path / "my_rewards.py"
    f.write_text("def count_reward(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(RewardError, match=r"did you mean .*:count_reward\?"):
        load_reward(f"{f}:count_rewad")
    with pytest.raises(RewardError, match=r"did you mean .*my_rewards.py\?"):
        load_reward(f"{tmp_path / 'my_reward.py'}:count_reward")


def test_builtin_rewards_give_the_same_values_in_both_forms():
    from vlmrl.rewards.functions import BUILTIN_REWARDS

    rows = [{"problem": "Where?", "solution": "[1, 2, 5, 6]"}, {"problem": "How many?", "solution": "3"}]
    texts = ["<think>x</think><answer>[1, 2, 5, 7]</answer>", "<answer>[0,0,1,1]</answer>", "<answer>3</answer>", "3"]
    columns = {"solution": [r["solution"] for r in rows for _ in range(2)]}
    weights = dict.fromkeys(BUILTIN_REWARDS, 1.0)
    results = [compute_rewards(BUILTIN_REWARDS, weights, *reward_inputs(rows, texts, 2, form), columns) for form in ("text", "conversational")]
    assert results[0] == results[1]
    assert results[0][1]["format"] == [1.0, 0.0, 0.0, 0.0] and results[0][1]["accuracy"][2:] == [1.0, 0.0]
