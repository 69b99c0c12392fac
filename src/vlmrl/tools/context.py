"""What a tool may read besides the arguments the model wrote."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolContext:
    """What a tool may read besides its arguments: the conversation's images in order (the row's first, then
    each one a tool returned, at full resolution), the dataset row, and the sizes the model saw them at."""

    images: list = field(default_factory=list)
    row: dict = field(default_factory=dict)
    # (width, height) the model saw each image at, when its processor resized it: pixel boxes the model writes
    # are in that space (Qwen2.5-VL's are) and are scaled to the full-resolution image before cropping.
    seen_sizes: list = field(default_factory=list)
