"""Decoding images and videos for the model: resized to the run's pixel bounds under PIL's decompression-bomb limit, and
kept in a byte-budgeted cache shared by images and videos."""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator

from PIL import Image

from vlmrl.data.errors import DataError


# PIL's decompression-bomb guard, read once at import: the default of data.max_image_pixels.
DEFAULT_MAX_IMAGE_PIXELS = int(Image.MAX_IMAGE_PIXELS or 89_478_485)


def pixel_limit_problem(width: int, height: int, max_image_pixels: int) -> str | None:
    if width * height <= max_image_pixels:
        return None
    return (
        f"image is {width}x{height} = {width * height:,} pixels, over data.max_image_pixels={max_image_pixels:,} "
        "(the decompression-bomb guard); shrink the image or raise data.max_image_pixels"
    )


_pixel_limit_lock = threading.Lock()
_pixel_limit_depth = 0
_pixel_limit_saved: int | None = None


@contextmanager
def own_pixel_limit() -> Iterator[None]:
    """Switch PIL's global decompression-bomb check off while vlmrl opens images, because vlmrl checks the
    header size against data.max_image_pixels itself (which can then be larger than PIL's default).
    Nested and concurrent uses share one switch; the first one in saves PIL's value, the last one out restores it."""
    global _pixel_limit_depth, _pixel_limit_saved
    with _pixel_limit_lock:
        if _pixel_limit_depth == 0:
            _pixel_limit_saved = Image.MAX_IMAGE_PIXELS
            Image.MAX_IMAGE_PIXELS = None
        _pixel_limit_depth += 1
    try:
        yield
    finally:
        with _pixel_limit_lock:
            _pixel_limit_depth -= 1
            if _pixel_limit_depth == 0:
                Image.MAX_IMAGE_PIXELS = _pixel_limit_saved


# ---------------------------------------------------------------------------------------------------
# Images


def load_images(
    paths: list[str],
    min_pixels: int | None,
    max_pixels: int | None,
    *,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    cache: ImageCache | None = None,
) -> list[Image.Image]:
    """RGB images, resized (aspect ratio kept) so that min_pixels <= width * height <= max_pixels.

    Transparent images are composited onto white (as Qwen-VL's loader does) instead of turning black.
    max_pixels is a hard cap (it bounds memory); min_pixels is met where max_pixels allows. Images over
    max_image_pixels are refused before decoding. With a `cache`, an image decoded and resized before (same
    file, size and modification time, same bounds) is returned from memory: treat the images as read-only.
    """
    out = []
    for path in paths:
        key = _cache_key(path, min_pixels, max_pixels) if cache is not None else None
        image = cache.get(key) if key is not None else None
        if image is None:
            image = _decode_resized(path, min_pixels, max_pixels, max_image_pixels)
            if key is not None:
                cache.put(key, image)
        out.append(image)
    return out


def _decode_resized(path: str, min_pixels: int | None, max_pixels: int | None, max_image_pixels: int) -> Image.Image:
    try:
        with own_pixel_limit(), Image.open(path) as im:
            too_large = pixel_limit_problem(im.width, im.height, max_image_pixels)
            if too_large:
                raise DataError(f"{path}: {too_large}")
            im.load()
            rgb = _to_rgb(im)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: cannot read image: {type(e).__name__}: {e}") from e
    size = target_size(rgb.width, rgb.height, min_pixels, max_pixels)
    return rgb if size == rgb.size else rgb.resize(size, Image.Resampling.BICUBIC)


def _cache_key(path: str, min_pixels: int | None, max_pixels: int | None) -> tuple | None:
    """The file's identity (path, size, modification time) and the resize bounds; None when it cannot be stat'ed
    (then the load reports the error)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return path, st.st_size, st.st_mtime_ns, min_pixels, max_pixels


class ImageCache:
    """Decoded, resized RGB images kept in memory up to a byte budget, least recently used evicted first.

    Without it every step decodes its images again, which for large files (tens of megapixels) costs more
    than the step. The budget counts width * height * 3 bytes per image; an image larger than the whole
    budget is not kept. Thread-safe.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = max(0, int(budget_bytes))
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._items: OrderedDict[tuple, Image.Image] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple) -> Image.Image | None:
        with self._lock:
            image = self._items.get(key)
            if image is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return image

    def put(self, key: tuple, image: Image.Image) -> None:
        size = _image_bytes(image)
        with self._lock:
            if size > self.budget_bytes or key in self._items:
                return
            while self._items and self.bytes + size > self.budget_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= _image_bytes(old)
                self.evictions += 1
            self._items[key] = image
            self.bytes += size

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "images": len(self._items), "bytes": self.bytes}


