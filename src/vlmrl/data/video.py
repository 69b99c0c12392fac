"""Video rows: frames sampled from a video file (PyAV) or from a list of image files (data.load_video resizes them
under a per-frame pixel cap and caches them), and (for the image-only Qwen stand-in processor) cut into Qwen-VL's
temporal patches.

Host memory stays bounded: a file is decoded frame by frame and only the sampled frames are kept (resized at once),
and decoded videos share the image cache's byte budget (data.image_cache_mb) with the images.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image


class VideoError(ValueError):
    """A video that cannot be read: names the file and what failed."""


@dataclass(frozen=True)
class Video:
    """One row's video as the processor gets it."""

    frames: tuple[Image.Image, ...]  # sampled RGB frames, all one size
    sampled_fps: float  # frames kept per second of video
    seconds_per_patch: float  # seconds one temporal patch (2 frames) spans: Qwen2.5-VL's second_per_grid_ts
    frame_seconds: tuple[float, ...] = ()  # time of each sampled frame in the video (Qwen3-VL writes them into the prompt)

    def patch_timestamps(self, frame_factor: int = 2) -> list[float]:
        """Mid-time of each temporal patch (the last frame repeated to fill the final one), as Qwen3-VL's processor
        writes `<t seconds>` before each patch's tokens."""
        times = list(self.frame_seconds)
        times += times[-1:] * (-len(times) % frame_factor)
        return [(times[i] + times[i + frame_factor - 1]) / 2 for i in range(0, len(times), frame_factor)]


def sample_indices(total_frames: int, source_fps: float | None, fps: float, max_frames: int, frame_factor: int = 2, exact: bool = False) -> list[int]:
    """Indices of the frames to keep, evenly spaced over the video.

    fps frames per second of video (all frames when the source rate is unknown), at most max_frames, rounded down
    to a multiple of frame_factor (Qwen-VL's temporal patch: 2 frames) and at least frame_factor frames when the
    video has them. A video shorter than frame_factor frames keeps them all (the processor repeats the last).
    exact: exactly max_frames indices, evenly spaced, whatever the rates."""
    if total_frames <= 0:
        return []
    if exact:  # a fixed count (LLaVA-OneVision batches videos of one length): evenly spaced, repeated when short
        return [int(round(x)) for x in np.linspace(0, total_frames - 1, max_frames)]
    wanted = total_frames if not source_fps else total_frames / source_fps * fps
    count = min(int(wanted), max_frames, total_frames)
    count = max(frame_factor, count // frame_factor * frame_factor)
    if count >= total_frames:
        return list(range(total_frames))
    return [min(total_frames - 1, int(round(x))) for x in np.linspace(0, total_frames - 1, count)]


def video_header(path: str) -> tuple[int, float | None, int, int]:
    """(frame count, frames per second or None, width, height) from the container's header, without decoding."""
    av = _import_av()
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise VideoError(f"{path}: no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate) if stream.average_rate else None
            frames = int(stream.frames or 0)
            if frames == 0 and stream.duration and stream.time_base and rate:
                frames = int(stream.duration * stream.time_base * rate)
            if frames == 0 and container.duration and rate:
                frames = int(container.duration / 1_000_000 * rate)
            return frames, rate, int(stream.codec_context.width), int(stream.codec_context.height)
    except VideoError:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV raises many types for a bad file
        raise VideoError(f"{path}: cannot read video: {type(e).__name__}: {e}") from e


def decode_frames(path: str, indices: list[int]) -> list[Image.Image]:
    """The frames at `indices` (sorted) as RGB images, decoding the stream once and keeping only those."""
    av = _import_av()
    wanted = sorted(set(indices))
    kept: dict[int, Image.Image] = {}
    try:
        with av.open(path) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    kept[i] = frame.to_image().convert("RGB")
                if i >= wanted[-1]:
                    break
    except Exception as e:  # noqa: BLE001
        raise VideoError(f"{path}: cannot decode video: {type(e).__name__}: {e}") from e
    if not kept:
        raise VideoError(f"{path}: no frame could be decoded")
    last = kept[max(kept)]
    return [kept.get(i, last) for i in indices]  # a header that over-counts frames: the last decoded one stands in


def _import_av():
    try:
        import av
    except ImportError as e:
        raise VideoError("reading video files needs PyAV: pip install av (or give the frames as a list of image files)") from e
    return av


# ---------------------------------------------------------------- Qwen-VL temporal patches (image-only stand-in)


def qwen_video_patches(frames: list[Image.Image], image_processor) -> tuple[torch.Tensor, list[int]]:
    """(patches [t*h*w, C*tp*p*p], [t, h, w]) of one video the way Qwen2-VL's video processor lays them out.

    Each frame goes through the model's own image processor, which writes one frame repeated tp times per
    patch; the video's patch holds tp consecutive frames instead (the last frame repeated to fill the final
    group), in the same spatial order."""
    tp = int(image_processor.temporal_patch_size)
    per_frame = image_processor(images=list(frames), return_tensors="pt")
    grids = per_frame["image_grid_thw"]
    if not bool((grids == grids[0]).all()):
        raise ValueError(f"the frames of a video were resized to different grids: {grids.tolist()}")
    n = int(grids[0].prod())
    values = per_frame["pixel_values"].reshape(len(frames), n, -1, tp, image_processor.patch_size**2)
    single = values[:, :, :, 0]  # [F, n, C, p*p]: each frame once
    if pad := -len(frames) % tp:
        single = torch.cat([single, single[-1:].expand(pad, -1, -1, -1)])
    groups = single.shape[0] // tp
    stacked = single.reshape(groups, tp, n, single.shape[2], -1).permute(0, 2, 3, 1, 4)  # [t, n, C, tp, p*p]
    _, h, w = (int(x) for x in grids[0])
    return stacked.reshape(groups * n, -1), [groups, h, w]
