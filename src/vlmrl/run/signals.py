"""Runs that learn nothing, said out loud: a warning when no group has any reward variance for several steps.

GRPO's advantage is a reward minus its group's mean, so a step where every group's G completions earn the same
reward (``frac_reward_zero_std == 1``) has zero advantages and a zero policy gradient: the step changes nothing
(only KL, if beta > 0, moves the weights). A few such steps happen; many in a row mean the run is not learning.
"""

from __future__ import annotations

from vlmrl.config import Config

STREAK_KEY = "no_signal_streak"
METRIC = "no_signal_steps"


def update_no_signal_streak(streak: int, metrics: dict) -> int:
    """Consecutive steps without any reward variance, counting the step whose metrics are given."""
    return streak + 1 if metrics.get("frac_reward_zero_std") == 1 else 0


def no_signal_message(streak: int, metrics: dict, cfg: Config) -> str:
    """The warning for a streak of `streak` steps, naming the likely cause from the step's metrics and the settings."""
    reward = metrics.get("reward")
    r, o = cfg.rollout, cfg.optim
    if reward is not None and reward <= 0:
        cause = (
            "no completion earns any reward: check the model writes what the rewards look for "
            f"({', '.join(cfg.algorithm.reward_funcs)}; samples.jsonl shows completions), or SFT it on the format first"
        )
    else:
        cause = f"every completion of a prompt earns the same reward ({reward:.3g}): the task may be too easy or the reward too coarse"
    truncated = metrics.get("completions/truncated_frac")
    if truncated is not None and truncated >= 0.5:
        cause += f"; {truncated:.0%} of completions hit rollout.max_completion_length={r.max_completion_length} (raise it)"
    return (
        f"WARNING: no learning signal for {streak} steps: every group's rewards are equal (frac_reward_zero_std = 1), so "
        f"advantages and the policy gradient are zero. Likely: {cause}. Settings to check: optim.learning_rate={o.learning_rate:g} "
        f"(small or untrained models need larger rates; the demo's GRPO uses 3e-4 after SFT), rollout.temperature={r.temperature:g} "
        f"(low temperatures make a group's samples alike), rollout.num_generations={r.num_generations} (more samples per "
        "prompt find more reward differences). (logging.no_signal_warn_steps sets when this warns.)"
    )


def warn_if_no_learning_signal(metrics: dict, cfg: Config, state: dict, warn) -> None:
    """Call once per step with the step's metrics: counts the streak in ``state`` (the loop's state dict), adds
    ``no_signal_steps`` to `metrics` (logged with the step), and warns when the streak reaches
    logging.no_signal_warn_steps and every 10 x that many steps after (0 disables the warning)."""
    every = cfg.logging.no_signal_warn_steps
    streak = update_no_signal_streak(state.get(STREAK_KEY, 0), metrics)
    state[STREAK_KEY] = streak
    metrics[METRIC] = streak
    if every and streak and (streak == every or streak % (10 * every) == 0):
        warn(no_signal_message(streak, metrics, cfg))
