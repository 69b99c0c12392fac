"""Calling every reward on a batch and combining them: values checked (a number or None, float32-finite), a failing
sample located, the weighted total, per-reward statistics."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Any, Callable

from vlmrl.rewards.args import accepted_arguments as _accepted
from vlmrl.rewards.diagnostics import format_hint, one_line, short, describe_batch, describe_sample, raised_at
from vlmrl.rewards.guard import RewardError, RewardStopped, exit_error, reward_guard
from vlmrl.rewards.protocol import RESERVED_ARGUMENTS, RewardFn, RewardLog, TrainerState, call_once, run_coroutines


# Rewards become float32 tensors: a larger value (1e39 is a finite Python float) turns into inf, then NaN weights.
FLOAT32_MAX = 3.4028234663852886e38


def compute_rewards(
    funcs: dict[str, RewardFn],
    weights: dict[str, float],
    prompts: list,
    completions: list,
    columns: dict[str, list],
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: TrainerState | None = None,
    when: str | None = None,
    sources: list[str] | None = None,
    reward_log: RewardLog | None = None,
    timeout_s: float = 0.0,
) -> tuple[list[float], dict[str, list[float | None]]]:
    """Weighted total reward per completion, and each reward's raw values.

    Each function is called once on the whole batch, with ``completion_ids`` and ``trainer_state`` when
    given, and TRL's ``log_extra`` / ``log_metric`` (recorded in ``reward_log``; a throwaway one when None), to
    the functions that take them; async functions are awaited, all of them concurrently.
    total[i] = sum of weight * value over the rewards whose value for sample i is not None (None counts as
    0, like TRL's nansum); when every reward is None for a sample its total is 0 (`reward_stats` reports
    how often as ``rewards/all_none_frac``). NaN returns are treated as None. A function that raises is
    re-run sample by sample to name the sample that fails; it, a wrong return length, a non-numeric value and
    a value (or weighted total) outside float32's finite range raise RewardError naming the reward and the
    sample. ``when`` (e.g. "step 3") and ``sources`` (the dataset ``file:line`` of each completion's row) make
    those messages say where: the step, the row (with its solution and image paths from ``columns``) and, for
    a raise, the file:line inside the reward function. ``timeout_s`` (algorithm.reward_timeout_s) bounds each
    reward's call; it and SIGTERM / SIGINT during a reward raise RewardStopped (reward_guard); a reward's
    sys.exit() is a RewardError of that reward.
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    if completion_ids is not None and len(completion_ids) != n:
        raise ValueError(f"{len(completion_ids)} completion_ids for {n} completions")
    for key, values in columns.items():
        if key in RESERVED_ARGUMENTS:
            raise ValueError(f"dataset column {key!r} clashes with the reward function argument of that name; rename the column")
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    missing = [name for name in funcs if name not in weights]
    if missing:
        raise ValueError(f"no weight for reward(s) {', '.join(missing)}")
    extras = {k: v for k, v in (("completion_ids", completion_ids), ("trainer_state", trainer_state)) if v is not None}
    reward_log = reward_log if reward_log is not None else RewardLog()
    extras.update(log_extra=reward_log.log_extra, log_metric=reward_log.log_metric)

    def arguments(fn: RewardFn, index: int | None = None) -> dict:
        """The keyword arguments of one call: the whole batch, or sample `index` alone."""
        pick = (lambda values: values) if index is None else (lambda values: [values[index]])
        kwargs = {"prompts": pick(prompts), "completions": pick(completions), **{k: pick(v) for k, v in columns.items()}}
        for key in _accepted(fn, tuple(extras)):
            kwargs[key] = pick(extras[key]) if key == "completion_ids" else extras[key]
        return kwargs

    where = functools.partial(describe_sample, when=when, sources=sources, columns=columns)
    raw = _call_all(funcs, arguments, n, where, timeout_s, describe_batch(when, sources))
    per_reward = {name: _check_values(name, raw[name], n, where) for name in funcs}

    total = []
    for i in range(n):
        values = [(weights[name], per_reward[name][i]) for name in funcs]
        total.append(float(sum(w * v for w, v in values if v is not None)))
        if not abs(total[-1]) <= FLOAT32_MAX:
            parts = ", ".join(f"{name}={per_reward[name][i]} x {weights[name]}" for name in funcs)
            raise RewardError(
                f"the weighted total reward {total[-1]} of {where(i)} is outside float32's range ({parts}); "
                "lower algorithm.reward_weights or the rewards' scale"
            )
    return total, per_reward


def _call_all(
    funcs: dict[str, RewardFn], arguments: Callable[..., dict], n: int, where: Callable[[int], str], timeout_s: float = 0.0, batch: str = ""
) -> dict[str, Any]:
    """Each reward's raw return: sync ones in order, then every async one at once (they may wait on I/O, e.g.
    a judge model behind an API). A failure raises RewardError naming the reward and the sample; a timeout or a
    stop signal while a reward runs raises RewardStopped (reward_guard); a reward's sys.exit() is its error."""
    raw: dict[str, Any] = {}
    pending: dict[str, Any] = {}  # name -> coroutine of an async reward

    def close_pending() -> None:
        for coro in pending.values():  # never started: close them so Python does not warn they were not awaited
            coro.close()

    for name, fn in funcs.items():
        try:
            with reward_guard(name, timeout_s, batch):
                result = fn(**arguments(fn))
        except RewardStopped:
            close_pending()
            raise
        except SystemExit as e:
            close_pending()
            raise exit_error(name, e, fn, batch) from None
        except Exception as e:
            close_pending()
            raise _locate_failure(name, fn, arguments, n, e, where, batch, timeout_s) from e
        if inspect.isawaitable(result):
            pending[name] = result
        else:
            raw[name] = result
    if not pending:
        return raw
    names = ", ".join(pending)
    try:
        with reward_guard(names, timeout_s, batch):
            results = run_coroutines(list(pending.values()))
    except SystemExit as e:  # asyncio lets SystemExit out of the loop: one of the async rewards called it
        raise exit_error(names, e, next(iter(funcs.values())), batch) from None
    for name, result in zip(pending, results):
        if isinstance(result, RewardStopped):
            raise result
        if isinstance(result, Exception):
            raise _locate_failure(name, funcs[name], arguments, n, result, where, batch, timeout_s) from result
        if isinstance(result, BaseException):  # KeyboardInterrupt: not the reward's fault
            raise result
        raw[name] = result
    return raw


def _check_values(name: str, raw: Any, n: int, where: Callable[[int], str] | None = None) -> list[float | None]:
    try:
        count = len(raw)
    except TypeError:
        raise RewardError(f"reward {name!r} returned a {type(raw).__name__}, expected a list of floats or None") from None
    if isinstance(raw, (str, bytes, dict)) or count != n:
        raise RewardError(f"reward {name!r} returned {count} values for {n} completions")
    return [_check_value(name, i, v, where) for i, v in enumerate(raw)]


def _check_value(name: str, index: int, value: Any, where: Callable[[int], str] | None = None) -> float | None:
    """A reward value as float or None; numbers of any numeric type (bool, numpy, 0-d tensors) are accepted.
    NaN is None (TRL's meaning); inf and values beyond float32's range are errors."""
    if value is None:
        return None
    sample = where(index) if where is not None else f"sample {index}"
    if hasattr(value, "item") and not isinstance(value, numbers.Number):  # numpy scalar / 0-d tensor
        try:
            value = value.item()
        except Exception:
            pass
    if not isinstance(value, numbers.Real):
        raise RewardError(f"reward {name!r} returned {value!r} ({type(value).__name__}) for {sample}; expected a float or None")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        value = math.inf if value > 0 else -math.inf
    if math.isnan(value):
        return None
    if not abs(value) <= FLOAT32_MAX:
        raise RewardError(
            f"reward {name!r} returned {value} for {sample}; rewards must be finite and within float32's range "
            f"(|r| <= {FLOAT32_MAX:.4g}), because they are trained on as float32"
        )
    return value


def _locate_failure(
    name: str,
    fn: RewardFn,
    arguments: Callable[..., dict],
    n: int,
    error: Exception,
    where: Callable[[int], str] | None = None,
    batch: str = "",
    timeout_s: float = 0.0,
) -> RewardError:
    """Re-run a failing reward one sample at a time to say which sample makes it raise, and where in its code.
    When none does alone, the message names the step and the batch's rows (`batch`)."""
    where = where or (lambda i: f"sample {i}")
    for i in range(n):
        kwargs = arguments(fn, i)
        try:
            with reward_guard(name, timeout_s, f"{batch}, sample {i}" if batch else f" on sample {i}"):
                call_once(fn, kwargs)
        except RewardStopped:
            raise
        except SystemExit as e:
            return exit_error(name, e, fn, f" on {where(i)}")
        except Exception as e:
            return RewardError(
                f"reward {name!r} raised on {where(i)}, prompt {short(kwargs['prompts'][0])}, completion "
                f"{short(kwargs['completions'][0])}: {type(e).__name__}: {one_line(e)}{raised_at(fn, e)}"
                f"{format_hint(e, kwargs['completions'][0], fn, kwargs)}"
            )
    return RewardError(
        f"reward {name!r} raised on the batch of {n}{batch} but on no single sample alone (it depends on several rows "
        f"together): {type(error).__name__}: {one_line(error)}{raised_at(fn, error)}"
    )


def reward_stats(per_reward: dict[str, list[float | None]]) -> dict[str, float]:
    """Logging statistics: ``rewards/<name>/mean`` and ``/std`` over non-None values (left out when a reward
    has none), ``rewards/<name>/none_frac``, and ``rewards/all_none_frac`` (samples where every reward was
    None, so their total is 0)."""
    stats: dict[str, float] = {}
    n = 0
    for name, values in per_reward.items():
        n = len(values)
        valid = [v for v in values if v is not None]
        if valid:
            mean = sum(valid) / len(valid)
            stats[f"rewards/{name}/mean"] = mean
            stats[f"rewards/{name}/std"] = math.sqrt(sum((v - mean) ** 2 for v in valid) / (len(valid) - 1)) if len(valid) > 1 else 0.0
        stats[f"rewards/{name}/none_frac"] = (len(values) - len(valid)) / len(values) if values else 0.0
    if per_reward and n:
        all_none = sum(all(values[i] is None for values in per_reward.values()) for i in range(n))
        stats["rewards/all_none_frac"] = all_none / n
    return stats
