"""Dataset layouts of other trainers, recognised from their columns and read as they ship.

A data file's rows are turned into vlmrl rows (``problem``, ``solution``, ``image``/``images``) with the prompt
kept as chat messages in ``_messages`` when the layout has them, so system messages, several turns and the
position of each image survive. Every original column stays, so the peer's reward functions get what they read.

Layouts (``data.format``; ``auto`` recognises them from the columns of the file's rows):

- ``vlmrl``: ``problem`` + ``solution`` (also TRL's hub-style data with extra columns).
- ``trl``: a ``prompt`` column, a string (TRL's standard form) or chat messages (conversational form) whose
  content lists ``{"type": "image"}`` / ``{"type": "text"}`` blocks; images in ``image`` / ``images``.
- ``conversations``: ``conversations`` of ``{"from": "human"|"gpt"|"system", "value"}`` turns with ``<image>``
  placeholders: VLM-R1's JSONL when every row has one question and one answer, LLaVA-Instruct when rows have
  several turns. The last assistant turn is the solution, the turns before it the prompt.
- ``messages``: ms-swift / OpenAI-style ``messages`` of ``{"role", "content"}``; the solution is the
  ``solution`` column, else the last assistant message, else the ``answer`` column. MM-EUREKA's rows (``message``: the
  turns as a JSON string, images inline as ``{"type": "image", "image": "file:///abs/path"}``, ``answer``) read the same.
- ``easyr1``: ``problem`` (with ``<image>`` placeholders) + ``answer`` + ``images``.
- imagefolder: a folder (or its ``metadata.jsonl``) whose rows name their image in ``file_name``; the other
  columns then follow one of the layouts above.

``<image>`` / ``<video>`` placeholders (in text, or as content blocks) put each image where it stands; a row
without any keeps its images before the text. `placeholder_counts` counts them for validation.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vlmrl.config import DATA_FORMATS as FORMATS, MAPPABLE_COLUMNS as MAPPABLE  # noqa: F401 - MAPPABLE re-exported

# Columns that hold a whole prompt; two of them in one row leave the prompt to a guess.
PROMPT_COLUMNS = ("prompt", "messages", "conversations")
LAYOUT_OF_COLUMN = {"prompt": "trl", "messages": "messages", "conversations": "conversations", "message": "messages"}
PLACEHOLDER_RE = re.compile(r"(<image>|<video>)")
ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system", "bot": "assistant"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
# Columns a peer's loader adds to rows that vlmrl also adds (so the guard against lost images ignores them).
ADDED_COLUMNS = ("image_path", "accu_reward_method", "image_grid_thw")


class FormatError(ValueError):
    """The rows of a file cannot be read in any one layout (the message is one line naming the file)."""


# ---------------------------------------------------------------------------------------------------
# Detection


def decoded_turns(value: Any) -> Any:
    """A list of turns as given, or decoded from the JSON string MM-EUREKA / OpenRLHF store it as (``"message":
    "[{\\"role\\": \\"user\\", ...}]"``); anything else is returned unchanged (and judged where it is read)."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _prompt_columns(row: dict) -> list[str]:
    """The columns of `row` that hold a whole prompt; MM-EUREKA's ``message`` counts only when it holds a list of
    turns (a JSON string of one), so a plain ``message`` text column stays an extra column."""
    present = [k for k in PROMPT_COLUMNS if row.get(k) is not None]
    if isinstance(decoded_turns(row.get("message")), list):
        present.append("message")
    return present


def row_layout(row: dict) -> str | None:
    """The layout one row's columns fit, None when none does; FormatError text (via ValueError) when two prompt
    columns compete."""
    present = _prompt_columns(row)
    if len(present) > 1:
        raise ValueError(f"has both {present[0]!r} and {present[1]!r} columns, each a whole prompt")
    if present:
        return LAYOUT_OF_COLUMN[present[0]]
    if "problem" in row and "solution" not in row and "answer" in row:
        return "easyr1"
    if "problem" in row:
        return "vlmrl"
    return None


