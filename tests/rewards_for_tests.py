"""User-style reward functions (TRL signature) that give a random tiny model a learning signal."""


def text_length(prompts, completions, **columns):
    """Characters in the completion / 10: varies between samples, so advantages are not all zero."""
    return [len(c) / 10 for c in completions]


def overflowing(prompts, completions, **columns):
    """Finite in float32 (3e38 < 3.4e38) but a group's sum overflows: the advantages become NaN."""
    return [3e38 if i % 4 < 2 else 0.0 for i in range(len(completions))]


def fails_on_three(prompts, completions, **columns):
    """Raises on a batch of exactly three completions (evaluation with training.eval_batch_size=3), works in training."""
    if len(completions) == 3:
        raise ValueError("this reward cannot score a batch of three")
    return [len(c) / 10 for c in completions]


def length_penalty(scale):
    """A factory, as TRL's get_* rewards: the spec `rewards_for_tests.py:length_penalty(scale=0.5)` calls it once."""

    def reward(completion_ids, **kwargs):
        return [-scale * len(ids) for ids in completion_ids]

    return reward


def logs_like_trl(completions, log_extra=None, log_metric=None, **kwargs):
    """Uses TRL's logging hooks as TRL's own accuracy_reward does: a column per completion and a scalar."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    log_extra("chars", [len(t) for t in texts])
    log_metric("custom/mean_chars", sum(len(t) for t in texts) / len(texts))
    return [len(t) / 10 for t in texts]


def constant_zero(prompts, completions, **columns):
    """No learning signal: every advantage is 0, so only auxiliary losses move the weights."""
    return [0.0 for _ in completions]


def length_on_odd_counts(prompts, completions, solution, **columns):
    """Characters / 10 where the row's count (the digits of its solution) is odd, 0 elsewhere: every group of an even
    count has equal rewards, which dynamic sampling drops."""
    counts = ["".join(ch for ch in str(s) if ch.isdigit()) or "0" for s in solution]
    return [len(c) / 10 if int(n) % 2 else 0.0 for c, n in zip(completions, counts)]
