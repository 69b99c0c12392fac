"""An image file decoded as the user sees it in a viewer, as 8-bit RGB.

PIL's `convert("RGB")` alone gets several kinds of files wrong without a word, and so does transformers'
`load_image` for some of them:
- **EXIF orientation** (phone photos): the pixels are stored sideways and a tag says how to turn them; applied here
  (`ImageOps.exif_transpose`), as viewers and transformers do.
- **16-bit and 32-bit integer images** (16-bit grayscale PNG / TIFF open as mode I;16 or I): convert clips every
  value above 255, so the image turns white. Scaled here: 16-bit values (up to 65535) by 255/65535; 32-bit values
  beyond that by their maximum.
- **Float images** (mode F, e.g. float TIFF): values in [0, 1] clip to black. Scaled here: [0, 1] by 255; a wider
  range by its maximum (negative values are 0).
- **Animated images and multi-page files** (GIF, APNG, WebP, multi-page TIFF): convert keeps the first frame
  silently. Refused here (`still_image_problem`), as a bad row: which frame the user meant cannot be guessed;
  extract it (or give the frames as a video row).
- Transparency is composited onto white (Qwen-VL's loader does the same) instead of turning black.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageOps


def still_image_problem(im: Image.Image) -> str | None:
    """Why `im` is not one still image (animated or multi-page), or None."""
    frames = getattr(im, "n_frames", 1) or 1
    if frames > 1:
        kind = "multi-page" if (im.format or "").upper() == "TIFF" else "animated"
        return (
            f"{kind} {im.format or 'image'} with {frames} frames; vlmrl takes still images only (it would not guess which "
            "frame you mean): save the frame you want as its own file, or give the frames as a video row"
        )
    return None


def _scaled_to_8bit(im: Image.Image) -> Image.Image:
    """Mode I;16* / I / F as mode L, the value range mapped onto 0..255 (see the module docstring)."""
    values = np.asarray(im, dtype=np.float64)
    if im.mode == "F":
        top = float(np.nanmax(values)) if values.size else 1.0
        scale = 255.0 if top <= 1.0 else 255.0 / top
    else:
        top = float(values.max()) if values.size else 0.0
        scale = 255.0 / 65535.0 if top <= 65535 else 255.0 / top
    out = np.clip(np.nan_to_num(values) * scale, 0, 255).round().astype(np.uint8)
    return Image.fromarray(out, mode="L")


def to_rgb(im: Image.Image) -> Image.Image:
    """A loaded (`im.load()`) still image as 8-bit RGB, oriented and scaled as a viewer shows it; raises ValueError
    for an animated or multi-page file (still_image_problem)."""
    problem = still_image_problem(im)
    if problem is not None:
        raise ValueError(problem)
    im = ImageOps.exif_transpose(im)
    if im.mode.startswith("I") or im.mode == "F":
        im = _scaled_to_8bit(im)
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA"):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB") if im.mode != "RGB" else im.copy()


def oriented_size(im: Image.Image) -> tuple[int, int]:
    """(width, height) after the EXIF orientation is applied (orientations 5-8 turn the image by 90 degrees)."""
    try:
        orientation = im.getexif().get(0x0112, 1)
    except Exception:  # a broken EXIF block: exif_transpose leaves such an image as it is
        orientation = 1
    return (im.height, im.width) if orientation in (5, 6, 7, 8) else (im.width, im.height)