def detect_layout(rows: list[dict], name: str) -> str:
    """The one layout of a file's rows; FormatError (one line) when rows compete or disagree."""
    seen: dict[str, str] = {}
    for row in rows:
        if "_malformed" in row:
            continue
        try:
            layout = row_layout(row)
        except ValueError as e:
            raise FormatError(
                f"{row.get('_source', name)}: ambiguous format: the row {e}; set data.format to {' or '.join(_layouts_for(row))}"
            ) from None
        if layout is not None:
            seen.setdefault(layout, row.get("_source", name))
    if len(seen) > 1:
        (a, at), (b, bt) = list(seen.items())[:2]
        raise FormatError(f"{name}: ambiguous format: rows are in two layouts ({a} at {at}, {b} at {bt}); use one layout per file")
    return next(iter(seen), "vlmrl")


def _layouts_for(row: dict) -> list[str]:
    return [LAYOUT_OF_COLUMN[k] for k in _prompt_columns(row)]


# The two names of one row field: mapping one onto the other moves the column (both set would be a conflict).
TWIN_COLUMNS = {"image": "images", "images": "image", "video": "videos", "videos": "video"}


def apply_columns(row: dict, columns: dict[str, str]) -> dict:
    """`row` with data.columns applied: ``{"problem": "question"}`` copies the ``question`` column to ``problem``
    (the original column stays, for reward functions that read it). ``{"images": "image"}`` moves the column: a row
    with both ``image`` and ``images`` is refused as ambiguous."""
    if not columns:
        return row
    out = dict(row)
    for target, source in columns.items():
        if source in row:
            out[target] = row[source]
            if TWIN_COLUMNS.get(target) == source:
                out.pop(source, None)
    return out


# ---------------------------------------------------------------------------------------------------
# Turning rows into vlmrl rows


def to_blocks(content: Any) -> tuple[list[dict], list[str]]:
    """A message content as vlmrl's blocks (``{"type": "text", "text"}``, ``{"type": "image"}``, ``{"type": "video"}``),
    placeholders split where they stand, and the image paths the blocks name inline (OpenAI's image_url, ms-swift's
    ``{"type": "image", "image": path}``)."""
    blocks: list[dict] = []
    inline: list[str] = []
    parts = [content] if isinstance(content, str) else content if isinstance(content, list) else [str(content)]
    for part in parts:
        if isinstance(part, str):
            blocks += split_placeholders(part)
            continue
        if not isinstance(part, dict):
            blocks.append({"type": "text", "text": str(part)})
            continue
        kind = part.get("type")
        if kind == "text" or (kind is None and "text" in part):
            blocks += split_placeholders(str(part.get("text") or ""))
        elif kind in ("image", "image_url", "video"):
            blocks.append({"type": "video" if kind == "video" else "image"})
            url = part.get("image_url")
            ref = part.get(kind) if kind != "image_url" else (url.get("url") if isinstance(url, dict) else url)
            if isinstance(ref, str) and ref:
                inline.append(ref)
        else:
            blocks.append({"type": "text", "text": str(part)})
    return blocks, inline


def split_placeholders(text: str) -> list[dict]:
    """'<image>What is it?' -> [image block, text block]; empty text pieces are dropped."""
    out = []
    for piece in PLACEHOLDER_RE.split(text):
        if piece == "<image>":
            out.append({"type": "image"})
        elif piece == "<video>":
            out.append({"type": "video"})
        elif piece:
            out.append({"type": "text", "text": piece})
    return out


def blocks_text(blocks: list[dict]) -> str:
    """The text of blocks, placeholders left out (what a reward sees as the question)."""
    return "".join(b["text"] for b in blocks if b["type"] == "text")


