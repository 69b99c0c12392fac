"""Every image a tool returns is checked before the model or the next tool sees it (issue 35, finding 10).

A tool's image is untrusted input: a 0x0 image made transformers' smart_resize divide by zero, a 10000x10 strip
made it raise (`absolute aspect ratio must be smaller than 200`), and a 10000x10000 image took 2.1 GB of host
memory in the processor, each ending the training run. So, per image:

- an image that cannot be read or converted to RGB, or that has no pixels, becomes an error result;
- an image over ``max_pixels`` is scaled down (aspect kept) to fit: tools work on what the context keeps;
- a side ratio the run's image processor refuses (``shape_check``, `models.processing.ImageShapeCheck`; at least
  smart_resize's 200:1, checked without a processor too) becomes an error result naming the size and the limit.

An error result replaces the whole call's result (its text included): the model is told why, in the tool's name.
"""

from __future__ import annotations

from typing import Callable

from PIL import Image

from vlmrl.data.media import target_size
from vlmrl.tools.execute import ToolResult

# transformers' smart_resize (Qwen-VL, GLM-4V) raises for a longer/shorter side ratio above this.
MAX_SIDE_RATIO = 200
DEFAULT_MAX_PIXELS = 4096 * 4096  # the zoom tool's own cap (image_tools.MAX_SIDE) on both sides


def _fail(result: ToolResult, message: str) -> ToolResult:
    return ToolResult(name=result.name, error=f"tool {result.name!r} failed: {message}")


def _check_one(image, max_pixels: int, shape_check: Callable | None) -> tuple[Image.Image | None, str]:
    """(the image to keep, "") or (None, why it is refused); a resize is noted in the second element as text."""
    try:
        w, h = image.size
        if w < 1 or h < 1:
            return None, f"it returned a {w}x{h} image, which has no pixels"
        note = ""
        if w * h > max_pixels:
            image = image.resize(target_size(w, h, None, max_pixels), Image.Resampling.BILINEAR)
            note = f"(image resized from {w}x{h} to {image.width}x{image.height}: tool images hold at most {max_pixels:,} pixels)"
        image = image if image.mode == "RGB" else image.convert("RGB")
        image.load()
    except Exception as e:  # noqa: BLE001 - a broken image is the tool's failure, shown to the model
        return None, f"its image could not be read ({type(e).__name__}: {' '.join(str(e).split())})"
    ratio = max(image.size) / min(image.size)
    if ratio > MAX_SIDE_RATIO:
        return None, f"it returned a {w}x{h} image, whose side ratio {ratio:.0f}:1 is over the {MAX_SIDE_RATIO}:1 the model's processor accepts"
    why = shape_check(*image.size) if shape_check is not None else None
    if why:
        return None, f"it returned a {w}x{h} image the model cannot be shown: {why}"
    return image, note


def check_tool_images(result: ToolResult, max_pixels: int = DEFAULT_MAX_PIXELS, shape_check: Callable | None = None) -> ToolResult:
    """`result` with every image readable, RGB, at most `max_pixels` pixels and of a shape the processor accepts;
    or an error result saying why not. `shape_check(width, height) -> reason | None`: the run's processor check."""
    if not result.ok or not result.images:
        return result
    images, notes = [], []
    for image in result.images:
        kept, note = _check_one(image, max_pixels, shape_check)
        if kept is None:
            return _fail(result, note)
        images.append(kept)
        notes += [note] if note else []
    text = "\n".join(t for t in [result.text, *notes] if t)
    return ToolResult(name=result.name, text=text, images=images)
