"""Reward functions with TRL's signature, a loader for user rewards, and the weighted combination.

Every reward function is called as ``fn(prompts=[...], completions=[...], **columns)`` where ``columns``
are the dataset columns as lists aligned with the completions (e.g. ``solution=[...]``), and returns
one ``float`` or ``None`` per completion. That is TRL's ``GRPOTrainer`` convention, so reward functions
written for TRL or VLM-R1 plug in unchanged, and ours work there too. As in TRL:

- ``completion_ids`` (token ids of each completion, no padding) and ``trainer_state`` (``global_step``,
  ``max_steps``, ``epoch``) are passed too, to functions that take them by name or take ``**kwargs``
  (a function without ``**kwargs`` that does not name them is not handed arguments it cannot take).
- Completions are plain strings (``algorithm.completion_format=text``, the default) or TRL's
  conversational form ``[{"role": "assistant", "content": text}]`` with prompts as chat messages
  (``conversational``: how TRL hands VLM rewards their inputs; VLM-R1 rewards read
  ``completion[0]["content"]``). The built-in rewards accept both.
- ``async def`` reward functions are awaited, all of a batch's async rewards concurrently.

``None`` means "this reward does not apply to this sample" (e.g. an accuracy reward on a row without
a solution). As in TRL (which turns ``None`` into NaN and sums with ``nansum``), a ``None`` contributes
0 to the weighted total and is left out of that reward's statistics.

Only the standard library is imported here, so user reward files load fast and anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import math
import numbers
import re
import signal
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vlmrl.rewards.args import accepted_arguments as _accepted, completion_text  # noqa: F401 - re-exported
from vlmrl.rewards.forks import leave_if_forked

RewardFn = Callable[..., list]
# Rewards become float32 tensors: a larger value (1e39 is a finite Python float) turns into inf, then NaN weights.
FLOAT32_MAX = 3.4028234663852886e38

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# The answer must hold something: an empty <answer></answer> earning the format reward is a known
# reward hack (the demo's tiny model found it: format reward with no attempt at the task).
THINK_ANSWER_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>\s*\S.*?</answer>\s*$", re.DOTALL)
NONEMPTY_ANSWER_RE = re.compile(r"<answer>\s*\S.*?</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$")
CHOICE_RE = re.compile(r"^\(?([A-Za-z])\)?[.:]?$")
_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
# Exactly four numbers inside one pair of brackets, separated by commas and/or whitespace.
BOX_RE = re.compile(rf"\[\s*({_NUM})\s*[,\s]\s*({_NUM})\s*[,\s]\s*({_NUM})\s*[,\s]\s*({_NUM})\s*\]")


class RewardError(RuntimeError):
    """A reward function could not be loaded, raised, or returned something unusable."""


class RewardStopped(RewardError):
    """A reward ran past algorithm.reward_timeout_s, or a SIGTERM / SIGINT came while it ran: the reward is abandoned
    (never re-run sample by sample to locate anything)."""


# After a stop signal, how long a running reward may still take before it is abandoned (a second signal: at once).
STOP_GRACE_S = 30.0


@contextlib.contextmanager
def reward_guard(name: str, timeout_s: float, at: str = ""):
    """Runs reward `name` under _signal_guard; a process the reward forked that leaves it (returns, raises, exits)
    ends here (forks.leave_if_forked): the run's error messages and cleanup (its lock) stay the parent's."""
    owner = os.getpid()
    try:
        with _signal_guard(name, timeout_s, at):
            yield
    except BaseException as e:
        leave_if_forked(owner, f"reward {name!r}", e)
        raise
    leave_if_forked(owner, f"reward {name!r}")


@contextlib.contextmanager
def _signal_guard(name: str, timeout_s: float, at: str = ""):
    """While reward `name` runs in the main thread: SIGALRM after `timeout_s` (0: none) raises RewardStopped inside
    it. SIGTERM / SIGINT first reach the handler that was installed (the loop's GracefulStop records the stop, so a
    reward that returns lets the step finish and checkpoint as usual); a reward still running STOP_GRACE_S later,
    or a second signal, raises RewardStopped, so a hung reward never keeps the run from stopping. Elsewhere (a
    helper thread) a no-op: handlers can only be set in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stops: list[str] = []

    def on_alarm(signum, frame):
        if stops:
            raise RewardStopped(
                f"stopped by {stops[0]}: reward {name!r} was still running{at} {STOP_GRACE_S:g} s later and was abandoned; the step was not finished"
            )
        raise RewardStopped(
            f"reward {name!r} ran longer than algorithm.reward_timeout_s={timeout_s:g} s{at}; make it faster or return "
            "None for samples it cannot score in time, or raise algorithm.reward_timeout_s (0: no limit)"
        )

    def on_stop(signum, frame):
        before = previous.get(signum)
        if callable(before):
            before(signum, frame)  # GracefulStop: the stop is requested; default_int_handler: KeyboardInterrupt
        stops.append(signal.Signals(signum).name)
        if len(stops) > 1:
            raise RewardStopped(f"stopped by a second {stops[-1]} while reward {name!r} was running{at}; the step was not finished")
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        signal.setitimer(signal.ITIMER_REAL, min(remaining, STOP_GRACE_S) if remaining > 0 else STOP_GRACE_S)

    old_alarm = signal.signal(signal.SIGALRM, on_alarm)
    for s in previous:
        signal.signal(s, on_stop)
    if timeout_s > 0:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _exit_error(name: str, e: SystemExit, fn: "RewardFn", at: str) -> RewardError:
    """A reward that called sys.exit() / exit(): an error of that reward, never the end of the run with its code."""
    return RewardError(
        f"reward {name!r} called sys.exit({e.code!r}){at}{raised_at(fn, e)}; a reward must return one value per completion "
        "(None for one it cannot score), not end the process"
    )