def _image_bytes(image) -> int:
    """Bytes of a decoded image, or of a video's frames (video.Video)."""
    if hasattr(image, "frames"):
        return sum(_image_bytes(f) for f in image.frames)
    return image.width * image.height * len(image.getbands())


_shared_cache: ImageCache | None = None


def shared_image_cache(budget_mb: float) -> ImageCache | None:
    """The process's image cache for a budget in MiB (data.image_cache_mb); None when the budget is 0. A new budget
    starts a new cache."""
    global _shared_cache
    budget = int(budget_mb * 2**20)
    if budget <= 0:
        return None
    if _shared_cache is None or _shared_cache.budget_bytes != budget:
        _shared_cache = ImageCache(budget)
    return _shared_cache


def load_video(
    source: str | list[str],
    *,
    max_frames: int,
    fps: float,
    min_pixels: int | None,
    max_pixels: int | None,
    cache=None,
    exact_frames: bool = False,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> "Video":  # noqa: F821 - video.Video, imported where used (video.py needs numpy/torch)
    """A row's video: sampled frames of one size (area within [min_pixels, max_pixels]) and its sampling rate.

    source: a video file path, or a list of image paths (the frames at `fps`, sampled evenly down to max_frames).
    exact_frames: exactly max_frames frames, evenly spaced (frames repeat in a short video), whatever `fps`.
    max_image_pixels: frame files with more pixels are refused from their header (data.max_image_pixels).
    cache: ImageCache; a video decoded before with the same file(s) and settings comes from memory."""
    from vlmrl.data.video import Video, decode_frames, sample_indices, video_header

    key = _video_cache_key(source, max_frames, fps, min_pixels, max_pixels, exact_frames) if cache is not None else None
    video = cache.get(key) if key is not None else None
    if video is not None:
        return video
    if isinstance(source, (list, tuple)):
        indices = sample_indices(len(source), fps, fps, max_frames, exact=exact_frames)
        frames = [_decode_resized(source[i], None, None, max_image_pixels) for i in indices]  # each frame: the bomb guard
        duration, rate = len(source) / fps, fps
    else:
        total, rate, _, _ = video_header(source)
        indices = sample_indices(total, rate, fps, max_frames, exact=exact_frames)
        frames = decode_frames(source, indices)
        duration = total / rate if rate else len(indices) / fps
        rate = rate or fps
    size = target_size(frames[0].width, frames[0].height, min_pixels, max_pixels)
    frames = tuple(f if f.size == size else f.resize(size, Image.Resampling.BICUBIC) for f in frames)
    sampled_fps = len(frames) / duration if duration > 0 else fps
    seconds = tuple(i / rate for i in indices)
    video = Video(frames=frames, sampled_fps=sampled_fps, seconds_per_patch=2 / sampled_fps, frame_seconds=seconds)
    if key is not None:
        cache.put(key, video)
    return video


def _video_cache_key(source, max_frames, fps, min_pixels, max_pixels, exact_frames=False) -> tuple | None:
    paths = list(source) if isinstance(source, (list, tuple)) else [source]
    try:
        stats = [(p, os.stat(p)) for p in paths]
        ident = tuple((p, st.st_size, st.st_mtime_ns) for p, st in stats)
    except OSError:
        return None
    return ("video", ident, max_frames, fps, min_pixels, max_pixels, exact_frames)


def _to_rgb(im: Image.Image) -> Image.Image:
    from vlmrl.data.images import to_rgb  # EXIF orientation, 16-bit / float scaling, animated refused, alpha on white

    return to_rgb(im)


def target_size(width: int, height: int, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    """(width, height) scaled by one factor so the area lies within [min_pixels, max_pixels].

    Upscaling rounds up and downscaling rounds down, so the bounds hold after rounding; sides stay >= 1.
    For extreme aspect ratios where a 1-pixel side already breaks max_pixels, the long side is cut further.
    """
    area = width * height
    if min_pixels is not None and area < min_pixels:
        scale = math.sqrt(min_pixels / area)
        width, height = max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale))
    if max_pixels is not None and width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
        if width * height > max_pixels:  # only when one side was clamped to 1
            if width >= height:
                width = max(1, max_pixels // height)
            else:
                height = max(1, max_pixels // width)
    return width, height
