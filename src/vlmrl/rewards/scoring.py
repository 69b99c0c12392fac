"""Rewards of a rollout: dataset columns and completions handed to the reward functions as TRL hands them."""

from __future__ import annotations

from vlmrl.config import Config, ConfigError
import functools

from vlmrl.rewards.loading import FACTORY_SPEC_RE, load_reward
from vlmrl.rewards.protocol import TrainerState, reward_inputs
from vlmrl.rewards.combine import compute_rewards
from vlmrl.rewards.diagnostics import describe_sample
from vlmrl.rewards.functions import soft_overlong_punishment
from vlmrl.rewards.judge import JudgeReward, build_judge
from vlmrl.rewards.peers import split_kind


def reward_columns(rows: list[dict], repeats: int) -> dict[str, list]:
    """Dataset columns for reward functions, each row repeated once per completion (TRL's convention)."""
    keys = [k for k in rows[0] if not k.startswith("_")]
    return {k: [r.get(k) for r in rows for _ in range(repeats)] for k in keys}


def row_sources(rows: list[dict], repeats: int) -> list[str]:
    """Each completion's dataset row as ``file:line`` (the rows' ``_source``), aligned with `reward_columns`, for messages."""
    return [str(r.get("_source", "")) for r in rows for _ in range(repeats)]


def score_rollout(
    cfg: Config,
    funcs: dict,
    weights: dict,
    rows: list[dict],
    repeats: int,
    texts: list[str],
    comp=None,
    step: int = 0,
    num_rows: int | None = None,
    when: str | None = None,
    reward_log=None,
    trajectories: list | None = None,
) -> tuple[list[float], dict]:
    """Rewards of `texts` (``repeats`` completions per row, in order), called the way TRL calls them: prompts and
    completions in algorithm.completion_format, the dataset columns, ``completion_ids`` (each completion's ids up
    to and including its EOS, from ``comp``) and ``trainer_state`` (step, max_steps, fractional epoch over
    ``num_rows`` training rows), and TRL's ``log_extra`` / ``log_metric`` into ``reward_log`` (rewards.RewardLog).
    Returns `compute_rewards`' (total, per_reward).

    trajectories (multi-turn rollouts, tools.Trajectory per completion): prompts and completions are theirs, in TRL's
    conversational shape (assistant turns with tool_calls, tool messages with their images), and the Trajectory
    objects come as the ``trajectory`` column."""

    prompts, completions = reward_inputs(rows, texts, repeats, cfg.algorithm.completion_format, cfg.data.system_prompt, cfg.data.limit_images)
    columns = reward_columns(rows, repeats)
    if trajectories is not None:
        prompts, completions = [t.prompt for t in trajectories], [t.completion for t in trajectories]
        columns = {**columns, "trajectory": list(trajectories)}
    completion_ids = None
    if comp is not None:
        completion_ids = [ids[:n].tolist() for ids, n in zip(comp.ids, comp.lengths.tolist())]
    epoch = step * cfg.prompts_per_step / num_rows if num_rows else 0.0
    name_rows(funcs, when, row_sources(rows, repeats), columns)
    state = TrainerState(global_step=step, max_steps=cfg.training.max_steps, epoch=epoch)
    return compute_rewards(
        funcs,
        weights,
        prompts,
        completions,
        columns,
        completion_ids=completion_ids,
        trainer_state=state,
        when=when,
        sources=row_sources(rows, repeats),
        reward_log=reward_log,
        timeout_s=cfg.algorithm.reward_timeout_s,
    )


def name_rows(funcs: dict, when: str | None, sources: list[str], columns: dict[str, list]) -> None:
    """Tell the judge (rewards/judge.py) where each completion of the coming batch comes from, for its log lines: the
    step (`when`) and the row (``file:line``, solution, images), as reward errors name them."""
    for fn in funcs.values():
        if isinstance(fn, JudgeReward):
            fn.where = functools.partial(describe_sample, when=when, sources=sources, columns=columns)


def load_reward_funcs(cfg: Config, local_judge=None) -> tuple[dict, dict]:
    """({name: reward}, {name: weight}) of algorithm.reward_funcs, plus DAPO's `overlong` term when configured.
    local_judge: the in-process judge's backend for judge.model_path (models.judge.local_judge_on(device))."""
    names = cfg.algorithm.reward_funcs
    weights = cfg.algorithm.reward_weights or [1.0] * len(names)
    # "file.py:name", "module:factory(max_len=8)" and "file.py:name@easyr1" are logged as name / factory.
    bare = [split_kind(n)[0] for n in names]
    short = [m["name"] if (m := FACTORY_SPEC_RE.fullmatch(n)) else n.rsplit(":", 1)[-1] for n in bare]
    # A file reward is logged under its function's name unless two rewards share it.
    keys = [k if short.count(k) == 1 else n for k, n in zip(short, names)]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"algorithm.reward_funcs lists the same reward twice: {names}")
    # EasyR1's answer_key is the column data.columns.solution names (convert maps data.answer_key there), else "answer".
    answer_key = cfg.data.columns.get("solution") or None
    # `judge` is the generative reward of the judge section (rewards/judge.py), built from the config
    funcs = {k: build_judge(cfg, local_judge) if n == "judge" else load_reward(n, answer_key) for k, n in zip(keys, names)}
    weights = dict(zip(keys, weights))
    a = cfg.algorithm
    if a.overlong_shaping:  # DAPO's soft overlong punishment, weighted by its penalty factor
        if "overlong" in funcs:
            raise ConfigError("algorithm.overlong_shaping adds the reward term 'overlong', and algorithm.reward_funcs names one too: rename yours")
        funcs["overlong"] = soft_overlong_punishment(cfg.rollout.max_completion_length, a.overlong_buffer_len)
        weights["overlong"] = a.overlong_penalty_factor
    metric = a.dynamic_sampling_metric
    if a.dynamic_sampling and metric != "reward" and metric not in funcs:
        raise ConfigError(
            f"algorithm.dynamic_sampling_metric={metric!r} is neither 'reward' (the weighted total) nor one of the rewards: {', '.join(funcs)}"
        )
    return funcs, weights