def _turns(messages: Any, source: str) -> list[dict]:
    """Chat turns as ``{"role", "content": blocks, "inline": paths}``; ValueError naming the problem."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"expected a non-empty list of turns, got {type(messages).__name__}")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"turn {i} is a {type(m).__name__}, expected an object")
        role = ROLE_OF.get(str(m.get("role", m.get("from", ""))).lower())
        if role is None:
            raise ValueError(f"turn {i} has role {m.get('role', m.get('from'))!r}; expected user/human, assistant/gpt or system")
        content = m.get("content", m.get("value"))
        if content is None:
            raise ValueError(f"turn {i} has no content/value")
        blocks, inline = to_blocks(content)
        turns.append({"role": role, "content": blocks, "inline": inline})
    return turns


def _message_row(row: dict, key: str, layout: str, label: str) -> dict:
    """Rows whose prompt is a list of turns (conversations, messages, TRL conversational)."""
    out = dict(row)
    try:
        turns = _turns(decoded_turns(row[key]), row.get("_source", "?"))
    except ValueError as e:
        return {**row, "_malformed": f"{key}: {e}"}
    prompt = turns[:-1] if turns[-1]["role"] == "assistant" and layout != "trl" else turns
    solution = _message_solution(row, turns, prompt is not turns, layout, label)
    if solution is not None:
        out["solution"] = solution
    if not prompt or prompt[-1]["role"] != "user":
        return {**row, "_malformed": f"{key}: the prompt must end with a user turn"}
    if row.get("problem") is None:
        out["problem"] = blocks_text(prompt[-1]["content"]).strip()
    inline = [p for t in prompt for p in t["inline"]]
    if inline and row.get("image") is None and row.get("images") is None:
        out["images"] = inline
    out["_messages"] = [{"role": t["role"], "content": t["content"]} for t in prompt]
    if any(t["role"] == "assistant" for t in turns):
        out["_conversation"] = [{"role": t["role"], "content": t["content"]} for t in turns]
    out["_conversational"] = True
    return out


def _message_solution(row: dict, turns: list, answered: bool, layout: str, label: str):
    """The row's solution: its own, else the answer turn (`answered`: the last turn is the assistant's, cut from the
    prompt; VLM-R1 rewraps it), else MM-EUREKA's `answer` beside `message`; None when there is none."""
    if row.get("solution") is not None:
        return row["solution"]
    if answered:
        answer = blocks_text(turns[-1]["content"])
        return _vlmr1_solution(answer) if label == "vlm-r1" else answer
    if row.get("answer") is not None and layout == "messages":
        return row["answer"]  # MM-EUREKA's rows: the prompt in `message`, the answer beside it
    return None


def _vlmr1_solution(answer: str) -> str:
    """VLM-R1's loader strips <answer> tags from the answer turn and wraps the text in them again."""
    inner = answer.replace("<answer>", "").replace("</answer>", "").strip()
    return f"<answer> {inner} </answer>"


def normalize_rows(
    rows: list[dict], name: str, layout: str = "auto", columns: dict[str, str] | None = None, template: str | None = None
) -> tuple[list[dict], str]:
    """(vlmrl rows, the layout's label for reports) for a file's rows; FormatError for ambiguity or lost images."""
    rows = [apply_columns(r, columns or {}) if "_malformed" not in r else r for r in rows]
    if layout == "auto":
        layout = detect_layout(rows, name)
    elif layout not in FORMATS:
        raise FormatError(f"data.format={layout!r} is not one of auto, {', '.join(FORMATS)}")
    label = layout
    if layout == "conversations":
        turns = [len(r.get("conversations") or []) for r in rows if "_malformed" not in r]
        label = "vlm-r1 conversations" if turns and max(turns) <= 2 else "llava-instruct conversations"
    elif layout == "trl":
        first = next((r.get("prompt") for r in rows if "_malformed" not in r), None)
        label = "trl conversational" if isinstance(first, list) else "trl standard"
    render = easyr1_prompt_template(template) if template else None
    out = [_normalize_row(r, layout, label, render) if "_malformed" not in r else r for r in rows]
    refuse_lost_images(out, name, label)
    return out, label


def _normalize_row(row: dict, layout: str, label: str, render) -> dict:
    if layout == "conversations":
        out = _message_row(row, "conversations", layout, "vlm-r1" if label.startswith("vlm-r1") else "llava")
        if label.startswith("vlm-r1") and "_malformed" not in out:
            out.setdefault("accu_reward_method", "default")  # the column VLM-R1's loader adds for its accuracy reward
    elif layout == "messages":
        out = _message_row(row, "messages" if row.get("messages") is not None else "message", layout, "messages")
    elif layout == "trl" and isinstance(row.get("prompt"), list):
        out = _message_row(row, "prompt", layout, "trl")
    else:
        out = dict(row)
        if layout == "easyr1" and row.get("solution") is None:
            out["solution"] = row.get("answer")
        text = row.get("prompt") if layout == "trl" else row.get("problem")
        if layout == "trl" and row.get("problem") is None:
            out["problem"] = text
        if isinstance(text, str):
            out["_prompt_text"] = text
    if render is not None and "_malformed" not in out:
        out = _apply_template(out, render)
    return out


