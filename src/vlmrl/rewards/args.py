"""The two facts about calling a reward that the built-in rewards, rewards/combine.py and rewards/peers.py share: the text of a completion in
either of TRL's forms, and which of TRL's extra arguments a function can take. Standard library only."""

from __future__ import annotations

import inspect
from typing import Any, Callable


def completion_text(completion: Any) -> str:
    """The text of one completion: a plain string, or TRL's conversational form.

    Conversational completions are a list of ``{"role", "content"}`` messages; the text is the content of
    the last message, where a content given as a list of parts (``{"type": "text", "text": ...}``) is
    joined. Anything else is an error, because silently scoring ``str(obj)`` would hide a bug.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and completion and all(isinstance(m, dict) for m in completion):
        content = completion[-1].get("content", "")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise TypeError(f"completion must be a string or a list of {{'role', 'content'}} messages, got {type(completion).__name__}")


def accepted_arguments(fn: Callable, names: tuple[str, ...]) -> set[str]:
    """Which of `names` `fn` can take: all of them with ``**kwargs`` (TRL always passes them), else those it names.
    A callable whose signature cannot be read (some builtins) gets them all, as TRL would pass them."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(names)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return set(names)
    named = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return set(names) & named
