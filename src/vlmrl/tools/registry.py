"""Tools as plain functions: their JSON schema, and loading them from user specs.

A tool is a function with type hints and a Google-style docstring (an ``Args:`` section describing every
argument), as for TRL's ``tools=``; it returns text, a PIL image, or a list of both. A keyword-only parameter
named ``context`` is not shown to the model: the runner passes a ``ToolContext`` there (the conversation's
images so far and the dataset row), which is how image tools reach the image the model is looking at.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from dataclasses import dataclass
from typing import Callable

from vlmrl.rewards.loading import import_file, import_module
from vlmrl.tools.context import ToolContext
from vlmrl.tools.image_tools import crop, rotate, zoom

__all__ = ["Tool", "ToolContext", "ToolError", "load_tool", "load_tools", "make_tool", "schemas", "tool_schema"]

CONTEXT_PARAM = "context"


class ToolError(ValueError):
    """A tool could not be loaded or described (bad spec, no docstring, missing type hints)."""


@dataclass(frozen=True)
class Tool:
    """A callable tool: ``name`` (what the model calls), ``fn``, and ``schema`` (the ``{"type": "function",
    "function": {...}}`` dict that chat templates' ``tools=`` take)."""

    name: str
    fn: Callable
    schema: dict

    @property
    def takes_context(self) -> bool:
        return CONTEXT_PARAM in inspect.signature(self.fn).parameters


def _schema_view(fn: Callable) -> Callable:
    """A stand-in for ``fn`` without its ``context`` parameter, so the schema shows only what the model fills.
    Type hints are resolved here, in ``fn``'s own module, because the stand-in lives in this one."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)

    def view(*args, **kwargs):  # never called: only described
        raise AssertionError

    view.__name__ = getattr(fn, "__name__", "tool")
    view.__doc__ = fn.__doc__
    view.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != CONTEXT_PARAM])
    view.__annotations__ = {k: v for k, v in hints.items() if k != CONTEXT_PARAM}
    return view


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of a tool function, from ``transformers.utils.get_json_schema``; a ``context`` parameter
    is left out. Raises ToolError naming the function and the fix when hints or docstring are missing."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", repr(fn))
    try:
        return get_json_schema(_schema_view(fn))
    except Exception as e:  # transformers raises TypeHintParsingException / DocstringParsingException
        raise ToolError(
            f"tool {name!r}: cannot describe it to the model ({e}); a tool needs a type hint on every argument and a "
            "docstring with a Google-style 'Args:' section describing each one"
        ) from None


def make_tool(fn: Callable, name: str | None = None) -> Tool:
    """A Tool from a function (its schema generated now, so a bad docstring fails at load, not mid-run)."""
    if not callable(fn):
        raise ToolError(f"tool {name or fn!r}: a {type(fn).__name__} is not a function")
    schema = tool_schema(fn)
    if name is not None:
        schema["function"]["name"] = name
    return Tool(name=schema["function"]["name"], fn=fn, schema=schema)


def builtin_tools() -> dict[str, Callable]:
    return {"crop": crop, "zoom": zoom, "rotate": rotate}


def load_tool(spec: str | Callable) -> Tool:
    """A Tool from a built-in name (``crop``, ``zoom``, ``rotate``), ``path/to/file.py:fn`` (imported by path,
    relative to the current directory), ``package.module:fn``, or a function. Loading a tool is the only way
    code runs as a tool: nothing the model writes can name a function that was not loaded here."""
    if callable(spec):
        return make_tool(spec)
    builtins = builtin_tools()
    if spec in builtins:
        return make_tool(builtins[spec])
    if ":" not in spec:
        close = difflib.get_close_matches(spec, list(builtins), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? Otherwise " if close else ""
        raise ToolError(f"unknown tool {spec!r}: {hint}use one of {', '.join(builtins)} or path/to/file.py:function or module:function")
    return make_tool(load_object(spec, "tool"))


def load_object(spec: str, what: str):
    """The object ``name`` of ``path/to/file.py:name`` (imported by path) or ``package.module:name``; ToolError
    naming the spec when it cannot be found."""
    target, name = spec.rsplit(":", 1)
    if not name.isidentifier():
        raise ToolError(f"{what} {spec!r}: {name!r} is not a name in a module")
    if target.endswith(".py"):
        module = import_file(target, spec, what=what, error=ToolError)
    else:
        module = import_module(target, spec, what=what, error=ToolError)
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        close = difflib.get_close_matches(name, found, n=1, cutoff=0.6)
        hint = f"; did you mean {target}:{close[0]}?" if close else ""
        raise ToolError(f"{what} {spec!r}: {target} has no {name!r}{hint} (callables there: {', '.join(found) or 'none'})")
    return getattr(module, name)


def load_tools(specs: list) -> dict[str, Tool]:
    """Tools by name from specs; two tools with one name is an error (the model could not tell them apart)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise ToolError(f"tool {spec!r}: a tool named {tool.name!r} is already loaded; tool names must be unique")
        tools[tool.name] = tool
    return tools


def schemas(tools: dict[str, Tool]) -> list[dict]:
    """The ``tools=`` list for ``apply_chat_template``."""
    return [t.schema for t in tools.values()]
