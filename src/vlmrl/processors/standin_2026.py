"""Image-only stand-ins for the processors of the third batch of 2026 families (issue 38; `tiny_2026_c`), on the
pattern of `standin`: transformers' own processor class with the torchvision-only video processor left
out, saved under the real class name (with torchvision installed the same folder loads the real processor).

Imported only when such a folder is loaded (it imports transformers' processor modules).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from transformers.processing_utils import ProcessorMixin

from vlmrl.processors.standin import image_processor_settings, save_as


def _processor_config(folder: Path) -> dict:
    path = folder / "processor_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


# ---------------------------------------------------------------- ERNIE-4.5-VL (MoE)


def _ernie_processor_class():
    from transformers.models.ernie4_5_vl_moe.processing_ernie4_5_vl_moe import Ernie4_5_VLMoeProcessor

    return Ernie4_5_VLMoeProcessor


class ErnieImageOnlyProcessor(_ernie_processor_class()):
    """transformers' Ernie4_5_VLMoeProcessor without its video processor (torchvision; it also draws timestamps on
    frames with a font file): images only. Its own rules stay: <|IMAGE_PLACEHOLDER|> expanded to grid_thw / 4
    tokens, mm_token_type_ids (M-RoPE) and moe_mm_token_type_ids (vision experts, image start/end included)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("this ERNIE-4.5-VL processor is image-only (its video processor needs torchvision)")
        return super().__call__(images=images, text=text, **kwargs)

    def save_pretrained(self, save_directory, **kwargs):
        # The parent's save copies the video processor's font file first: there is none here.
        out = save_as(self, "Ernie4_5_VLMoeProcessor", save_directory, via=ProcessorMixin, **kwargs)
        # With torchvision, AutoProcessor builds the real video processor from this entry (else from the image
        # processor's settings, which it refuses: temporal patch 1). Timestamps drawn on frames need a font file the
        # folder does not hold (offline), so that is off.
        path = Path(save_directory) / "processor_config.json"
        data = json.loads(path.read_text())
        data["video_processor"] = {"video_processor_type": "Ernie4_5_VLMoeVideoProcessor", "draw_on_frames": False}
        path.write_text(json.dumps(data, indent=2) + "\n")
        return out


def load_ernie_image_processor(path: str, tokenizer, chat_template: str | None) -> ErnieImageOnlyProcessor:
    """The stand-in for an ERNIE-4.5-VL folder (settings read as for LLaVA-OneVision)."""
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil

    folder = Path(path)
    image_processor = Ernie4_5_VLMoeImageProcessorPil(**image_processor_settings(folder, _processor_config(folder)))
    return ErnieImageOnlyProcessor(image_processor, tokenizer, chat_template=chat_template)


# ---------------------------------------------------------------- MiniCPM-V 4.6

MINICPMV_MARKUP = (
    "image_token",
    "video_token",
    "image_start_token",
    "image_end_token",
    "slice_start_token",
    "slice_end_token",
    "image_id_start_token",
    "image_id_end_token",
)


def _minicpmv_processor_class():
    from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor

    return MiniCPMV4_6Processor


