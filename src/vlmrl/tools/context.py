"""What a tool may read besides the arguments the model wrote."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolContext:
    """What a tool may read besides its arguments: the conversation's images in order (the row's first, then
    each one a tool returned) and the dataset row."""

    images: list = field(default_factory=list)
    row: dict = field(default_factory=dict)
