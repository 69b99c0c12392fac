"""Image-only stand-ins for processors that transformers builds with a video processor (which needs torchvision).

LLaVA-OneVision's and InternVL's processors take an image processor, a tokenizer and a video processor; the video
processor imports torchvision, which is not usable beside this project's CPU torch, so `AutoProcessor` fails on any
such folder here. The stand-ins below are transformers' own processor classes with the video processor left out of
their attributes (ProcessorMixin reads them from `__init__`'s signature), so every image rule (LLaVA-OneVision's
anyres grid pinpoints, unpadding, image_newline tokens; InternVL's dynamic tiling with a thumbnail and
`<img><IMG_CONTEXT>...</img>` expansion) is transformers' code, not a copy. They save under the real class names:
with torchvision installed the same folder loads the real processor.

InternVL concatenates every image's tiles into one `pixel_values` [tiles, 3, H, W]; the stand-in also returns
`image_num_patches` [images] (bookkeeping, not a model input) so that rows can be sliced per image. LLaVA-OneVision's
stand-in prepares video frames itself (resize to the tower's input size, rescale, normalise: what its video processor
does once frames are sampled); InternVL videos are frames given as images (processing.video_frames_as_images).

Imported only when such a folder is loaded (it imports transformers' processor modules).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.processing_internvl import InternVLProcessor
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

ONEVISION_PROCESSOR_KEYS = ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio", "image_token")


class OnevisionImageProcessor(LlavaOnevisionProcessor):
    """LlavaOnevisionProcessor without its video processor (torchvision): videos are processed here from frames."""

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
        self.video_processor = None  # present (ProcessorMixin then calls _process_videos below) but never used

    def _process_videos(self, videos, **kwargs):
        """What LlavaOnevisionVideoProcessor does with frames already sampled (it needs torchvision): each frame resized
        to the vision tower's input size, rescaled and normalised; pixel_values_videos [videos, frames, 3, H, W]. The
        text gets frames x pooled patches + 1 (newline) <video> tokens per video, as the real processor writes."""
        ip = self.image_processor
        height, width = ip.size["height"], ip.size["width"]
        mean = np.asarray(ip.image_mean, dtype=np.float32).reshape(3, 1, 1)
        std = np.asarray(ip.image_std, dtype=np.float32).reshape(3, 1, 1)
        counts = {len(frames) for frames in videos}
        if len(counts) != 1:
            raise ValueError(f"LLaVA-OneVision videos of one batch need one frame count, got {sorted(counts)} (data.max_frames fixes it)")
        stacked = [
            np.stack([(np.asarray(f.convert("RGB").resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32).transpose(2, 0, 1)
                       * ip.rescale_factor - mean) / std for f in frames])
            for frames in videos
        ]  # fmt: skip
        processed = {"pixel_values_videos": torch.from_numpy(np.stack(stacked))}
        replacements = [self.replace_video_token(processed, video_idx=i) for i in range(len(videos))]
        return processed, replacements

    def save_pretrained(self, save_directory, **kwargs):
        return _save_as(self, "LlavaOnevisionProcessor", save_directory, **kwargs)


class InternVLImageProcessor(InternVLProcessor):
    """InternVLProcessor for images only (no video processor, no torchvision), plus image_num_patches."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_length: int = 256, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, image_seq_length=image_seq_length, chat_template=chat_template)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("this InternVL processor is image-only (its video processor needs torchvision)")
        out = super().__call__(images=images, text=text, **kwargs)
        if images is not None and "input_ids" in out:
            out["image_num_patches"] = self.tiles_per_image(out["input_ids"])
        return out

    def tiles_per_image(self, input_ids) -> torch.Tensor:
        """Tiles of each image, in order, from its <img>...</img> span: context tokens / image_seq_length."""
        ids = torch.as_tensor(input_ids)
        counts = []
        for row in ids:
            starts = (row == self.start_image_token_id).nonzero().flatten().tolist()
            ends = (row == self.end_image_token_id).nonzero().flatten().tolist()
            counts += [int((row[a:b] == self.image_token_id).sum()) // self.image_seq_length for a, b in zip(starts, ends)]
        return torch.tensor(counts, dtype=torch.long)

    def save_pretrained(self, save_directory, **kwargs):
        return _save_as(self, "InternVLProcessor", save_directory, **kwargs)


def _save_as(processor, real_class: str, save_directory, **kwargs):
    """transformers' layout, under the real processor's class name (a machine with torchvision loads that)."""
    out = super(type(processor), processor).save_pretrained(save_directory, **kwargs)
    for name in ("processor_config.json", "tokenizer_config.json"):
        path = Path(save_directory) / name
        if path.exists():
            data = json.loads(path.read_text())
            if data.get("processor_class") == type(processor).__name__:
                data["processor_class"] = real_class
                path.write_text(json.dumps(data, indent=2) + "\n")
    return out


def load_onevision_image_processor(path: str, tokenizer, chat_template: str | None) -> OnevisionImageProcessor:
    """The stand-in for a LLaVA-OneVision folder: image processor settings from preprocessor_config.json (hub
    layout) or nested in processor_config.json (transformers 5 layout), the processor's own settings from
    processor_config.json."""
    folder = Path(path)
    processor_cfg = json.loads((folder / "processor_config.json").read_text()) if (folder / "processor_config.json").exists() else {}
    image_processor = LlavaOnevisionImageProcessorPil(**_image_processor_settings(folder, processor_cfg))
    settings = {k: processor_cfg[k] for k in ONEVISION_PROCESSOR_KEYS if k in processor_cfg}
    return OnevisionImageProcessor(image_processor, tokenizer, chat_template=chat_template, **settings)


def _image_processor_settings(folder: Path, processor_cfg: dict) -> dict:
    """Image processor settings from preprocessor_config.json (hub layout) or nested in processor_config.json."""
    if (folder / "preprocessor_config.json").exists():
        image_cfg = json.loads((folder / "preprocessor_config.json").read_text())
    else:
        image_cfg = processor_cfg.get("image_processor", {})
    return {k: v for k, v in image_cfg.items() if k not in ("image_processor_type", "processor_class", "backend")}


def load_internvl_image_processor(path: str, tokenizer, chat_template: str | None) -> InternVLImageProcessor:
    """The stand-in for an InternVL folder (settings read as for LLaVA-OneVision)."""
    folder = Path(path)
    processor_cfg = json.loads((folder / "processor_config.json").read_text()) if (folder / "processor_config.json").exists() else {}
    image_processor = GotOcr2ImageProcessorPil(**_image_processor_settings(folder, processor_cfg))
    settings = {k: processor_cfg[k] for k in ("image_seq_length",) if k in processor_cfg}
    return InternVLImageProcessor(image_processor, tokenizer, chat_template=chat_template, **settings)


# model_type -> loader of its image-only stand-in (processing.load_processor uses it when AutoProcessor fails).
STANDIN_LOADERS = {"llava_onevision": load_onevision_image_processor, "internvl": load_internvl_image_processor}
