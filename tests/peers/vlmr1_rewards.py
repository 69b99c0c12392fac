"""Rewards written the VLM-R1 way (grpo_jsonl.py's conventions): conversational completions read as
completion[0]["content"], the answer-tagged `solution`, the `accu_reward_method` and `image_path` columns its loader
adds. Written for vlmrl's tests from VLM-R1's documented call; not VLM-R1's code."""

import os
import re


def _inside_answer(text):
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return found[-1].strip() if found else text.strip()


def accuracy_reward(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    methods = kwargs.get("accu_reward_method")
    paths = kwargs.get("image_path")
    rewards = []
    for content, sol, method, path in zip(contents, solution, methods, paths):
        assert method == "default" and os.path.isfile(path[0])
        rewards.append(1.0 if _inside_answer(content) == _inside_answer(sol) else 0.0)
    return rewards


def format_reward(completions, **kwargs):
    pattern = r"<think>.*?</think>\s*<answer>.*?</answer>"
    return [1.0 if re.fullmatch(pattern, c[0]["content"], re.DOTALL) else 0.0 for c in completions]


def grid_reward(completions, solution, **kwargs):
    """Reads the per-sample `image_grid_thw` and `image_path` as VLM-R1's REC IoU reward does (input size = grid x 14)."""
    from PIL import Image

    rewards = []
    for i, _ in enumerate(completions):
        grid = kwargs.get("image_grid_thw")[i]
        with Image.open(kwargs.get("image_path")[i][0]) as image:
            width = image.size[0]
        rewards.append(1.0 if int(grid[2] * 14) > 0 and width > 0 else 0.0)
    return rewards