# ---------------------------------------------------------------------------------------------------
# Text helpers


def extract_answer(text: Any) -> str | None:
    """Content of the LAST ``<answer>...</answer>``, stripped; None when there is none.

    The last one, because models that think out loud often quote the format before the real answer.
    """
    if not isinstance(text, str):
        return None
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def _solution_text(solution: Any) -> str | None:
    """A solution as text: the content of its <answer> tags if it has them (VLM-R1 style), else itself."""
    if solution is None or isinstance(solution, bool):
        return None
    text = solution if isinstance(solution, str) else str(solution)
    inner = extract_answer(text)
    text = inner if inner is not None else text.strip()
    return text or None


def _as_number(text: str) -> float | None:
    text = text.strip()
    if not NUMBER_RE.match(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _as_choice(text: str) -> str | None:
    m = CHOICE_RE.match(text.strip())
    return m.group(1).upper() if m else None


def _normalise(text: str) -> str:
    return " ".join(text.split()).rstrip(".").casefold()


# LaTeX wrappers around a whole answer: $4$, $$4$$, \(4\), \[4\], \boxed{4}.
MATH_WRAPPER_RE = re.compile(r"^\s*(?:\$\$(.*)\$\$|\$(.*)\$|\\\((.*)\\\)|\\\[(.*)\\\]|\\boxed\{(.*)\})\s*$", re.DOTALL)


def strip_math(text: str) -> str:
    """The inside of LaTeX math wrappers around a whole answer (nested ones too): '$\\boxed{4}$' -> '4'."""
    while (m := MATH_WRAPPER_RE.match(text)) is not None:
        text = next(g for g in m.groups() if g is not None)
    return text.strip()


def answers_match(answer: str, solution: str) -> bool:
    """Whether an extracted answer equals a solution.

    LaTeX math wrappers are ignored ("$4$" == "\\boxed{4}" == "4"). Numeric solutions compare numerically
    ("3" == "3.0" == " 3 "; "three" != "3"); single-letter choices compare case-insensitively with optional
    parentheses/period ("B" == "(b)" == "b."); anything else compares as text, case-insensitive with whitespace
    collapsed and a trailing period ignored, and then, when the optional `math-verify` package is installed
    (``pip install vlmrl[math]``), as mathematics ("\\frac{1}{2}" == "0.5", "x+1" == "1+x").
    """
    answer, solution = strip_math(answer), strip_math(solution)
    if _plain_match(answer, solution):
        return True
    if (_as_number(solution) is not None or _as_choice(solution) is not None) and not MATH_MARKUP_RE.search(answer):
        return False  # a number or a choice written as text has its plain rules: math-verify would read "4 apples" as 4
    return _math_verify_match(answer, solution)


# What makes an answer mathematics rather than text: LaTeX commands, braces, powers, subscripts, a fraction a/b.
MATH_MARKUP_RE = re.compile(r"[\\^{}_]|\d\s*/\s*\d")


def _math_verify_match(answer: str, solution: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    try:
        gold, guess = parse(f"${solution}$"), parse(f"${answer}$")
        return bool(gold) and bool(guess) and bool(verify(gold, guess))
    except Exception:  # a parser failure is a non-match, never a crashed step
        return False


def _plain_match(answer: str, solution: str) -> bool:
    sol_num = _as_number(solution)
    if sol_num is not None:
        ans_num = _as_number(answer)
        return ans_num is not None and math.isclose(ans_num, sol_num, rel_tol=1e-9, abs_tol=1e-9)
    sol_choice = _as_choice(solution)
    if sol_choice is not None:
        return _as_choice(answer) == sol_choice
    return _normalise(answer) == _normalise(solution)


# ---------------------------------------------------------------------------------------------------
# Boxes


def parse_box(text: Any) -> list[float] | None:
    """``[x1, y1, x2, y2]`` from a completion or solution; None when there is no valid box.

    The box is the first ``[a, b, c, d]`` (exactly four numbers, commas and/or spaces) inside the last
    ``<answer>`` if there is one, otherwise in the whole text. Boxes with x2 <= x1 or y2 <= y1 (empty or
    flipped) are rejected rather than repaired: a model should not be paid for them.
    """
    if not isinstance(text, str):
        return None
    answer = extract_answer(text)
    m = BOX_RE.search(answer if answer is not None else text)
    if not m:
        return None
    box = [float(v) for v in m.groups()]
    if not all(math.isfinite(v) for v in box) or box[2] <= box[0] or box[3] <= box[1]:
        return None
    return box


def box_iou(a: list[float], b: list[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes (continuous coordinates)."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0.0, iw) * max(0.0, ih)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


# ---------------------------------------------------------------------------------------------------
# Built-in rewards (TRL signature)


def accuracy(prompts: list, completions: list, solution: list, **kwargs) -> list[float | None]:
    """1.0 when the completion's last <answer> matches the solution (see `answers_match`), else 0.0.

    A completion without <answer> tags scores 0.0. None when the solution itself is missing or empty.
    """
    out: list[float | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        sol_text = _solution_text(sol)
        if sol_text is None:
            out.append(None)
            continue
        answer = extract_answer(completion_text(completion))
        out.append(1.0 if answer is not None and answers_match(answer, sol_text) else 0.0)
    return out


def iou(prompts: list, completions: list, solution: list, **kwargs) -> list[float | None]:
    """IoU in [0, 1] between the completion's box and the solution's box (see `parse_box`).

    0.0 when the completion has no valid box; None when the solution has none.
    """
    out: list[float | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        target = parse_box(sol if isinstance(sol, str) else str(sol) if sol is not None else None)
        if target is None:
            out.append(None)
            continue
        box = parse_box(completion_text(completion))
        out.append(box_iou(box, target) if box is not None else 0.0)
    return out


def format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 when the completion is exactly ``<think>...</think><answer>...</answer>`` (whitespace around ok)
    with a non-empty answer."""
    return [1.0 if THINK_ANSWER_RE.match(completion_text(c)) else 0.0 for c in completions]


def answer_format(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 when the completion has exactly one ``<answer>...</answer>``, not empty (tasks without thinking)."""
    out = []
    for c in completions:
        text = completion_text(c)
        one = text.count("<answer>") == 1 and text.count("</answer>") == 1 and NONEMPTY_ANSWER_RE.search(text) is not None
        out.append(1.0 if one else 0.0)
    return out


def overlong_penalty(length: int, max_len: int, buffer_len: int) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) of a completion of `length` tokens: 0 up to
    max_len - buffer_len, then (max_len - buffer_len - length) / buffer_len down to -1 at max_len, -1 beyond."""
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    if length <= max_len:
        return (expected - length) / buffer_len
    return -1.0


def soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> RewardFn:
    """The soft overlong punishment as a reward over ``completion_ids`` (TRL's get_soft_overlong_punishment arguments:
    L_max and L_cache); algorithm.overlong_shaping adds it as the term ``overlong``. None where no ids are given."""
    if not 1 <= soft_punish_cache <= max_completion_len:
        raise ValueError(f"soft_punish_cache={soft_punish_cache} must be in [1, max_completion_len={max_completion_len}]")

    def overlong(prompts: list, completions: list, completion_ids: list | None = None, **kwargs) -> list[float | None]:
        if completion_ids is None:
            return [None] * len(completions)
        return [overlong_penalty(len(ids), max_completion_len, soft_punish_cache) for ids in completion_ids]

    return overlong


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "accuracy": accuracy,
    "iou": iou,
    "format": format_reward,
    "answer_format": answer_format,
}
# Built-in rewards that are built from a config section rather than called as they are (rewards/scoring.py builds them).
CONFIGURED_REWARDS = {"judge": "a model grading each completion (rewards/judge.py; the judge section)"}


# ---------------------------------------------------------------------------------------------------
# Loading user rewards


# ``target:factory(arg=value, ...)``: a function that returns the reward (TRL's get_soft_overlong_punishment).
FACTORY_SPEC_RE = re.compile(r"(?P<target>.+):(?P<name>[A-Za-z_]\w*)\((?P<args>.*)\)\s*", re.DOTALL)


def load_reward(spec: str, answer_key: str | None = None) -> RewardFn:
    """A reward function from a spec: a built-in name (see BUILTIN_REWARDS), ``path/to/file.py:function``
    (the file is imported by path, relative to the current directory), or ``package.module:function``.
    ``...:factory(max_len=512)`` calls a factory once with those literal arguments and uses what it returns
    (TRL's ``get_soft_overlong_punishment``, ``get_repetition_penalty_reward``, ``get_cosine_scaled_reward``).
    Rewards written for VLM-R1, EasyR1 or ms-swift are wrapped to be called their trainer's way
    (rewards/peers.py: the kind is read from the object, or named as ``spec@easyr1``); for EasyR1 and ms-swift the
    ``(arg=value)`` arguments are bound (EasyR1's reward_function_kwargs) or passed to the ORM class. `answer_key`:
    the column an EasyR1 reward gets as ground_truth (EasyR1's data.answer_key; default ``answer``)."""
    from vlmrl.rewards.peers import detect_kind, split_kind

    spec, kind = split_kind(spec)
    if spec in CONFIGURED_REWARDS:
        raise RewardError(f"reward {spec!r} is {CONFIGURED_REWARDS[spec]}: list it in algorithm.reward_funcs, it is built from the config")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    factory = FACTORY_SPEC_RE.fullmatch(spec)
    if factory is not None:
        obj, module = _load_object(f"{factory['target']}:{factory['name']}")
        kind = kind or detect_kind(obj, module)
        if kind in ("easyr1", "swift"):
            positional, keyword = factory_arguments(spec, factory["args"])
            if positional:
                raise RewardError(f"reward {spec!r}: give {kind} reward arguments by name, e.g. {factory['name']}(format_weight=0.1)")
            return _adapted(spec, factory["name"], obj, kind, module, keyword, answer_key)
        return _adapted(spec, factory["name"], _call_factory(spec, obj, factory["args"]), kind, module, answer_key=answer_key)
    obj, module = _load_object(spec)
    return _adapted(spec, spec.rsplit(":", 1)[-1], obj, kind or detect_kind(obj, module), module, answer_key=answer_key)


def _adapted(spec: str, name: str, obj: Any, kind: str, module: Any, bound: dict | None = None, answer_key: str | None = None) -> RewardFn:
    from vlmrl.rewards.peers import EASYR1_ANSWER_KEY, adapt

    try:
        fn = adapt(name, obj, kind, module, bound, answer_key or EASYR1_ANSWER_KEY)
    except Exception as e:  # an ORM class whose __init__ fails (a missing package, an unset endpoint)
        raise RewardError(f"reward {spec!r}: creating the {kind} reward failed: {type(e).__name__}: {_one_line(e)}") from e
    try:
        fn.__reward_kind__ = kind  # for `vlmrl check`'s description of each reward's call
    except (AttributeError, TypeError):
        pass
    return fn


def _load_object(spec: str) -> tuple[Any, Any]:
    """(the object ``target:name`` names, its module); RewardError with a hint when it cannot be had."""
    from vlmrl.rewards.peers import registered_orm

    if spec.count("(") != spec.count(")"):
        raise RewardError(
            f"reward {spec!r}: unbalanced parentheses; an unquoted list item is cut at each comma, so quote a spec whose "
            """factory takes several arguments: algorithm.reward_funcs='["module:factory(a=1, b=2)", accuracy]'"""
        )
    if ":" not in spec:
        close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? Otherwise " if close else ""
        raise RewardError(f"unknown reward {spec!r}: {hint}use one of {', '.join(BUILTIN_REWARDS)} or path/to/file.py:function")
    target, name = spec.rsplit(":", 1)  # rsplit keeps Windows drive letters in the path
    if not name.isidentifier():
        raise RewardError(f"reward {spec!r}: {name!r} is not a function name")
    module = _import_file(target, spec) if target.endswith(".py") else _import_module(target, spec)
    fn = getattr(module, name, None)
    if fn is None:
        fn = registered_orm(module, name)  # ms-swift: `orms["external_r1v_acc"] = MultiModalAccuracyORM`
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        registered = sorted(getattr(module, "orms", {}) or {}) if isinstance(getattr(module, "orms", None), dict) else []
        close = difflib.get_close_matches(name, found + registered, n=1, cutoff=0.6)
        hint = f"; did you mean {target}:{close[0]}?" if close else ""
        names = ", ".join(found) or "none"
        also = f"; names registered in orms: {', '.join(registered)}" if registered else ""
        raise RewardError(f"reward {spec!r}: {target} has no {name!r}{hint} (callables there: {names}{also})")
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {target}:{name} is a {type(fn).__name__}, not a function")
    return fn, module


def factory_arguments(spec: str, args: str) -> tuple[list, dict]:
    """(positional, keyword) arguments of ``factory(args)`` in a reward spec; only Python literals (numbers,
    strings, lists, dicts, True/False/None), so a config file cannot run code through a spec."""
    import ast

    try:
        call = ast.parse(f"f({args})", mode="eval").body
        if not isinstance(call, ast.Call) or any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
            raise ValueError("only plain arguments")
        return [ast.literal_eval(a) for a in call.args], {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError) as e:
        raise RewardError(
            f"reward {spec!r}: the factory's arguments must be Python literals, e.g. name(max_len=512, scale=0.5) ({type(e).__name__}: {e})"
        ) from None


def _call_factory(spec: str, factory: Callable, args: str) -> RewardFn:
    positional, keyword = factory_arguments(spec, args)
    try:
        fn = factory(*positional, **keyword)
    except Exception as e:
        raise RewardError(f"reward {spec!r}: calling the factory failed: {type(e).__name__}: {_one_line(e)}") from e
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: the factory returned a {type(fn).__name__}, not a reward function")
    return fn


def _import_file(target: str, spec: str, what: str = "reward", error: type[Exception] = RewardError):
    """The module at ``target`` (a .py path) for the user spec ``spec``; ``what`` names the kind of object in
    messages and in the module's name (the tool loader shares this), ``error`` is the exception raised."""
    path = Path(target).expanduser().resolve()
    if path.is_file() and "swift" in path.read_text(encoding="utf-8", errors="replace"):
        from vlmrl.rewards.peers import ensure_swift_importable

        ensure_swift_importable()  # an ms-swift plugin file imports swift.plugin / swift.rewards
    if not path.is_file():
        siblings = [p.name for p in path.parent.glob("*.py")] if path.parent.is_dir() else []
        close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.6)
        hint = f"; did you mean {path.parent / close[0]}?" if close else ""
        raise error(f"{what} {spec!r}: file not found: {path}{hint}")
    # A stable, unique module name per file, registered in sys.modules so that two specs naming the same
    # file share one module and dataclasses/pickle inside the file work.
    mod_name = f"vlmrl_user_{what}_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{what} {spec!r}: cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise error(f"{what} {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def _import_module(target: str, spec: str, what: str = "reward", error: type[Exception] = RewardError):
    try:
        return importlib.import_module(target)
    except Exception as e:
        raise error(f"{what} {spec!r}: cannot import module {target!r}: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------------
# TRL's conversational form and keyword arguments

COMPLETION_FORMATS = ("text", "conversational")
# Arguments TRL passes besides the dataset columns; a column with one of these names would be shadowed.
RESERVED_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


@dataclass(frozen=True)
class TrainerState:
    """What a reward gets as ``trainer_state``: the fields of TRL's ``TrainerState`` that rewards use for
    schedules (``global_step`` is the step being scored, counted from 1; ``epoch`` is fractional)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class RewardLog:
    """What reward functions log through TRL's ``log_extra(column, values)`` (one value per completion: extra
    fields of samples.jsonl) and ``log_metric(name, value)`` (a scalar: averaged into the step's metrics)."""

    columns: dict[str, list] = field(default_factory=dict)
    values: dict[str, list[float]] = field(default_factory=dict)

    def log_extra(self, column: str, values: list) -> None:
        self.columns[str(column)] = list(values)  # the latest call wins: two rewards logging one column do not double it

    def log_metric(self, name: str, value: float) -> None:
        self.values.setdefault(str(name), []).append(float(value))

    def metrics(self) -> dict[str, float]:
        """{name: mean of the values logged this step}."""
        return {name: sum(v) / len(v) for name, v in self.values.items() if v}

    def sample_columns(self, index: int, n: int) -> dict:
        """The logged columns' values for completion `index` of `n` (columns of another length are left out)."""
        return {key: values[index] for key, values in self.columns.items() if len(values) == n}


def conversational_completions(texts: list[str]) -> list[list[dict]]:
    """TRL's conversational completions: one assistant message per completion."""
    return [[{"role": "assistant", "content": text}] for text in texts]


def prompt_messages(problem: str, num_images: int, system_prompt: str | None = None, num_videos: int = 0) -> list[dict]:
    """The chat a row becomes (optional system message, one user turn with its images and videos first), as TRL
    hands a conversational prompt to reward functions. `processing.build_prompt` renders this same list."""
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    media = [{"type": "image"} for _ in range(num_images)] + [{"type": "video"} for _ in range(num_videos)]
    content = media + [{"type": "text", "text": problem}]
    messages.append({"role": "user", "content": content})
    return messages


def reward_inputs(
    rows: list[dict],
    texts: list[str],
    repeats: int,
    completion_format: str = "text",
    system_prompt: str | None = None,
    limit_images: int | None = None,
) -> tuple[list, list]:
    """(prompts, completions) for reward functions: ``rows`` repeated ``repeats`` times (one per completion,
    TRL's order) and the decoded ``texts``, in the configured format (see COMPLETION_FORMATS)."""
    from vlmrl.data.formats import prompt_messages_of

    completion_format = resolve_completion_format(completion_format, rows, system_prompt)
    if completion_format not in COMPLETION_FORMATS:
        raise ValueError(f"completion_format must be one of {COMPLETION_FORMATS}, got {completion_format!r}")
    if completion_format == "text":
        return [row.get("_prompt_text", row["problem"]) for row in rows for _ in range(repeats)], list(texts)
    prompts = []
    for row in rows:
        n = len(row.get("images") or [])
        messages = prompt_messages_of(row, min(n, limit_images) if limit_images else n, len(row.get("videos") or []), system_prompt)
        prompts += [messages] * repeats
    return prompts, conversational_completions(texts)


def resolve_completion_format(completion_format: str, rows: list[dict], system_prompt: str | None = None) -> str:
    """algorithm.completion_format=auto as TRL decides it: conversational when the data's prompts are chat messages
    (TRL conversational, VLM-R1 / LLaVA conversations, ms-swift messages) or when data.system_prompt is set (a system
    message makes the prompt a chat: TRL's grpo_vlm.py builds exactly that, [system, user(problem)], in its
    make_conversation), text otherwise."""
    if completion_format != "auto":
        return completion_format
    return "conversational" if system_prompt or any(row.get("_conversational") for row in rows) else "text"


def _run_coroutines(coros: list) -> list:
    """Results of the coroutines, run concurrently on a private event loop (exceptions returned, not raised).
    Inside a running loop (a notebook) they run on a loop in a helper thread, since a loop cannot be nested."""

    async def gather():
        return await asyncio.gather(*coros, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _call_once(fn: RewardFn, kwargs: dict) -> Any:
    """`fn(**kwargs)`, awaited when it is async."""
    raw = fn(**kwargs)
    if inspect.isawaitable(raw):
        (raw,) = _run_coroutines([raw])
        if isinstance(raw, BaseException):
            raise raw
    return raw


# ---------------------------------------------------------------------------------------------------
# Combining rewards


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
            raise _exit_error(name, e, fn, batch) from None
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
            results = _run_coroutines(list(pending.values()))
    except SystemExit as e:  # asyncio lets SystemExit out of the loop: one of the async rewards called it
        raise _exit_error(names, e, next(iter(funcs.values())), batch) from None
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
                _call_once(fn, kwargs)
        except RewardStopped:
            raise
        except SystemExit as e:
            return _exit_error(name, e, fn, f" on {where(i)}")
        except Exception as e:
            return RewardError(
                f"reward {name!r} raised on {where(i)}, prompt {_short(kwargs['prompts'][0])}, completion "
                f"{_short(kwargs['completions'][0])}: {type(e).__name__}: {_one_line(e)}{raised_at(fn, e)}"
                f"{_format_hint(e, kwargs['completions'][0], fn, kwargs)}"
            )
    return RewardError(
        f"reward {name!r} raised on the batch of {n}{batch} but on no single sample alone (it depends on several rows "
        f"together): {type(error).__name__}: {_one_line(error)}{raised_at(fn, error)}"
    )


def describe_batch(when: str | None, sources: list[str] | None) -> str:
    """' at step 3 (rows data.jsonl:1, data.jsonl:2)': where a batch-level reward failure happened."""
    text = f" at {when}" if when else ""
    rows = list(dict.fromkeys(s for s in (sources or []) if s))
    if rows:
        text += f" (rows {', '.join(rows[:8])}{f' and {len(rows) - 8} more' if len(rows) > 8 else ''})"
    return text


def _format_hint(error: Exception, completion: Any, fn: RewardFn | None = None, given: dict | None = None) -> str:
    """A pointer to what most likely went wrong, only where the error says so: a completion of the other form
    (algorithm.completion_format), a function that is not called TRL's way (an EasyR1 compute_score, a factory), or a
    column the reward reads from ``**kwargs`` that these rows do not have (VLM-R1's, which vlmrl adds to VLM-R1 rows)."""
    text = str(error)
    if isinstance(completion, str) and isinstance(error, TypeError) and "indices must be integers" in text:
        return (
            "; a reward written for TRL's conversational completions (completion[0]['content'], as VLM-R1's) "
            "needs algorithm.completion_format=conversational"
        )
    if isinstance(error, TypeError) and re.search(r"unexpected keyword argument '(prompts|completions)'", text):
        easyr1 = "name it file.py:compute_score@easyr1 (EasyR1 calls compute_score(reward_inputs) with a list of dicts)"
        factory = (
            "if this function builds the reward (a factory such as TRL's get_soft_overlong_punishment), call it in the spec "
            "with its arguments: module:factory(arg=value, ...)"
        )
        if getattr(_innermost(fn), "__name__", "") == "compute_score":  # EasyR1's name for its reward: its way first
            return f"; an EasyR1 reward? {easyr1}; {factory}"
        return f"; {factory}; an EasyR1 compute_score(reward_inputs) is named file.py:compute_score@easyr1, an ms-swift ORM class file.py:Name@swift"
    missing_args = MISSING_ARGUMENTS_RE.search(text) if isinstance(error, TypeError) and given is not None else None
    absent = [a for a in re.findall(r"'(\w+)'", missing_args["names"]) if a not in given] if missing_args else []
    if absent:  # an ms-swift ORM's / TRL function's named data columns: say they are columns, and which the rows have
        have = ", ".join(k for k in given if k not in ("prompts", "completions", *REWARD_EXTRAS))
        return (
            f"; it takes the data column{'s' if len(absent) > 1 else ''} {', '.join(absent)} as argument{'s' if len(absent) > 1 else ''}, "
            f"which these rows do not have (their columns: {have or 'none'}): add {'them' if len(absent) > 1 else 'it'} to the data file"
        )
    if isinstance(completion, list) and ("'list' object has no attribute" in text or "not 'list'" in text or "got 'list'" in text):
        return "; a reward that expects plain string completions needs algorithm.completion_format=text"
    if "'NoneType'" in text and given is not None:
        missing = [c for c in _kwargs_read(fn) if c not in given]
        if missing:
            return (
                f"; the reward reads {', '.join(missing)} from **kwargs, which these rows do not have (it gets: "
                f"{', '.join(k for k in given if k not in ('prompts', 'completions'))}); vlmrl adds image_path, "
                "accu_reward_method and image_grid_thw to VLM-R1 conversations rows only: add the column to the data"
            )
    return ""


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
            row.append(f"{key} {_short(values[index])}")
    return f"{text} ({', '.join(row)})" if row else text


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0)


def raised_at(fn: RewardFn, error: BaseException) -> str:
    """' (at path/to/rewards.py:12 in my_reward)': the innermost line of the reward function's own file in the error's
    traceback (where the user looks, even when the error came from a library it called); else the innermost line
    outside vlmrl; '' when there is none."""
    ours = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers.py")}  # vlmrl's call wrappers
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) not in ours]
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


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
