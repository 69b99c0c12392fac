"""Tool results as chat messages, and the text a chat template appends for them.

Messages follow TRL's shape: ``{"role": "tool", "name": ..., "content": ...}`` where ``content`` is the text,
or, when the tool returned images, a list of parts (``{"type": "image", "image": <PIL>}`` first, then
``{"type": "text", "text": ...}``) that VLM chat templates turn into the family's image tokens.

Templates and the tool role: only a template that handles ``role == "tool"`` itself (the Qwen2.5 / Qwen3 text
templates turn it into a user turn of ``<tool_response>`` blocks) gets ``role: tool`` messages. A template that
prints any role name as given (Qwen2.5-VL's, and the tiny copy in ``vlmrl.tiny_models.tiny``) would write
``<|im_start|>tool``, a role header the checkpoint never saw in training; one that knows only user / assistant
(the LLaVA-1.5 style template) would print the result as an ASSISTANT turn, i.e. as the model's own words. For
both, ``tool_role_mode`` says ``"user"``: a turn's results go in one user message, each wrapped in
``<tool_response>...</tool_response>`` with its images inside the tags, close to the layout of Qwen's tool templates.
"""

from __future__ import annotations

import re

from vlmrl.data.template_budget import bounded, checked_size, template_source
from vlmrl.tools.execute import ToolResult

TOOL_ROLE_RE = re.compile(r"""['"]tool['"]""")
PARSE_ERROR_NAME = "tool_call_parser"


class ToolTemplateError(ValueError):
    """The chat template cannot render a tool turn as a pure suffix of the conversation."""


def tool_message(result: ToolResult) -> dict:
    """The ``role: tool`` message for one result; an error result's content is its error text."""
    text = result.error if result.error is not None else result.text
    if not result.images:
        return {"role": "tool", "name": result.name, "content": text}
    parts = [{"type": "image", "image": im} for im in result.images]
    if text:
        parts.append({"type": "text", "text": text})
    return {"role": "tool", "name": result.name, "content": parts}


def parse_error_message(errors: list[str]) -> dict:
    """One tool message telling the model its tool call(s) could not be read."""
    return {"role": "tool", "name": PARSE_ERROR_NAME, "content": "\n".join(f"could not read a tool call: {e}" for e in errors)}


def chat_template_of(processor) -> str:
    """The chat template string of a processor or tokenizer (the processor's own first, then its tokenizer's)."""
    for owner in (processor, getattr(processor, "tokenizer", None)):
        template = getattr(owner, "chat_template", None) if owner is not None else None
        if isinstance(template, dict):
            template = template.get("default")
        if isinstance(template, str) and template:
            return template
    raise ToolTemplateError(f"{type(processor).__name__} has no chat template; tool turns need one")


def tool_role_mode(template: str) -> str:
    """``"tool"`` when the template names the tool role (so handles it), else ``"user"`` (the fallback above)."""
    return "tool" if TOOL_ROLE_RE.search(template) else "user"


def _parts(content) -> list:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def for_template(tool_messages: list[dict], mode: str) -> list[dict]:
    """Tool messages as the template should see them: unchanged in ``"tool"`` mode; in ``"user"`` mode, all of
    them in one user message, each result (images, then text) wrapped in ``<tool_response>`` tags."""
    if mode == "tool":
        return list(tool_messages)
    if mode != "user":
        raise ValueError(f"mode must be 'tool' or 'user', got {mode!r}")
    parts = []
    for m in tool_messages:
        images = [p for p in _parts(m["content"]) if p.get("type") == "image"]
        text = "".join(p.get("text", "") for p in _parts(m["content"]) if p.get("type") == "text")
        parts += [{"type": "text", "text": "<tool_response>\n"}, *images, {"type": "text", "text": f"{text}\n</tool_response>"}]
    return [{"role": "user", "content": parts}]


def render_tool_turn(processor, tool_messages: list[dict], mode: str | None = None) -> str:
    """The text the chat template appends after an assistant turn for ``tool_messages``, generation prompt for
    the next assistant turn included: the part the engine tokenises and appends to a paused row (earlier turns
    are never re-rendered). Raises ToolTemplateError when the template renders the earlier turns differently
    once a tool turn follows (then the suffix is not well defined)."""
    template = chat_template_of(processor)
    mode = mode or tool_role_mode(template)
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    where = template_source(processor)
    with bounded(where):  # the chat template renders under the budget (template_budget.py)
        before = checked_size(processor.apply_chat_template(base, tokenize=False, chat_template=template), where)
        conversation = base + for_template(tool_messages, mode)
        after = checked_size(processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, chat_template=template), where)
    if not after.startswith(before):
        raise ToolTemplateError(
            "the chat template renders earlier turns differently once a tool turn follows, so a tool turn cannot be appended "
            "as tokens; use a template whose rendering of a conversation is a prefix of its rendering of any continuation"
        )
    return after[len(before) :]
