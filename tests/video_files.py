"""Small video files for tests, written with PyAV (mpeg4 in .mp4), and frame image folders."""

import av
import numpy as np
from PIL import Image


def write_mp4(path, frames: int = 10, size=(64, 48), rate: int = 5, seed: int = 0):
    """A `frames`-frame video of random colour blocks at `rate` frames per second; returns the path."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for _ in range(frames):
            blocks = rng.integers(0, 255, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
            frame = np.kron(blocks, np.ones((8, 8, 1), dtype=np.uint8))
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_frames(folder, frames: int = 6, size=(56, 56), seed: int = 0) -> list[str]:
    """`frames` PNG files of random pixels; returns their paths in order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(frames):
        path = folder / f"frame{i:03d}.png"
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths
