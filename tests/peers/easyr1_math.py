"""A reward file written the EasyR1 way (examples/reward_function conventions): module metadata REWARD_TYPE, and
compute_score(reward_inputs, ...) over dicts with response / response_length / ground_truth, returning a dict of
scores whose 'overall' is the reward. Written for vlmrl's tests; not EasyR1's code."""

import re

REWARD_NAME = "count"
REWARD_TYPE = "batch"


def _answer(response):
    found = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    return found[-1].strip() if found else ""


def compute_score(reward_inputs, format_weight=0.1):
    scores = []
    for item in reward_inputs:
        assert isinstance(item["response_length"], int)
        accuracy = 1.0 if _answer(item["response"]) == str(item["ground_truth"]).strip() else 0.0
        form = 1.0 if "<answer>" in item["response"] else 0.0
        scores.append({"overall": (1 - format_weight) * accuracy + format_weight * form, "format": form, "accuracy": accuracy})
    return scores
