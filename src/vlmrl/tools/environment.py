"""The environment protocol, and an environment that runs tools.

An environment is a small class: ``reset(row) -> observation`` starts a rollout from a dataset row and
``step(action_text) -> (observation, reward, done)`` takes the model's text for one turn. An observation is a
list of chat messages to append to the conversation (``reset``: the prompt; ``step``: the tool turn), so the
engine can render it with the chat template and append it as tokens. ``run_episode`` is the plain reference
loop (a policy function in, a Trajectory out); the continuous decoder's multi-turn rollout is ``models.multiturn``.
"""

from __future__ import annotations

import inspect
from typing import Callable, Protocol

from PIL import Image

from vlmrl.data.media import load_images
from vlmrl.tools.execute import DEFAULT_TIMEOUT_S, ToolResult, run_tool
from vlmrl.tools.image_checks import DEFAULT_MAX_PIXELS, check_tool_images
from vlmrl.tools.parsing import ParsedTurn, parse_tool_calls
from vlmrl.tools.registry import Tool, ToolContext, ToolError, load_object, make_tool
from vlmrl.tools.render import parse_error_message, tool_message
from vlmrl.tools.trajectory import Trajectory, build_trajectory, images_of


class Environment(Protocol):
    def reset(self, row: dict) -> list[dict]: ...

    def step(self, action_text: str) -> tuple[list[dict], float, bool]: ...


