"""How a reward function is called: TRL's signature, its keyword arguments, the conversational form, async rewards.

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
import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable


RewardFn = Callable[..., list]


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


def run_coroutines(coros: list) -> list:
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


def call_once(fn: RewardFn, kwargs: dict) -> Any:
    """`fn(**kwargs)`, awaited when it is async."""
    raw = fn(**kwargs)
    if inspect.isawaitable(raw):
        (raw,) = run_coroutines([raw])
        if isinstance(raw, BaseException):
            raise raw
    return raw
