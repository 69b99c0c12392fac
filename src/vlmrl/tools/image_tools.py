"""Built-in image tools: crop, zoom and rotate one of the conversation's images.

Each reads the image from the ``ToolContext`` (``image_index`` 0 is the row's first image, -1 the latest one a
tool returned) and returns ``(image, text)``. Bad boxes raise ValueError with a message meant for the model;
the executor turns it into an error observation naming the tool.
"""

from __future__ import annotations

import math

from PIL import Image

from vlmrl.tools.context import ToolContext

COORDINATES = ("pixel", "normalized", "normalized_1000")
MAX_ZOOM = 8.0
MAX_SIDE = 4096  # a zoomed image is never larger than this on either side (a huge image costs the engine memory)


def _pick(context: ToolContext | None, image_index: int) -> tuple[Image.Image, tuple[int, int] | None]:
    """The image and the (width, height) the model saw it at (None: as it is)."""
    images = context.images if context is not None else []
    if not images:
        raise ValueError("there is no image in the conversation to work on")
    if not isinstance(image_index, int) or isinstance(image_index, bool) or not -len(images) <= image_index < len(images):
        raise ValueError(f"image_index {image_index!r} is out of range: the conversation has {len(images)} image(s) (0 is the first, -1 the latest)")
    seen = context.seen_sizes
    return images[image_index], (seen[image_index] if seen else None)


def box_pixels(bbox_2d: list, width: int, height: int, coordinates: str = "pixel", seen: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """``[x1, y1, x2, y2]`` as a pixel box ``(left, top, right, bottom)`` for PIL's ``crop`` (right/bottom
    exclusive), covering the requested region (edges rounded outwards), corners put in order, clamped to the
    image. ``coordinates``: ``pixel``, ``normalized`` (0..1 of width/height), ``normalized_1000`` (0..1000, as
    Qwen2-VL writes boxes); ``seen``: the (width, height) the model saw the image at, which pixel boxes are
    written in. Raises ValueError for a box that is not four finite numbers or is empty once clamped."""
    if coordinates not in COORDINATES:
        raise ValueError(f"coordinates must be one of {', '.join(COORDINATES)}, got {coordinates!r}")
    if not isinstance(bbox_2d, (list, tuple)) or len(bbox_2d) != 4:
        raise ValueError(f"bbox_2d must be four numbers [x1, y1, x2, y2], got {bbox_2d!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox_2d):
        raise ValueError(f"bbox_2d must hold four finite numbers, got {bbox_2d!r}")
    pixel = (width / seen[0], height / seen[1]) if seen else (1.0, 1.0)
    scale = {"pixel": pixel, "normalized": (width, height), "normalized_1000": (width / 1000, height / 1000)}[coordinates]
    x1, x2 = sorted((bbox_2d[0] * scale[0], bbox_2d[2] * scale[0]))
    y1, y2 = sorted((bbox_2d[1] * scale[1], bbox_2d[3] * scale[1]))
    left, top = max(0, math.floor(x1)), max(0, math.floor(y1))
    right, bottom = min(width, math.ceil(x2)), min(height, math.ceil(y2))
    if right <= left or bottom <= top:
        raise ValueError(
            f"bbox_2d {list(bbox_2d)} ({coordinates}) is empty inside the {width}x{height} image; "
            "give a box with x1 < x2 and y1 < y2 that overlaps the image"
        )
    return left, top, right, bottom


def crop(bbox_2d: list[float], image_index: int = 0, coordinates: str = "pixel", *, context: ToolContext | None = None):
    """Crop a region of an image.

    Args:
        bbox_2d: The region as [x1, y1, x2, y2], top-left and bottom-right corners.
        image_index: Which image of the conversation: 0 is the first, -1 the latest.
        coordinates: How bbox_2d is written (choices: ["pixel", "normalized", "normalized_1000"])
    """
    image, seen = _pick(context, image_index)
    box = box_pixels(bbox_2d, image.width, image.height, coordinates, seen)
    out = image.crop(box)
    return out, f"cropped {list(box)} of the {image.width}x{image.height} image: {out.width}x{out.height}"


def zoom(bbox_2d: list[float], factor: float = 2.0, image_index: int = 0, coordinates: str = "pixel", *, context: ToolContext | None = None):
    """Zoom into a region of an image: crop it and enlarge it.

    Args:
        bbox_2d: The region as [x1, y1, x2, y2], top-left and bottom-right corners.
        factor: How much to enlarge the region, between 1 and 8.
        image_index: Which image of the conversation: 0 is the first, -1 the latest.
        coordinates: How bbox_2d is written (choices: ["pixel", "normalized", "normalized_1000"])
    """
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 1.0 <= factor <= MAX_ZOOM:
        raise ValueError(f"factor must be a number between 1 and {MAX_ZOOM:g}, got {factor!r}")
    region, _ = crop(bbox_2d, image_index, coordinates, context=context)
    factor = min(factor, MAX_SIDE / max(region.width, region.height))
    size = (max(1, round(region.width * factor)), max(1, round(region.height * factor)))
    out = region.resize(size, Image.Resampling.BICUBIC)
    return out, f"zoomed {region.width}x{region.height} region x{factor:g}: {out.width}x{out.height}"


def rotate(angle: float, image_index: int = 0, *, context: ToolContext | None = None):
    """Rotate an image counter-clockwise, enlarging the canvas so nothing is cut off.

    Args:
        angle: The rotation in degrees, counter-clockwise.
        image_index: Which image of the conversation: 0 is the first, -1 the latest.
    """
    if not isinstance(angle, (int, float)) or isinstance(angle, bool) or not math.isfinite(angle):
        raise ValueError(f"angle must be a finite number of degrees, got {angle!r}")
    image, _ = _pick(context, image_index)
    out = image.rotate(angle, expand=True)
    return out, f"rotated {angle:g} degrees: {out.width}x{out.height}"