class MiniCPMVImageOnlyProcessor(_minicpmv_processor_class()):
    """transformers' MiniCPMV4_6Processor without its video processor (torchvision): images only. Its own rules stay
    (slices per image, `<image_id>N</image_id><image>...</image><slice>...</slice>` expansion, NaViT-packed
    pixel_values [1, 3, patch, columns] with target_sizes [slices, 2]); it also returns image_num_patches [images]
    (slices of each image: bookkeeping, not a model input) so that rows can be sliced per image."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # MiniCPMV4_6Processor.__init__ reads the video processor's settings: its image-side fields are set as it sets them.
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.slice_mode, self.video_slice_mode = image_processor.slice_mode, False
        self.default_use_image_id = image_processor.use_image_id
        self.image_token_divisor = self.video_token_divisor = 4 if image_processor.downsample_mode == "4x" else 16
        for name in MINICPMV_MARKUP:
            setattr(self, name, getattr(tokenizer, name))
        self.image_token_id, self.video_token_id = tokenizer.image_token_id, tokenizer.video_token_id

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("this MiniCPM-V processor is image-only (its video processor needs torchvision)")
        out = super().__call__(images=images, text=text, **kwargs)
        if "num_patches_per_image" in out:
            out["image_num_patches"] = torch.as_tensor(out.pop("num_patches_per_image"), dtype=torch.long)
        return out

    @property
    def unused_input_names(self) -> list[str]:
        return [name for name in super().unused_input_names if name != "num_patches_per_image"]

    def save_pretrained(self, save_directory, **kwargs):
        return save_as(self, "MiniCPMV4_6Processor", save_directory, **kwargs)


def load_minicpmv_image_processor(path: str, tokenizer, chat_template: str | None) -> MiniCPMVImageOnlyProcessor:
    """The stand-in for a MiniCPM-V 4.6 folder (settings read as for LLaVA-OneVision)."""
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    folder = Path(path)
    image_processor = MiniCPMV4_6ImageProcessorPil(**image_processor_settings(folder, _processor_config(folder)))
    return MiniCPMVImageOnlyProcessor(image_processor, tokenizer, chat_template=chat_template)


# ---------------------------------------------------------------- Kimi-K2.5

# Kimi_K25ImageProcessor has a torchvision backend only (its module imports torchvision at the top), so here its
# rules run on transformers' PIL backend: the sizing rule and the patch layout below follow that class; resizing,
# padding, rescaling and normalising are PilBackend's.


def kimi_navit_size(
    height: int, width: int, patch_size: int, merge_size: int, max_patches: int, max_side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Kimi-K2.5's resize then pad target ((h, w), (padded h, padded w)): shrink (never enlarge) to at most
    `max_patches` patches and `max_side` patches per side, then pad right/bottom to a multiple of patch x merge."""
    scale = min(
        1.0,
        math.sqrt(max_patches / (max(1.0, height // patch_size) * max(1.0, width // patch_size))),
        max_side * patch_size / height,
        max_side * patch_size / width,
    )
    h = min(max(1, int(height * scale)), max_side * patch_size)
    w = min(max(1, int(width * scale)), max_side * patch_size)
    factor = merge_size * patch_size
    return (h, w), (h + (factor - h % factor) % factor, w + (factor - w % factor) % factor)


def _kimi_image_processor_class():
    from transformers.image_processing_backends import PilBackend
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling

    class KimiK25ImageProcessorPil(PilBackend):
        """Kimi_K25ImageProcessor's preprocessing on the PIL backend: pixel_values [patches, 3, p, p] (row-major
        patches of each padded image, images concatenated), image_grid_thw [images, 3] = (1, rows, columns)."""

        resample = PILImageResampling.BICUBIC
        size = {"max_height": 512, "max_width": 512}
        do_resize = do_rescale = do_normalize = do_convert_rgb = True
        image_mean, image_std = IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
        max_patches, patch_size, merge_size = 16384, 14, 2
        model_input_names = ["pixel_values", "image_grid_thw"]

        def __init__(self, max_patches: int | None = None, patch_size: int | None = None, merge_size: int | None = None, **kwargs):
            super().__init__(**kwargs)
            for name, value in (("max_patches", max_patches), ("patch_size", patch_size), ("merge_size", merge_size)):
                if value is not None:
                    setattr(self, name, value)

        def _preprocess(self, images, size, resample, do_rescale, rescale_factor, do_normalize, image_mean, image_std, return_tensors=None, **kwargs):
            from transformers import BatchFeature
            from transformers.image_utils import SizeDict

            p, patches, grids = self.patch_size, [], []
            for image in images:
                (h, w), (ph, pw) = kimi_navit_size(*image.shape[-2:], p, self.merge_size, self.max_patches, size.max_height)
                image = self.pad([self.resize(image, size=SizeDict(height=h, width=w), resample=resample)], pad_size=SizeDict(height=ph, width=pw))[0]
                if do_rescale:
                    image = self.rescale(image, rescale_factor)
                if do_normalize:
                    image = self.normalize(image, image_mean, image_std)
                c = image.shape[0]
                grid = image.reshape(c, ph // p, p, pw // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, c, p, p)
                patches.append(torch.from_numpy(np.ascontiguousarray(grid, dtype=np.float32)))
                grids.append([1, ph // p, pw // p])
            data = {"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}
            return BatchFeature(data=data, tensor_type=return_tensors)

        def to_dict(self):
            out = super().to_dict()
            out["image_processor_type"] = "Kimi_K25ImageProcessor"  # the real class (torchvision) loads this folder
            return out

    return KimiK25ImageProcessorPil


KimiK25ImageProcessorPil = _kimi_image_processor_class()


def _kimi_processor_class():
    from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor

    return Kimi_K25Processor


class KimiImageOnlyProcessor(_kimi_processor_class()):
    """transformers' Kimi_K25Processor without its video processor (torchvision), on KimiK25ImageProcessorPil:
    each <|media_pad|> expanded to grid_thw / 4 tokens by its own replace_image_token."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("this Kimi-K2.5 processor is image-only (its video processor needs torchvision)")
        return super().__call__(images=images, text=text, **kwargs)

    def save_pretrained(self, save_directory, **kwargs):
        return save_as(self, "Kimi_K25Processor", save_directory, **kwargs)


def load_kimi_image_processor(path: str, tokenizer, chat_template: str | None) -> KimiImageOnlyProcessor:
    """The stand-in for a Kimi-K2.5 folder (settings read as for LLaVA-OneVision)."""
    folder = Path(path)
    image_processor = KimiK25ImageProcessorPil(**image_processor_settings(folder, _processor_config(folder)))
    return KimiImageOnlyProcessor(image_processor, tokenizer, chat_template=chat_template)


# ---------------------------------------------------------------- Molmo2

MOLMO2_IMAGE_TOKENS = ["<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<frame_start>", "<im_end>", "<frame_end>", "<im_low>"]


def _molmo2_image_processor_class():
    from transformers.image_utils import PILImageResampling
    from transformers.models.molmo2.image_processing_molmo2 import Molmo2ImageProcessor

    modes = {PILImageResampling.BILINEAR: "bilinear", PILImageResampling.BICUBIC: "bicubic"}

    class Molmo2ImageProcessorTorch(Molmo2ImageProcessor):
        """Molmo2ImageProcessor (every rule its own: overlapping crops, low-res view, pooling indices) with the two
        torchvision calls it makes done in torch: resize (it asks for antialias=False, which is torch's interpolate
        with align_corners=False, what torchvision runs for tensors) and normalize."""

        def resize(self, image, size, resample=None, antialias=True, **kwargs):
            mode = modes.get(PILImageResampling(resample if resample is not None else PILImageResampling.BILINEAR))
            if antialias or mode is None:
                raise ValueError(f"Molmo2 stand-in: resize with antialias={antialias}, resample={resample} is not reproduced without torchvision")
            batch = image if image.ndim == 4 else image[None]
            out = torch.nn.functional.interpolate(batch, size=(size.height, size.width), mode=mode, align_corners=False)
            return out if image.ndim == 4 else out[0]

        def normalize(self, image, mean, std, **kwargs):
            mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
            return (image - mean) / std

        def to_dict(self):
            out = super().to_dict()
            out["image_processor_type"] = "Molmo2ImageProcessor"  # the real class (torchvision) loads this folder
            return out

    return Molmo2ImageProcessorTorch


Molmo2ImageProcessorTorch = _molmo2_image_processor_class()


def _molmo2_processor_class():
    from transformers.models.molmo2.processing_molmo2 import Molmo2Processor

    return Molmo2Processor


class Molmo2ImageOnlyProcessor(_molmo2_processor_class()):
    """transformers' Molmo2Processor without its video processor (torchvision): images only; its image rules (low-res
    view then high-res crops, <im_col> after each patch row, mm_token_type_ids for the bidirectional image blocks)
    are its own."""

    def __init__(
        self,
        image_processor=None,
        tokenizer=None,
        chat_template=None,
        image_use_col_tokens=True,
        use_single_crop_col_tokens=None,
        use_single_crop_start_token=True,
        **kwargs,
    ):
        # Molmo2Processor.__init__ hands the video processor to ProcessorMixin by position: its fields are set as it sets them.
        self.image_use_col_tokens, self.use_single_crop_col_tokens = image_use_col_tokens, use_single_crop_col_tokens
        self.use_single_crop_start_token, self.video_use_col_tokens, self.use_frame_special_tokens = use_single_crop_start_token, False, True
        self.image_token, self.video_token = tokenizer.image_token, tokenizer.video_token
        self.image_token_id, self.video_token_id = tokenizer.convert_tokens_to_ids([self.image_token, self.video_token])
        self.image_token_ids = tokenizer.convert_tokens_to_ids(MOLMO2_IMAGE_TOKENS)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("this Molmo2 processor is image-only (its video processor needs torchvision)")
        return super().__call__(images=images, text=text, **kwargs)

    def save_pretrained(self, save_directory, **kwargs):
        return save_as(self, "Molmo2Processor", save_directory, **kwargs)


def load_molmo2_image_processor(path: str, tokenizer, chat_template: str | None) -> Molmo2ImageOnlyProcessor:
    """The stand-in for a Molmo2 folder (settings read as for LLaVA-OneVision)."""
    folder = Path(path)
    processor_cfg = _processor_config(folder)
    image_processor = Molmo2ImageProcessorTorch(**image_processor_settings(folder, processor_cfg))
    keys = ("image_use_col_tokens", "use_single_crop_col_tokens", "use_single_crop_start_token")
    settings = {k: processor_cfg[k] for k in keys if k in processor_cfg}
    return Molmo2ImageOnlyProcessor(image_processor, tokenizer, chat_template=chat_template, **settings)
