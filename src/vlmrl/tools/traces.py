"""Tool-use conversations as SFT rows: the warm start before GRPO with tools.

A finished conversation (the prompt, the model's turns, the tool turns with the images tools returned) is written as
rows of the ``messages`` layout (formats.py), one row per image-bearing tool turn plus the last answer: row k holds
the conversation up to the k-th cut, so every image of it sits in its prompt, where the processor expands image
tokens. SFT trains the assistant turns after a row's last image (models/conversations.py), so across the rows each
assistant turn is trained exactly once, on the same context it has in the whole conversation, and the tool turns
(text and images) are never trained: the loss of a masked multi-turn sequence, computed as a few prompt/target
rows. (The shared prefix is forwarded once per row instead of once: compute, not a different loss.)

Tool turns are written as the chat template sees them (render.for_template): for templates without a tool role, one
user turn of ``<tool_response>`` blocks, the same text the rollout appends after a tool call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from PIL import Image

from vlmrl.tools.render import for_template, tool_message
from vlmrl.tools.execute import ToolCall, ToolResult


def tool_call_text(name: str, arguments: dict) -> str:
    """The Qwen / Hermes tool call the parser reads (parsing.py): ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def template_messages(messages: list[dict], mode: str) -> list[dict]:
    """`messages` with each run of ``role: tool`` messages as the template sees it (render.for_template)."""
    out: list[dict] = []
    run: list[dict] = []
    for m in [*messages, None]:
        if m is not None and m["role"] == "tool":
            run.append(m)
            continue
        if run:
            out += for_template(run, mode)
            run = []
        if m is not None:
            out.append(m)
    return out


def _has_image(message: dict) -> bool:
    content = message["content"]
    return not isinstance(content, str) and any(p.get("type") == "image" for p in content)


def _row_turns(messages: list[dict], save_image: Callable[[Image.Image], str]) -> tuple[list[dict], list[str]]:
    """Messages-layout turns (text with ``<image>`` placeholders) and the image paths, in order."""
    turns, images = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            turns.append({"role": m["role"], "content": content})
            continue
        text = ""
        for part in content:
            if part.get("type") == "image":
                image = part.get("image")
                images.append(image if isinstance(image, str) else save_image(image))
                text += "<image>"
            else:
                text += part.get("text", "")
        turns.append({"role": m["role"], "content": text})
    return turns, images


def sft_rows(messages: list[dict], save_image: Callable[[Image.Image], str], mode: str = "user", **columns) -> list[dict]:
    """SFT rows (``messages`` layout) of one finished conversation; see the module docstring. `messages`: vlmrl/TRL
    chat messages (tool turns as ``role: tool``, images as parts holding a PIL image or a path); `save_image` turns
    a PIL image into the path the row names; `columns` are copied into every row (e.g. solution)."""
    shown = template_messages(messages, mode)
    cuts = [i + 1 for i, m in enumerate(shown) if m["role"] == "assistant" and (i + 1 == len(shown) or _has_image(shown[i + 1]))]
    if shown[-1]["role"] != "assistant":
        raise ValueError("the conversation must end with an assistant turn")
    turns, images = _row_turns(shown, save_image)
    rows = []
    for cut in cuts:
        kept = turns[:cut]
        n_images = sum(t["content"].count("<image>") for t in kept)
        rows.append({"messages": kept, "images": images[:n_images], **columns})
    return rows


def expert_conversation(prompt: list[dict], calls: list[ToolCall], results: list[ToolResult], answer: str) -> list[dict]:
    """The conversation of a scripted expert: one assistant turn per call (its tool call text), the tool turn
    answering it, then `answer` as the last assistant turn."""
    messages = list(prompt)
    for call, result in zip(calls, results):
        messages.append({"role": "assistant", "content": tool_call_text(call.name, call.arguments)})
        messages.append(tool_message(result))
    messages.append({"role": "assistant", "content": answer})
    return messages


def image_saver(folder: str | Path, prefix: str) -> Callable[[Image.Image], str]:
    """A `save_image` for sft_rows: PNGs ``folder/<prefix>_<n>.png`` numbered in call order; returns absolute paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    count = [0]

    def save(image: Image.Image) -> str:
        path = folder / f"{prefix}_{count[0]}.png"
        count[0] += 1
        image.save(path, format="PNG")
        return str(path.resolve())

    return save
