"""What a failing reward's error says: which sample, which batch, where in the user's code it raised, and a hint at the
likely cause (missing columns, the wrong completion form)."""

from __future__ import annotations

import functools
import inspect
import os
import re
import traceback
from typing import Any

from vlmrl.rewards.protocol import RewardFn


def describe_batch(when: str | None, sources: list[str] | None) -> str:
    """' at step 3 (rows data.jsonl:1, data.jsonl:2)': where a batch-level reward failure happened."""
    text = f" at {when}" if when else ""
    rows = list(dict.fromkeys(s for s in (sources or []) if s))
    if rows:
        text += f" (rows {', '.join(rows[:8])}{f' and {len(rows) - 8} more' if len(rows) > 8 else ''})"
    return text


def format_hint(error: Exception, completion: Any, fn: RewardFn | None = None, given: dict | None = None) -> str:
    """A pointer to what most likely went wrong, only where the error says so: a completion of the other form
    (algorithm.completion_format), a function that is not called TRL's way (an EasyR1 compute_score, a factory), or a
    column the reward reads from ``**kwargs`` that these rows do not have (VLM-R1's, which vlmrl adds to VLM-R1 rows).
    The first hint that applies, in this order (HINTS)."""
    for hint in HINTS:
        found = hint(error, str(error), completion, fn, given)
        if found:
            return found
    return ""


def _conversational_hint(error, text: str, completion, fn, given) -> str | None:
    if isinstance(completion, str) and isinstance(error, TypeError) and "indices must be integers" in text:
        return (
            "; a reward written for TRL's conversational completions (completion[0]['content'], as VLM-R1's) "
            "needs algorithm.completion_format=conversational"
        )
    return None


def _calling_hint(error, text: str, completion, fn, given) -> str | None:
    if not (isinstance(error, TypeError) and re.search(r"unexpected keyword argument '(prompts|completions)'", text)):
        return None
    easyr1 = "name it file.py:compute_score@easyr1 (EasyR1 calls compute_score(reward_inputs) with a list of dicts)"
    factory = (
        "if this function builds the reward (a factory such as TRL's get_soft_overlong_punishment), call it in the spec "
        "with its arguments: module:factory(arg=value, ...)"
    )
    if getattr(_innermost(fn), "__name__", "") == "compute_score":  # EasyR1's name for its reward: its way first
        return f"; an EasyR1 reward? {easyr1}; {factory}"
    return f"; {factory}; an EasyR1 compute_score(reward_inputs) is named file.py:compute_score@easyr1, an ms-swift ORM class file.py:Name@swift"


def _column_argument_hint(error, text: str, completion, fn, given) -> str | None:
    """An ms-swift ORM's / TRL function's named data columns: say they are columns, and which the rows have."""
    missing_args = MISSING_ARGUMENTS_RE.search(text) if isinstance(error, TypeError) and given is not None else None
    absent = [a for a in re.findall(r"'(\w+)'", missing_args["names"]) if a not in given] if missing_args else []
    if not absent:
        return None
    have = ", ".join(k for k in given if k not in ("prompts", "completions", *REWARD_EXTRAS))
    s = "s" if len(absent) > 1 else ""
    return (
        f"; it takes the data column{s} {', '.join(absent)} as argument{s}, "
        f"which these rows do not have (their columns: {have or 'none'}): add {'them' if len(absent) > 1 else 'it'} to the data file"
    )


def _text_form_hint(error, text: str, completion, fn, given) -> str | None:
    if isinstance(completion, list) and ("'list' object has no attribute" in text or "not 'list'" in text or "got 'list'" in text):
        return "; a reward that expects plain string completions needs algorithm.completion_format=text"
    return None


def _kwargs_column_hint(error, text: str, completion, fn, given) -> str | None:
    if "'NoneType'" not in text or given is None:
        return None
    missing = [c for c in _kwargs_read(fn) if c not in given]
    if not missing:
        return None
    return (
        f"; the reward reads {', '.join(missing)} from **kwargs, which these rows do not have (it gets: "
        f"{', '.join(k for k in given if k not in ('prompts', 'completions'))}); vlmrl adds image_path, "
        "accu_reward_method and image_grid_thw to VLM-R1 conversations rows only: add the column to the data"
    )


HINTS = (_conversational_hint, _calling_hint, _column_argument_hint, _text_form_hint, _kwargs_column_hint)


# Python's "f() missing 2 required positional arguments: 'bbox' and 'image_size'".
MISSING_ARGUMENTS_RE = re.compile(r"missing \d+ required (?:positional|keyword-only) arguments?: (?P<names>.+)$")
# What every reward may get besides the data columns (rewards/peers.py EXTRA_ARGUMENTS).
REWARD_EXTRAS = ("completion_ids", "trainer_state", "log_extra", "log_metric")


def _innermost(fn: Any) -> Any:
    """The user's own function under vlmrl's wrappers (peers.py's __wrapped_reward__, functools.wraps' __wrapped__)."""
    for _ in range(8):
        inner = getattr(fn, "__wrapped_reward__", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            return fn
        fn = inner
    return fn


def _kwargs_read(fn: Any) -> list[str]:
    """Names the reward's source reads as ``kwargs.get("name")`` / ``kwargs["name"]`` (in order, once each)."""
    try:
        source = inspect.getsource(_innermost(fn))
    except (OSError, TypeError):
        return []
    return list(dict.fromkeys(re.findall(r"""kwargs(?:\.get\(|\[)\s*["'](\w+)["']""", source)))


def describe_sample(index: int, when: str | None = None, sources: list[str] | None = None, columns: dict[str, list] | None = None) -> str:
    """'sample 5 at step 3 (row data.jsonl:7, solution '3', images ['/data/a.png'])': what a user needs to find the row."""
    text = f"sample {index}" + (f" at {when}" if when else "")
    row = []
    if sources is not None and index < len(sources) and sources[index]:
        row.append(f"row {sources[index]}")
    for key in ("solution", "image", "images"):
        values = (columns or {}).get(key)
        if values is not None and index < len(values) and not _is_empty(values[index]):
            row.append(f"{key} {short(values[index])}")
    return f"{text} ({', '.join(row)})" if row else text


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0)


def raised_at(fn: RewardFn, error: BaseException) -> str:
    """' (at path/to/rewards.py:12 in my_reward)': the innermost line of the reward function's own file in the error's
    traceback (where the user looks, even when the error came from a library it called); else the innermost line
    outside vlmrl; '' when there is none."""
    ours = os.path.dirname(os.path.abspath(__file__))  # vlmrl's call wrappers and built-ins: the rewards package's modules
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.dirname(os.path.abspath(f.filename)) != ours]
    if not frames:
        return ""
    own_file = _source_file(fn)
    own = [f for f in frames if own_file and os.path.abspath(f.filename) == own_file]
    frame = (own or frames)[-1]
    return f" (at {frame.filename}:{frame.lineno} in {frame.name})"


def _source_file(fn: Any) -> str | None:
    """The file that defines a reward function (plain function, partial, bound method or callable object)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    try:
        path = inspect.getsourcefile(inspect.unwrap(target))
    except (TypeError, ValueError):
        return None
    return os.path.abspath(path) if path else None


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
