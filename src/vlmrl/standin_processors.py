"""Image-only stand-ins for processors that transformers builds with a video processor (which needs torchvision).

LLaVA-OneVision's processor takes an image processor, a tokenizer and a video processor; the video processor
imports torchvision, which is not usable beside this project's CPU torch, so `AutoProcessor` fails on any
LLaVA-OneVision folder here. The stand-in below is transformers' own `LlavaOnevisionProcessor` with the video
processor left out of its attributes (ProcessorMixin reads them from `__init__`'s signature), so every image rule
(anyres grid pinpoints, unpadding, image_newline tokens, `anyres_max_9`) is transformers' code, not a copy. It saves
under the real class name: with torchvision installed the same folder loads the real processor.

Imported only when such a folder is loaded (it imports transformers' processor modules).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

ONEVISION_PROCESSOR_KEYS = ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio", "image_token")


class OnevisionImageProcessor(LlavaOnevisionProcessor):
    """LlavaOnevisionProcessor for images only (no video processor, no torchvision)."""

    def __init__(
        self,
        image_processor=None,
        tokenizer=None,
        num_image_tokens=None,
        vision_feature_select_strategy=None,
        chat_template=None,
        image_token="<image>",
        vision_aspect_ratio="anyres_max_9",
        **kwargs,
    ):
        super().__init__(
            image_processor,
            tokenizer,
            video_processor=None,
            num_image_tokens=num_image_tokens,
            vision_feature_select_strategy=vision_feature_select_strategy,
            chat_template=chat_template,
            image_token=image_token,
            vision_aspect_ratio=vision_aspect_ratio,
        )

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("this LLaVA-OneVision processor is image-only (its video processor needs torchvision)")
        return super().__call__(images=images, text=text, **kwargs)

    def save_pretrained(self, save_directory, **kwargs):
        """transformers' layout, under the real processor's class name (a machine with torchvision loads that)."""
        out = super().save_pretrained(save_directory, **kwargs)
        for name in ("processor_config.json", "tokenizer_config.json"):
            path = Path(save_directory) / name
            if path.exists():
                data = json.loads(path.read_text())
                if data.get("processor_class") == type(self).__name__:
                    data["processor_class"] = "LlavaOnevisionProcessor"
                    path.write_text(json.dumps(data, indent=2) + "\n")
        return out


def load_onevision_image_processor(path: str, tokenizer, chat_template: str | None) -> OnevisionImageProcessor:
    """The stand-in for a LLaVA-OneVision folder: image processor settings from preprocessor_config.json (hub
    layout) or nested in processor_config.json (transformers 5 layout), the processor's own settings from
    processor_config.json."""
    folder = Path(path)
    processor_cfg = json.loads((folder / "processor_config.json").read_text()) if (folder / "processor_config.json").exists() else {}
    if (folder / "preprocessor_config.json").exists():
        image_cfg = json.loads((folder / "preprocessor_config.json").read_text())
    else:
        image_cfg = processor_cfg.get("image_processor", {})
    image_cfg = {k: v for k, v in image_cfg.items() if k not in ("image_processor_type", "processor_class", "backend")}
    image_processor = LlavaOnevisionImageProcessorPil(**image_cfg)
    settings = {k: processor_cfg[k] for k in ONEVISION_PROCESSOR_KEYS if k in processor_cfg}
    return OnevisionImageProcessor(image_processor, tokenizer, chat_template=chat_template, **settings)
