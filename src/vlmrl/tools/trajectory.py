"""A finished multi-turn rollout in TRL's conversational shape, as reward functions receive it.

``prompt`` is the list of messages the rollout started from (the row's images as ``{"type": "image"}`` parts);
``completion`` is everything after it: assistant messages (``content`` = the text outside tool calls,
``tool_calls`` = ``[{"type": "function", "function": {"name", "arguments"}}]``) and the ``role: tool`` messages
that answered them (images as parts). A reward function called with ``prompts=[t.prompt]`` and
``completions=[t.completion]`` sees what TRL would hand it; ``vlmrl.rewards.args.completion_text`` of the
completion is the last message's text, i.e. the final answer when the model ended with one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmrl.tools.execute import ToolCall
from vlmrl.tools.parsing import ParsedTurn

# The last three are set by the engine (models/multiturn.py): a token budget, or a turn ended by a non-template eos.
END_REASONS = ("answered", "max_turns", "image_budget", "turn_tokens", "total_tokens", "stop_token")


def assistant_message(parsed: ParsedTurn) -> dict:
    """The assistant message for one parsed turn (``tool_calls`` only when it made calls)."""
    message = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
    return message


def images_of(messages: list[dict]) -> list:
    """The images of a list of messages, in order (image parts of list contents)."""
    parts = [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if isinstance(p, dict)]
    return [p["image"] for p in parts if p.get("type") == "image"]


@dataclass
class Trajectory:
    """One rollout: messages, the model's own texts per turn, and how it ended."""

    prompt: list[dict]
    completion: list[dict] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)  # what the model generated each turn, verbatim
    reward: float | None = None
    end_reason: str = "answered"
    # Set by the engine (models/multiturn.py) and the plain loop (models/tool_loop.py): per assistant turn, the reward
    # its environment `step` returned when the step did not end the rollout (0.0 for the last turn: the rollout's
    # reward is `reward`, read by reward functions; and for a turn cut by a token budget), and what came back that was
    # not a finite number (counted as 0.0; repr, shortened).
    turn_rewards: list[float] = field(default_factory=list)
    bad_turn_rewards: list[str] = field(default_factory=list)

    @property
    def messages(self) -> list[dict]:
        return self.prompt + self.completion

    @property
    def images(self) -> list:
        """Every image in conversation order: the row's, then each one a tool returned."""
        return images_of(self.messages)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(c["function"]["name"], c["function"]["arguments"]) for m in self.completion for c in m.get("tool_calls", [])]

    @property
    def num_turns(self) -> int:
        return len(self.turn_texts)

    def reward_inputs(self) -> dict:
        """Keyword arguments for one TRL-style reward call over this trajectory."""
        return {"prompts": [self.prompt], "completions": [self.completion]}


def build_trajectory(
    prompt: list[dict], steps: list[tuple[ParsedTurn, str, list[dict]]], end_reason: str = "answered", reward: float | None = None
) -> Trajectory:
    """A Trajectory from the prompt and each turn's (parsed turn, raw text, observation messages)."""
    if end_reason not in END_REASONS:
        raise ValueError(f"end_reason must be one of {', '.join(END_REASONS)}, got {end_reason!r}")
    t = Trajectory(prompt=list(prompt), reward=reward, end_reason=end_reason)
    for parsed, text, observation in steps:
        t.turn_texts.append(text)
        t.completion.append(assistant_message(parsed))
        t.completion.extend(observation)
    return t
