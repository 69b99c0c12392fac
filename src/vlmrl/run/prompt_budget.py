"""The prompt budget: every row's prompt length in tokens, image tokens included, measured before any weights load.

A prompt is never cut (cutting would cut image tokens, and the model's image features would no longer match its
image tokens): a row over the budget is dropped and counted (data.skip_bad_rows=true, listed in bad_rows.jsonl) or
refused in one line naming its file:line and lengths. The budget is data.max_prompt_length, else the model's context
(max_position_embeddings in config.json): a prompt longer than the context is never what a user meant, and a 2 MB
prompt otherwise reaches the model (one attention over ~10^6 tokens).

The count is exact for the processor the run uses: the row's chat-template text through its tokenizer, plus, per
image, the tokens the processor adds for an image of that size (measured once per size on a blank image of the size
the image is resized to). Very long texts are counted in chunks and the count stops once it is past the budget, so
a 200 MB row is refused without tokenizing 200 MB (that took more than 8 GiB). Video tokens are not counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vlmrl.data.errors import DataError
from vlmrl.data.validation import Problem, ValidationReport
from vlmrl.data.media import target_size
from PIL import Image

CHUNK_CHARS = 100_000  # texts longer than this are counted chunk by chunk, stopping past the budget


@dataclass
class PromptLengths:
    """The measured rows: the longest prompt (tokens in all, its text tokens, its row) and the rows over budget."""

    longest: int = 0
    longest_text: int = 0
    longest_source: str = ""
    over: list[tuple[str, str]] = field(default_factory=list)  # (source, why) of rows over the budget
    budget: str = ""  # what the budget is (prompt_budget)

    def describe(self) -> str:
        """The line `check` and `train` print about the prompts."""
        if not self.longest_source:
            return f"prompts: budget {self.budget}"
        images = self.longest - self.longest_text
        return (
            f"prompts: the longest is {self.longest:,} tokens ({self.longest_text:,} text + {images:,} image tokens, "
            f"{self.longest_source}); budget {self.budget}"
        )


def context_length(model_folder: str | Path) -> int | None:
    """max_position_embeddings of the model's text config (config.json), None when it does not say."""
    try:
        config = json.loads((Path(model_folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for part in (config.get("text_config"), config.get("llm_config"), config):
        value = part.get("max_position_embeddings") if isinstance(part, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def prompt_budget(cfg) -> tuple[int | None, str]:
    """(limit, what it is) for the prompt length: data.max_prompt_length, else the model's context."""
    if cfg.data.max_prompt_length is not None:
        return cfg.data.max_prompt_length, f"data.max_prompt_length={cfg.data.max_prompt_length}"
    from vlmrl.models.loading import resolve_model_path

    n = context_length(resolve_model_path(cfg.model.name_or_path))
    return n, f"the model's context of {n} tokens (max_position_embeddings; data.max_prompt_length sets another budget)"


def _tokenizer(processor):
    from vlmrl.models.processing import tokenizer_of

    return tokenizer_of(processor)


def count_text_tokens(tokenizer, text: str, stop_above: int | None) -> tuple[int, bool]:
    """(tokens, exact) of `text`. A text over CHUNK_CHARS is counted chunk by chunk (split at whitespace) and the
    count stops once it passes `stop_above` plus one token per chunk (a chunk boundary can add one): then it is a
    lower bound of the text's length, and exact is False."""
    if len(text) <= CHUNK_CHARS or stop_above is None:
        return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]), True
    n, start, chunks = 0, 0, 0
    while start < len(text):
        end = min(len(text), start + CHUNK_CHARS)
        if end < len(text):
            cut = text.rfind(" ", start + CHUNK_CHARS // 2, end)
            end = cut if cut > start else end
        n += len(tokenizer(text[start:end], add_special_tokens=False, verbose=False)["input_ids"])
        start, chunks = end, chunks + 1
        if n > stop_above + chunks:
            return n - chunks, False
    return n, False


class PromptCounter:
    """Prompt tokens of rows for one processor: text tokens + the tokens each image adds, per image size, measured once."""

    def __init__(self, processor, cfg, sizes: dict | None = None):
        self.processor, self.tokenizer, self.d, self.model = processor, _tokenizer(processor), cfg.data, cfg.model.name_or_path
        self.sizes = sizes or {}  # image path -> (width, height), as validation read them (else the header is read)
        self._image_tokens: dict[tuple[int, int], tuple[int, int]] = {}
        self._probe_text: str | None = None
        from vlmrl.run.tool_rollout import tool_schemas

        self.tools = tool_schemas(cfg)  # the prompt the run encodes describes its tools (run.datasets.encode_rows)
        token = getattr(processor, "image_token", None)
        self.image_token_id = getattr(processor, "image_token_id", None) or (self.tokenizer.convert_tokens_to_ids(token) if token else None)

    def image_tokens(self, size: tuple[int, int]) -> tuple[int, int]:
        """(tokens one image of `size`, after vlmrl's resize, adds to a prompt: the processor's count with the image
        minus the text's, its image tokens: those of the processor's image token id, the rest being markers the
        image brings along such as Gemma 3's start/end; without an image token id, all of them)."""
        if size not in self._image_tokens:
            from vlmrl.models.processing import encode_prompts

            if self._probe_text is None:
                self._probe_text = self.render({"problem": "x", "_source": "a one-image prompt"}, 1, 0)
            batch = encode_prompts(self.processor, [self._probe_text], [[Image.new("RGB", size)]])
            added = int(batch["attention_mask"].sum()) - len(self.tokenizer(self._probe_text, verbose=False)["input_ids"])
            # The text's own placeholder (Qwen's one <|image_pad|>) is one of the image's tokens, not text: counting
            # image tokens as "added" tokens put it on the text side, one per image (issue 35, finding 13).
            ids = batch["input_ids"][batch["attention_mask"].bool()]
            image = int((ids == self.image_token_id).sum()) if self.image_token_id is not None else added
            self._image_tokens[size] = (added, image)
        return self._image_tokens[size]

    def render(self, row: dict, images: int, videos: int) -> str:
        """The row's chat-template text; a template that raises is the model folder's error, in one line (as
        preflight.check_chat_template words it)."""
        from vlmrl.data.template_budget import TemplateBudgetError
        from vlmrl.models.loading import ModelLoadError
        from vlmrl.models.processing import build_row_prompt

        try:
            return build_row_prompt(self.processor, row, images, self.d.system_prompt, videos, self.tools)
        except TemplateBudgetError:  # already one line naming the template's file
            raise
        except Exception as e:  # any error from the user's template is the template's
            raise ModelLoadError(
                f"the chat template of {self.model} fails on {row.get('_source', 'a data row')}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}; fix chat_template.jinja (or chat_template in tokenizer_config.json)"
            ) from None

    def image_size(self, path: str) -> tuple[int, int]:
        """The size `path` is resized to (data.min_pixels / max_pixels), as encode_rows resizes it."""
        if path not in self.sizes:
            from vlmrl.data.images import oriented_size

            with Image.open(path) as im:
                self.sizes[path] = oriented_size(im)
        return target_size(*self.sizes[path], self.d.min_pixels, self.d.max_pixels)

    def row(self, row: dict, limit: int | None) -> tuple[int, int, int | None]:
        """(tokens in all, text tokens, None) of a row's prompt; past `limit` on its raw text alone: (a lower bound of
        its tokens, the same, its characters), counting stopped there."""
        from vlmrl.data.formats import prompt_messages_of

        images = list(row.get("images") or [])[: self.d.limit_images]
        videos = len(row.get("videos") or [])
        if limit is not None:  # a huge text: refused on its raw text, before the chat template copies it
            raw = "".join(b.get("text", "") for m in prompt_messages_of(row, len(images), videos) for b in m["content"])
            if len(raw) > CHUNK_CHARS:
                n, exact = count_text_tokens(self.tokenizer, raw, limit)
                if not exact and n > limit:
                    return n, n, len(raw)
        text = self.render(row, len(images), videos)
        counts = [self.image_tokens(self.image_size(p)) for p in images]
        n_all = len(self.tokenizer(text, verbose=False)["input_ids"]) + sum(added for added, _ in counts)
        return n_all, n_all - sum(image for _, image in counts), None


def measure_prompts(processor, cfg, rows: list[dict], limit: int | None, sizes: dict | None = None) -> PromptLengths:
    """Every row's prompt length against `limit` (None: measured, nothing over). `sizes`: validation's image sizes."""
    counter, out = PromptCounter(processor, cfg, sizes), PromptLengths()
    for row in rows:
        n, n_text, chars = counter.row(row, limit)
        source = row.get("_source", "?")
        if limit is not None and n > limit:
            what = f"{n:,} tokens ({n_text:,} text + {n - n_text:,} image tokens)"
            if chars is not None:
                what = f"at least {n:,} tokens ({chars:,} characters of text; counting stopped there)"
            out.over.append((source, f"the prompt is {what}"))
        elif n > out.longest:
            out.longest, out.longest_text, out.longest_source = n, n_text, source
    return out


def apply_prompt_budget(processor, cfg, rows: list[dict], report: ValidationReport, label: str) -> tuple[list[dict], PromptLengths]:
    """The rows within the budget, and their lengths. Over-budget rows: DataError naming the first (one line), or
    with data.skip_bad_rows dropped and counted in `report` (kind prompt_too_long, so bad_rows.jsonl lists them)."""
    limit, what = prompt_budget(cfg)
    lengths = measure_prompts(processor, cfg, rows, limit, report.image_sizes)
    lengths.budget = what if limit is not None else "none (data.max_prompt_length is unset and the model's config.json names no context length)"
    if not lengths.over:
        return rows, lengths
    fix = "image tokens are never cut: shorten the prompt, lower data.max_pixels, raise the budget, or set data.skip_bad_rows=true to drop such rows"
    if not cfg.data.skip_bad_rows:
        source, why = lengths.over[0]
        more = f" ({len(lengths.over) - 1} more rows of {label} are over it too)" if len(lengths.over) > 1 else ""
        raise DataError(f"{source}: {why}, over the prompt budget: {what}{more}; {fix}")
    dropped = {source for source, _ in lengths.over}
    for source, why in lengths.over:
        report.problems.append(Problem(source, "prompt", f"{why}, over {what}", "prompt_too_long"))
    kept = [r for r in rows if r.get("_source", "?") not in dropped]
    report.skipped_rows += len(rows) - len(kept)
    report.kept_rows = len(kept)
    report.num_images -= sum(len(r.get("images") or []) for r in rows if r.get("_source", "?") in dropped)
    if not kept:
        raise DataError(f"{label}: no usable rows: every row's prompt is over the budget ({what})")
    return kept, lengths