def easyr1_prompt_template(text: str):
    """EasyR1's format_prompt: a jinja template rendered with ``content`` = the user's text (placeholders kept)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from vlmrl.data.template_budget import bounded, checked_size

    try:
        template = ImmutableSandboxedEnvironment().from_string(text.strip())  # as transformers renders chat templates
    except jinja2.TemplateError as e:
        raise FormatError(f"data.prompt_template: not a valid jinja template: {e}") from None

    def render(**values) -> str:
        with bounded("data.prompt_template"):  # a template that loops or bloats ends in one line (template_budget.py)
            return checked_size(template.render(**values), "data.prompt_template")

    return render


def _apply_template(row: dict, render) -> dict:
    out = dict(row)
    if "_messages" in row:
        messages = [dict(m) for m in row["_messages"]]
        last = messages[-1]
        text = "".join("<image>" if b["type"] == "image" else "<video>" if b["type"] == "video" else b["text"] for b in last["content"])
        last["content"] = split_placeholders(render(content=text))
        out["_messages"] = messages
    elif isinstance(row.get("_prompt_text"), str):
        out["_prompt_text"] = render(content=row["_prompt_text"])
    return out


# ---------------------------------------------------------------------------------------------------
# Guards


def refuse_lost_images(rows: list[dict], name: str, label: str) -> None:
    """FormatError when a row has no image but a column that names an image file: training it text-only would
    drop its images in silence."""
    for row in rows:
        if "_malformed" in row or any(row.get(k) for k in ("image", "images", "video", "videos")):
            continue
        found = _image_like_column(row)
        if found is not None:
            key, value = found
            raise FormatError(
                f"{row.get('_source', name)}: column {key!r} ({value!r}) names an image, but the {label} layout reads images from "
                f"image/images; map it with data.columns.image={key} (data.columns.images={key} for a list), or the rows train without images"
            )


def _image_like_column(row: dict) -> tuple[str, Any] | None:
    for key, value in row.items():
        if key.startswith("_") or key in ADDED_COLUMNS:
            continue
        values = value if isinstance(value, list) else [value]
        if values and all(isinstance(v, str) and v.lower().endswith(IMAGE_SUFFIXES) for v in values):
            return key, value
    return None


def placeholder_counts(row: dict) -> tuple[int, int]:
    """(image, video) placeholders of a row's prompt: image/video blocks of ``_messages``, else ``<image>`` /
    ``<video>`` in its prompt text."""
    if "_messages" in row:
        blocks = [b for m in row["_messages"] for b in m["content"]]
    else:
        text = row.get("_prompt_text", row.get("problem"))
        blocks = split_placeholders(text) if isinstance(text, str) else []
    return sum(b["type"] == "image" for b in blocks), sum(b["type"] == "video" for b in blocks)


# ---------------------------------------------------------------------------------------------------
# The prompt a row becomes


def prompt_messages_of(row: dict, num_images: int, num_videos: int, system_prompt: str | None = None) -> list[dict]:
    """The chat the model is prompted with: the row's own turns (or its text), images and videos where their
    placeholders stand (before the text when it has none, at most `num_images` / `num_videos` of them), and
    data.system_prompt first unless the row brings its own system turn."""
    if "_messages" in row:
        messages = [{"role": m["role"], "content": list(m["content"])} for m in row["_messages"]]
    else:
        text = row.get("_prompt_text", row.get("problem"))
        messages = [{"role": "user", "content": split_placeholders(text if isinstance(text, str) else "")}]
    messages = _keep_media(messages, num_images, num_videos)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    for m in messages:  # templates that take plain strings for text-only turns read these too
        if not m["content"]:
            m["content"] = [{"type": "text", "text": ""}]
    return messages


def _keep_media(messages: list[dict], num_images: int, num_videos: int) -> list[dict]:
    """Keep the first `num_images` image blocks (and videos); with no placeholders at all, put the media first in the
    first user turn."""
    has = {t: any(b["type"] == t for m in messages for b in m["content"]) for t in ("image", "video")}
    left = {"image": num_images, "video": num_videos}
    for m in messages:
        kept = []
        for b in m["content"]:
            if b["type"] in left:
                if left[b["type"]] <= 0:
                    continue
                left[b["type"]] -= 1
            kept.append(b)
        m["content"] = kept
    first_user = next((m for m in messages if m["role"] == "user"), messages[-1])
    front = [{"type": "image"}] * (num_images if not has["image"] else 0) + [{"type": "video"}] * (num_videos if not has["video"] else 0)
    first_user["content"] = [dict(b) for b in front] + first_user["content"]
    return messages
