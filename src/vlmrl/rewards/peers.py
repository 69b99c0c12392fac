"""Reward functions written for other trainers, called the way those trainers call them.

vlmrl calls every reward TRL's way (`rewards.py`). Functions written for another trainer are wrapped once, at
load, into that form; the user's file is not changed. A spec may name the kind after ``@``
(``file.py:compute_score@easyr1``); without it the kind is read from the object:

- ``trl``: ``fn(prompts, completions, **columns)``; completions follow algorithm.completion_format.
- ``vlm-r1``: TRL's call with conversational completions always (VLM-R1 reads ``completion[0]["content"]``) and
  the columns VLM-R1's loader adds (``image_path``, ``accu_reward_method``: formats.py). Not told apart from
  ``trl`` by its signature: name it, or let completion_format=auto follow the data (conversations -> conversational).
- ``easyr1``: ``compute_score(reward_inputs)`` (a batch: list of dicts) or ``compute_score(reward_input)`` (one
  dict; the module's ``REWARD_TYPE = "sequential"``), each input ``{"response", "response_length",
  "ground_truth"}``; returns floats or dicts whose ``overall`` is the reward (the other keys are logged as metrics).
  Detected from the parameter name, or the module's ``REWARD_TYPE`` for a function that takes neither ``prompts``
  first nor ``completions`` (TRL's names: such a function in the same file stays a TRL reward). ``file.py:compute_score(format_weight=0.2)``
  binds keyword arguments, as EasyR1's ``reward_function_kwargs``.
- ``swift``: an ms-swift ORM class (instantiated once; its ``__call__(completions, **kwargs)`` gets string
  completions and the columns), or a name the plugin file registers in ``orms`` (``plugin.py:external_r1v_acc``).
  Without ms-swift installed, plugin files import a small stand-in for ``swift.plugin`` / ``swift.rewards``
  (``ORM``, ``AsyncORM``, ``orms``, ``rm_plugins``) and ``swift.utils.get_logger``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys
import types
from typing import Any, Callable

from vlmrl.rewards.args import accepted_arguments, completion_text

KINDS = ("trl", "vlm-r1", "easyr1", "swift")
EXTRA_ARGUMENTS = ("completion_ids", "trainer_state", "log_extra", "log_metric")


def split_kind(spec: str) -> tuple[str, str | None]:
    """``"f.py:fn@easyr1"`` -> ("f.py:fn", "easyr1"); a spec without a known kind suffix is returned whole."""
    head, sep, kind = spec.rpartition("@")
    if sep and kind in KINDS:
        return head, kind
    return spec, None


def detect_kind(obj: Any, module: Any = None) -> str:
    """The kind of a loaded reward object (see the module docstring)."""
    if isinstance(obj, type):
        return "swift"
    reward_type = getattr(module, "REWARD_TYPE", None) if module is not None else None
    try:
        parameters = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        parameters = []
    first = parameters[0] if parameters else None
    if first in ("reward_inputs", "reward_input"):
        return "easyr1"
    # TRL passes `completions` by name and EasyR1 never does: a module-level REWARD_TYPE (EasyR1's flag for the file's
    # compute_score) does not make the file's TRL-style functions EasyR1 rewards.
    if reward_type in ("batch", "sequential") and "completions" not in parameters and first != "prompts":
        return "easyr1"
    return "trl"


# EasyR1's data.answer_key default: the column its loader hands to the reward as ground_truth.
EASYR1_ANSWER_KEY = "answer"


def adapt(name: str, obj: Any, kind: str, module: Any = None, bound: dict | None = None, answer_key: str = EASYR1_ANSWER_KEY) -> Callable[..., list]:
    """`obj` as a TRL-style reward function, called as its own trainer calls it (`answer_key`: EasyR1's data.answer_key)."""
    bound = bound or {}
    if kind == "swift":
        return _swift_reward(name, obj, bound)
    if kind == "easyr1":
        sequential = getattr(module, "REWARD_TYPE", None) == "sequential" or _first_parameter(obj) == "reward_input"
        return _easyr1_reward(name, functools.partial(obj, **bound) if bound else obj, sequential, answer_key)
    if kind == "vlm-r1":
        return _vlmr1_reward(obj)
    return obj


def _first_parameter(fn: Any) -> str | None:
    try:
        return next(iter(inspect.signature(fn).parameters), None)
    except (TypeError, ValueError):
        return None


def _text(completion: Any) -> str:
    return completion_text(completion)


def _swift_reward(name: str, cls_or_instance: Any, bound: dict) -> Callable[..., list]:
    instance = cls_or_instance(**bound) if isinstance(cls_or_instance, type) else cls_or_instance  # once, as ms-swift does
    takes = accepted_arguments(instance, EXTRA_ARGUMENTS)

    def swift_reward(prompts, completions, **kwargs):
        extras = {k: kwargs.pop(k) for k in EXTRA_ARGUMENTS if k in kwargs}
        kwargs.update({k: v for k, v in extras.items() if k in takes or k == "trainer_state"})
        return instance([_text(c) for c in completions], **kwargs)

    swift_reward.__name__ = name
    swift_reward.__wrapped_reward__ = instance
    return swift_reward


def ground_truth_column(columns, answer_key: str = EASYR1_ANSWER_KEY) -> str | None:
    """The column an EasyR1 reward gets as ``ground_truth``: `answer_key` (EasyR1's loader pops it into ground_truth),
    else ``solution`` (every vlmrl row has one); None when the rows have neither."""
    return next((c for c in (answer_key, "solution") if c in columns), None)


def _easyr1_reward(name: str, fn: Callable, sequential: bool, answer_key: str = EASYR1_ANSWER_KEY) -> Callable[..., list]:
    """`fn` called EasyR1's way. ``ground_truth`` is the row's `answer_key` column, as EasyR1's loader sets it
    (``example.pop(answer_key)``, default ``answer``; vlmrl's answer_key is the column data.columns.solution names),
    else the row's ``solution``; a ``ground_truth`` column of the data itself is never read first."""

    def easyr1_reward(prompts, completions, completion_ids=None, log_metric=None, **columns):
        key = ground_truth_column(columns, answer_key)
        truth = columns[key] if key is not None else [None] * len(completions)
        inputs = []
        for i, c in enumerate(completions):
            text = _text(c)
            length = len(completion_ids[i]) if completion_ids is not None else len(text.split())
            inputs.append({"response": text, "response_length": length, "ground_truth": truth[i]})
        scores = [fn(x) for x in inputs] if sequential else fn(inputs)
        return _overall(name, list(scores), log_metric)

    easyr1_reward.__name__ = name
    easyr1_reward.__wrapped_reward__ = fn
    easyr1_reward.__answer_key__ = answer_key
    return easyr1_reward


def _overall(name: str, scores: list, log_metric) -> list:
    """EasyR1 scores (floats, or dicts with ``overall``) -> the rewards; the dicts' other keys go to log_metric. A dict
    without ``overall`` raises ValueError, which the reward call reports naming the reward and the sample."""
    out, extra = [], {}
    for i, score in enumerate(scores):
        if isinstance(score, dict):
            if "overall" not in score:
                raise ValueError(f"an EasyR1 score must hold 'overall'; sample {i} has keys {', '.join(map(str, score))}")
            out.append(score["overall"])
            for key, value in score.items():
                if key != "overall" and isinstance(value, (int, float)):
                    extra.setdefault(str(key), []).append(float(value))
        else:
            out.append(score)
    if log_metric is not None:
        for key, values in extra.items():
            log_metric(f"{name}/{key}", sum(values) / len(values))
    return out


def _vlmr1_reward(fn: Callable) -> Callable[..., list]:
    @functools.wraps(fn)
    def vlmr1_reward(prompts, completions, **kwargs):
        chat = [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions]
        return fn(prompts=prompts, completions=chat, **kwargs)

    return vlmr1_reward


def registered_orm(module: Any, name: str) -> Any | None:
    """The class a plugin file registered under `name` in ms-swift's ``orms`` (the module's own ``orms`` dict)."""
    registry = getattr(module, "orms", None)
    return registry.get(name) if isinstance(registry, dict) else None


# ---------------------------------------------------------------------------------------------------
# ms-swift stand-in, for plugin files on a machine without ms-swift


def ensure_swift_importable() -> None:
    """Make ``from swift.plugin import ORM, orms`` (ms-swift 3) and ``from swift.rewards import ORM, orms`` (ms-swift 4)
    work without ms-swift, with the few names plugin files import. Does nothing where ms-swift is installed."""
    if "swift" in sys.modules or importlib.util.find_spec("swift") is not None:
        return

    class ORM:
        """ms-swift's outcome-reward base class, as plugin files subclass it."""

        def __init__(self, args=None, **kwargs):
            self.args = args

        def __call__(self, completions, **kwargs):
            raise NotImplementedError

    class AsyncORM(ORM):
        pass

    registry: dict[str, Any] = {}
    root = types.ModuleType("swift")
    root.__path__ = []  # a package, so submodules import
    root.__vlmrl_stand_in__ = True
    modules = {"swift": root}
    for sub in ("plugin", "rewards"):
        mod = types.ModuleType(f"swift.{sub}")
        mod.ORM, mod.AsyncORM, mod.orms, mod.rm_plugins = ORM, AsyncORM, registry, {}
        modules[f"swift.{sub}"] = mod
    utils = types.ModuleType("swift.utils")
    utils.get_logger = lambda name=None: logging.getLogger(name or "swift")
    modules["swift.utils"] = utils
    for key, mod in modules.items():
        sys.modules[key] = mod
        if "." in key:
            setattr(root, key.split(".", 1)[1], mod)


def swift_registry() -> dict:
    """The ``orms`` dict plugin files register into (ms-swift's own, or the stand-in's)."""
    for name in ("swift.rewards", "swift.plugin"):
        module = sys.modules.get(name)
        if module is not None and isinstance(getattr(module, "orms", None), dict):
            return module.orms
    return {}


# ---------------------------------------------------------------------------------------------------
# What `vlmrl check` says about each reward

# Built-in names that peers use for their own functions: which definition vlmrl's name means.
BUILTIN_NOTES = {
    "accuracy": (
        "vlmrl's built-in accuracy (the last <answer> against solution; numbers, choices, LaTeX as math), not VLM-R1's "
        "accuracy_reward nor ms-swift's 'accuracy' ORM; for theirs name their file: path/to/file.py:accuracy_reward"
    ),
    "format": (
        "vlmrl's built-in format (<think>...</think><answer>non-empty</answer>, whole completion), not VLM-R1's format_reward "
        "nor ms-swift's 'format' ORM; for theirs name their file: path/to/file.py:format_reward"
    ),
}


def describe_call(name: str, fn: Any, columns: list[str], completion_format: str, builtin: bool = False) -> str:
    """One line: how `name` will be called (its kind, and the arguments it gets); `builtin`: one of vlmrl's own."""
    if builtin:
        return f"reward {name}: {BUILTIN_NOTES.get(name) or f'vlmrl built-in {name}'}"
    kind = getattr(fn, "__reward_kind__", "trl")
    if kind == "easyr1":
        answer_key = getattr(fn, "__answer_key__", EASYR1_ANSWER_KEY)
        truth = ground_truth_column(columns, answer_key)
        shape = "one dict per call" if _first_parameter(getattr(fn, "__wrapped_reward__", fn)) == "reward_input" else "a list of dicts"
        if truth == answer_key:
            source = f"ground_truth={truth}: the {truth!r} column, EasyR1's data.answer_key"
        elif truth is not None:
            source = f"ground_truth={truth}: the {truth!r} column (no {answer_key!r} column, EasyR1's data.answer_key)"
        else:
            source = f"ground_truth=None: no {answer_key!r} column"
        if "ground_truth" in columns and truth != "ground_truth":
            source += "; the data's own 'ground_truth' column is not it, as in EasyR1"
        return (
            f"reward {name} (EasyR1 compute_score): gets {shape} {{response, response_length, {source}}}; "
            "'overall' of a dict is the reward, its other keys are logged"
        )
    if kind == "swift":
        return f"reward {name} (ms-swift ORM, one instance): gets completions as strings, trainer_state and the columns {', '.join(columns)}"
    passed = accepted_arguments(fn, tuple(columns) + EXTRA_ARGUMENTS)
    form = "conversational" if kind == "vlm-r1" else completion_format
    label = "VLM-R1" if kind == "vlm-r1" else "TRL"
    listed = [c for c in [*columns, *EXTRA_ARGUMENTS] if c in passed]
    return f"reward {name} ({label} signature): gets prompts, completions ({form}){', ' if listed else ''}{', '.join(listed)}"
