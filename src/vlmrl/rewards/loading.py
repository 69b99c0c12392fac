"""Loading user rewards from a spec: ``file.py:name``, ``module:name``, and factories ``target:name(args)`` called with literal arguments."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Callable

from vlmrl.rewards.diagnostics import one_line
from vlmrl.rewards.functions import BUILTIN_REWARDS, CONFIGURED_REWARDS
from vlmrl.rewards.guard import RewardError
from vlmrl.rewards.protocol import RewardFn
import ast


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
        raise RewardError(f"reward {spec!r}: creating the {kind} reward failed: {type(e).__name__}: {one_line(e)}") from e
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
    module = import_file(target, spec) if target.endswith(".py") else import_module(target, spec)
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
        raise RewardError(f"reward {spec!r}: calling the factory failed: {type(e).__name__}: {one_line(e)}") from e
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: the factory returned a {type(fn).__name__}, not a reward function")
    return fn


def import_file(target: str, spec: str, what: str = "reward", error: type[Exception] = RewardError):
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


def import_module(target: str, spec: str, what: str = "reward", error: type[Exception] = RewardError):
    try:
        return importlib.import_module(target)
    except Exception as e:
        raise error(f"{what} {spec!r}: cannot import module {target!r}: {type(e).__name__}: {e}") from e
