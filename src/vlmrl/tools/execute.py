"""Running one tool call: argument checks, a per-call timeout, and every failure as an error result.

A tool runs in a daemon worker thread and the caller waits at most ``timeout_s``. A Python thread cannot be
killed: a tool that hangs keeps its thread (and whatever it holds) until it returns by itself, but the caller
gets a timeout result at once and the process can still exit (daemon thread). So that hung calls cannot pile
up, a tool with ``MAX_HUNG`` calls still running past their timeout is refused until one of them ends.
A subprocess per call could be killed, but would need the tool, its arguments and the images pickled across
(and CUDA state kept out of it); tools here are the user's own trusted functions, run in-process only when the
user passes them, so the thread is the cheap, honest choice.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import dataclass, field

from PIL import Image

from vlmrl.tools.registry import CONTEXT_PARAM, Tool, ToolContext

DEFAULT_TIMEOUT_S = 10.0
MAX_HUNG = 4
_hung: dict[str, list[threading.Thread]] = {}
_hung_lock = threading.Lock()


@dataclass
class ToolCall:
    """One call the model asked for: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass
class ToolResult:
    """What a call gave back: ``text`` and ``images`` (PIL), or ``error`` (a message for the model, naming the
    tool) with no images."""

    name: str
    text: str = ""
    images: list = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _fail(name: str, message: str) -> ToolResult:
    return ToolResult(name=name, error=f"tool {name!r} failed: {message}")


def normalise_output(name: str, out) -> ToolResult:
    """A tool's return value as a ToolResult: a string, a PIL image, or a list/tuple of them (TRL's content
    parts ``{"type": "text"|"image", ...}`` are accepted too). Anything else is an error result."""
    items = list(out) if isinstance(out, (list, tuple)) else [out]
    texts, images = [], []
    for item in items:
        if isinstance(item, dict) and item.get("type") in ("text", "image"):
            item = item.get(item["type"])
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, Image.Image):
            images.append(item)
        else:
            return _fail(name, f"it returned a {type(item).__name__}; a tool returns text, a PIL image, or a list of both")
    return ToolResult(name=name, text="\n".join(texts), images=images)


def _check_arguments(tool: Tool, arguments) -> str | None:
    """Why these arguments cannot be passed to the tool, or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    if CONTEXT_PARAM in arguments and tool.takes_context:
        return f"{CONTEXT_PARAM!r} is not an argument the model can pass"
    sig = inspect.signature(tool.fn)
    params = {n: p for n, p in sig.parameters.items() if n != CONTEXT_PARAM}
    unknown = sorted(set(arguments) - set(params)) if not any(p.kind is p.VAR_KEYWORD for p in params.values()) else []
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)}; it takes {', '.join(params) or 'none'}"
    missing = [n for n, p in params.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    return None


def _live_hung(name: str) -> int:
    with _hung_lock:
        alive = [t for t in _hung.get(name, []) if t.is_alive()]
        _hung[name] = alive
        return len(alive)


def run_tool(tools: dict[str, Tool], call: ToolCall, context: ToolContext | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> ToolResult:
    """Run ``call`` against the loaded ``tools``; never raises for anything the tool or the model did."""
    tool = tools.get(call.name)
    if tool is None:
        return _fail(call.name, f"there is no such tool; available: {', '.join(tools) or 'none'}")
    problem = _check_arguments(tool, call.arguments)
    if problem:
        return _fail(tool.name, problem)
    if _live_hung(tool.name) >= MAX_HUNG:
        return _fail(tool.name, f"refused: {MAX_HUNG} earlier calls are still running past their timeout")
    kwargs = dict(call.arguments)
    if tool.takes_context:
        kwargs[CONTEXT_PARAM] = context if context is not None else ToolContext()
    box: dict = {}

    def work():
        try:
            out = tool.fn(**kwargs)
            # An async tool (as TRL allows) runs to completion on its own event loop in this worker thread.
            box["out"] = asyncio.run(out) if inspect.iscoroutine(out) else out
        except BaseException as e:  # noqa: BLE001 - anything the tool raises becomes the model's observation
            box["error"] = e

    worker = threading.Thread(target=work, name=f"vlmrl-tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        with _hung_lock:
            _hung.setdefault(tool.name, []).append(worker)
        return _fail(tool.name, f"timed out after {timeout_s:g} s")
    if "error" in box:
        e = box["error"]
        return _fail(tool.name, f"{type(e).__name__}: {' '.join(str(e).split())}")
    return normalise_output(tool.name, box.get("out"))
