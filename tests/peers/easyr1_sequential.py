"""An EasyR1 reward of the per-sample kind (REWARD_TYPE = "sequential"): compute_score(reward_input) -> float."""

REWARD_TYPE = "sequential"


def compute_score(reward_input, bonus=0.0):
    return float(str(reward_input["ground_truth"]) in reward_input["response"]) + bonus