def prompt_messages(row: dict) -> list[dict]:
    """The opening messages of a row: vlmrl's ``problem`` (else its ``prompt``; a string, or a list of messages
    used as is) with the row's ``image`` / ``images`` (PIL images, or paths as in a validated vlmrl row, decoded
    at full resolution: the processor downsizes for the model, tools crop the original) as image parts first."""
    # vlmrl's validated rows keep their source's `prompt` column (e.g. TRL messages with image placeholders) beside
    # the `problem` read from it: the problem is the prompt then.
    prompt = row["problem"] if isinstance(row.get("problem"), str) else row.get("prompt")
    if isinstance(prompt, list):
        return list(prompt)
    if not isinstance(prompt, str):
        raise ToolError(f"row field 'prompt' (or 'problem') must be a string or a list of messages, got {type(prompt).__name__}")
    images = row.get("images") or ([row["image"]] if row.get("image") is not None else [])
    images = [load_images([im], None, None)[0] if isinstance(im, str) else im for im in images]
    return [{"role": "user", "content": [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": prompt}]}]


class ToolEnvironment:
    """Runs the model's tool calls each turn until it answers without one or runs out of turns.

    ``reward_fn(trajectory) -> float`` scores a finished rollout (0.0 without one; intermediate steps give 0.0).
    A row may narrow the tools with a ``tools`` field (a list of loaded tool names). ``max_images`` caps the
    images in one rollout, the row's included: a call that would pass it ends the rollout (``image_budget``), and
    the turn's later calls are not run. ``max_calls_per_turn``: calls of one turn past it are not run (one error
    message says so). ``seen_size(image) -> (width, height)``: the size the model's processor shows an image at (e.g.
    ``vlmrl.data.media.target_size`` with the run's pixel bounds), so pixel boxes are scaled to the original, and a
    tool's image is shown to the model at that size (tools keep the original). Every image a tool returns is checked
    (``image_checks.check_tool_images``: at most ``max_image_pixels``, a shape ``shape_check`` accepts).
    """

    def __init__(
        self,
        tools: dict[str, Tool],
        max_turns: int = 4,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_images: int = 8,
        reward_fn: Callable[[Trajectory], float] | None = None,
        seen_size: Callable | None = None,
        max_calls_per_turn: int = 8,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
        shape_check: Callable | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.tools, self.max_turns, self.timeout_s, self.max_images, self.reward_fn = tools, max_turns, timeout_s, max_images, reward_fn
        self.max_calls_per_turn, self.max_image_pixels, self.shape_check = max_calls_per_turn, max_image_pixels, shape_check
        self._steps: list[tuple[ParsedTurn, str, list[dict]]] = []
        self._prompt: list[dict] = []
        self.seen_size = seen_size
        self._context = ToolContext()
        self._active: dict[str, Tool] = {}
        self._end: str | None = None
        self._reward: float | None = None

    def reset(self, row: dict) -> list[dict]:
        names = row.get("tools")
        if names is None:
            self._active = dict(self.tools)
        else:
            unknown = [n for n in names if n not in self.tools]
            if unknown:
                loaded = ", ".join(self.tools) or "none"
                raise ToolError(f"row field 'tools' names {', '.join(map(repr, unknown))}, which are not loaded (loaded: {loaded})")
            self._active = {n: self.tools[n] for n in names}
        self._prompt = prompt_messages(row)
        self._context = ToolContext(images=images_of(self._prompt), row=row)
        self._context.seen_sizes = [self.seen_size(im) for im in self._context.images] if self.seen_size else []
        self._steps, self._end, self._reward = [], None, None
        return list(self._prompt)

    def _run(self, parsed: ParsedTurn) -> list[dict]:
        errors = list(parsed.errors)
        calls = parsed.calls[: self.max_calls_per_turn]
        if len(parsed.calls) > len(calls):
            errors.append(f"{len(parsed.calls)} tool calls in one turn: only the first {self.max_calls_per_turn} were run (tools.max_calls_per_turn)")
        observation = [parse_error_message(errors)] if errors else []
        return observation + [tool_message(self._call(call)) for call in calls]

    def _call(self, call) -> ToolResult:
        """One call's result; once the image budget is spent a call is not run at all."""
        if self._end == "image_budget":
            return ToolResult(name=call.name, error=f"tool {call.name!r} failed: not run, the rollout's image budget ({self.max_images}) is spent")
        result = check_tool_images(run_tool(self._active, call, self._context, self.timeout_s), self.max_image_pixels, self.shape_check)
        if len(self._context.images) + len(result.images) > self.max_images:
            self._end = "image_budget"
            return ToolResult(name=call.name, error=f"tool {call.name!r} failed: the rollout's image budget ({self.max_images}) is spent")
        self._context.images.extend(result.images)
        if not (self.seen_size and result.images):
            return result
        seen = [self.seen_size(im) for im in result.images]
        self._context.seen_sizes.extend(seen)
        # The model sees a tool's image as it sees a dataset image (data.media.load_images: resized to the pixel bounds).
        shown = [im if im.size == size else im.resize(size, Image.Resampling.BICUBIC) for im, size in zip(result.images, seen)]
        return ToolResult(name=result.name, text=result.text, images=shown)

    def step(self, action_text: str) -> tuple[list[dict], float, bool]:
        if self._end is not None:
            raise RuntimeError(f"step() after the rollout ended ({self._end}); call reset(row) first")
        parsed = parse_tool_calls(action_text)
        acted = bool(parsed.calls or parsed.errors)
        observation = self._run(parsed) if acted else []
        self._steps.append((parsed, action_text, observation))
        if not acted:
            self._end = "answered"
        elif self._end is None and len(self._steps) >= self.max_turns:
            self._end = "max_turns"
        if self._end is None:
            return observation, 0.0, False
        self._reward = float(self.reward_fn(self.trajectory())) if self.reward_fn is not None else 0.0
        return observation, self._reward, True

    def trajectory(self) -> Trajectory:
        return build_trajectory(self._prompt, self._steps, end_reason=self._end or "answered", reward=self._reward)


class TRLEnvironment(ToolEnvironment):
    """A TRL ``environment_factory`` instance run through this protocol: its public methods are the tools,
    ``reset(**row)`` may return text (or content parts) that is appended to the row's last user message, and
    ``get_reward()``, when defined, scores the finished rollout (as in TRL 1.16's GRPOTrainer)."""

    def __init__(self, instance, **kwargs):
        methods = {n: getattr(instance, n) for n, _ in inspect.getmembers(type(instance), inspect.isfunction)}
        if not callable(methods.get("reset")):
            raise ToolError(f"{type(instance).__name__}: a TRL environment needs a reset method")
        tools = {n: make_tool(m) for n, m in methods.items() if not n.startswith("_") and n not in ("reset", "get_reward")}
        if "get_reward" in methods:
            kwargs.setdefault("reward_fn", lambda _trajectory: instance.get_reward())
        super().__init__(tools, **kwargs)
        self.instance = instance

    def reset(self, row: dict) -> list[dict]:
        messages = super().reset(row)
        extra = self.instance.reset(**row)
        if extra is None:
            return messages
        last = messages[-1]
        content = [{"type": "text", "text": last["content"]}] if isinstance(last["content"], str) else list(last["content"])
        content += [{"type": "text", "text": extra}] if isinstance(extra, str) else list(extra)
        self._prompt = messages[:-1] + [{**last, "content": content}]
        self._context.images = images_of(self._prompt)
        self._context.seen_sizes = [self.seen_size(im) for im in self._context.images] if self.seen_size else []
        return list(self._prompt)


def environment_factory(spec: str, tools: dict[str, Tool]) -> tuple[Callable[..., Environment], dict[str, Tool]]:
    """(make, the tools the model is told of) for ``tools.environment``: ``make(**budgets)`` builds one environment
    per rollout. ``spec`` empty: ``ToolEnvironment(tools)``; a ToolEnvironment subclass: ``Class(tools, **budgets)``;
    any other class or function is a TRL ``environment_factory`` (``TRLEnvironment(factory(), **budgets)``, its public
    methods the tools). One environment is made here, so a class that cannot be built fails before the run."""
    if not spec:
        return (lambda **kw: ToolEnvironment(tools, **kw)), tools
    found = load_object(spec, "environment")
    if isinstance(found, type) and issubclass(found, ToolEnvironment) and not issubclass(found, TRLEnvironment):

        def make(**kw):
            return found(tools, **kw)
    elif callable(found):
        if tools:
            raise ToolError(f"environment {spec!r} is a TRL environment_factory (its public methods are its tools): leave tools.tools empty")

        def make(**kw):
            return TRLEnvironment(found(), **kw)
    else:
        raise ToolError(f"environment {spec!r} is a {type(found).__name__}, not a class")
    try:
        probe = make()
    except ToolError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's constructor, named
        raise ToolError(f"environment {spec!r}: building one failed: {type(e).__name__}: {e}") from e
    if not getattr(probe, "tools", None):
        raise ToolError(f"environment {spec!r} has no tools: set tools.tools or give the environment public methods")
    return make, probe.tools


def run_episode(env: Environment, row: dict, policy: Callable[[list[dict]], str]) -> tuple[list[dict], list[str], float]:
    """The reference multi-turn loop: ``policy(messages) -> text`` each turn until ``done``. Returns the
    conversation (as the policy saw it, plus its last turn), the turn texts and the final reward."""
    messages = list(env.reset(row))
    texts: list[str] = []
    while True:
        text = policy(messages)
        texts.append(text)
        observation, reward, done = env.step(text)
        messages += [{"role": "assistant", "content": text}] + observation
        if done:
            return messages, texts, reward
