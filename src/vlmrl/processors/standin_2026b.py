"""Image-only stand-ins for more processors that need torchvision (issue 38, second batch; see standin.py).

SmolVLM's processor takes a video processor (torchvision); the stand-in is transformers' SmolVLMProcessor with it
left out, every image rule its own. LFM2-VL's processor needs no video processor, but its image processor has a
torchvision backend only (its module imports torchvision): the stand-in is a PIL/NumPy image processor for images
that are not split into tiles, fed to transformers' own Lfm2VlProcessor. Saved under the real class names, so a
machine with torchvision loads those. Llama 4's image processor is torchvision-only too: its stand-in covers the
images that fit one tile (its best-fit canvas is a single tile), for transformers' own Llama4Processor. GLM-5's
processor takes a video processor: the GLM-4.xV stand-in pattern (`standin.glm_image_only`) applies.

Imported only when such a folder is loaded (it imports transformers' processor modules).
"""

from __future__ import annotations

import math

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.models.siglip2.image_processing_pil_siglip2 import convert_image_to_patches, pad_along_first_dim
from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor
from transformers.processing_utils import ImagesKwargs, ProcessorMixin

from vlmrl.processors.standin import glm_image_only, save_as, saved_settings

# ---------------------------------------------------------------- SmolVLM


class SmolVLMImageOnlyProcessor(SmolVLMProcessor):
    """transformers' SmolVLMProcessor without its video processor (torchvision): images and text only."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_len: int = 169, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, image_seq_len=image_seq_len, chat_template=chat_template)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("this SmolVLM processor is image-only (its video processor needs torchvision)")
        return super().__call__(images=images, text=text, **kwargs)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        # SmolVLMProcessor's own reads its video processor's frame-sampling settings; there is no video here.
        return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)

    def save_pretrained(self, save_directory, **kwargs):
        return save_as(self, "SmolVLMProcessor", save_directory, **kwargs)


def load_smolvlm_image_processor(path: str, tokenizer, chat_template: str | None) -> SmolVLMImageOnlyProcessor:
    """The stand-in for a SmolVLM folder (settings read as for LLaVA-OneVision)."""
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    processor_cfg, image_settings = saved_settings(path)
    settings = {k: processor_cfg[k] for k in ("image_seq_len",) if k in processor_cfg}
    return SmolVLMImageOnlyProcessor(SmolVLMImageProcessorPil(**image_settings), tokenizer, chat_template=chat_template, **settings)


# ---------------------------------------------------------------- LFM2-VL


class Lfm2VlImagesKwargs(ImagesKwargs, total=False):
    """The settings of transformers' Lfm2VlImageProcessor (same names, same meaning)."""

    downsample_factor: int
    do_image_splitting: bool
    min_tiles: int
    max_tiles: int
    use_thumbnail: bool
    min_image_tokens: int
    max_image_tokens: int
    encoder_patch_size: int
    tile_size: int
    max_pixels_tolerance: float
    do_pad: bool
    return_row_col_info: bool


class Lfm2VlImageProcessorPil(PilBackend):
    """LFM2-VL's image processor on PIL/NumPy for images it does not split into tiles: resized so both sides are
    multiples of encoder_patch_size x downsample_factor with min_image_tokens..max_image_tokens tokens (its
    smart_resize), rescaled and normalised, cut into flattened patches padded to max_num_patches, with
    pixel_attention_mask and spatial_shapes. An image its settings would split is refused: tiles are not
    implemented here. Saves as Lfm2VlImageProcessor (transformers names a `...Pil` class so)."""

    resample = PILImageResampling.BILINEAR
    image_mean, image_std = IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
    size = {"height": 512, "width": 512}
    do_resize = do_rescale = do_normalize = do_pad = do_image_splitting = use_thumbnail = True
    downsample_factor, min_tiles, max_tiles, min_image_tokens, max_image_tokens = 2, 2, 10, 64, 256
    encoder_patch_size, tile_size, max_pixels_tolerance, return_row_col_info = 16, 512, 2.0, False
    valid_kwargs = Lfm2VlImagesKwargs
    model_input_names = ["pixel_values", "pixel_attention_mask", "spatial_shapes"]

    def _preprocess(self, images: list[np.ndarray], **kw) -> BatchFeature:
        factor, patch = kw["downsample_factor"], kw["encoder_patch_size"]
        max_num_patches = max(kw["max_image_tokens"] * factor**2, (kw["tile_size"] // patch) ** 2 if kw["do_image_splitting"] else 0)
        values, masks, shapes, sizes = [], [], [], []
        for image in images:
            height, width = image.shape[-2:]
            if kw["do_image_splitting"] and not kw["min_tiles"] == kw["max_tiles"] == 1 and self._too_large(height, width, kw):
                raise ValueError(f"a {width}x{height} image would be split into tiles, which this PIL stand-in does not do (needs torchvision)")
            new_height, new_width = self._smart_resize(height, width, kw)
            image = self.resize(image, SizeDict(height=new_height, width=new_width), resample=kw["resample"])
            image = self.normalize(self.rescale(image, kw["rescale_factor"]), kw["image_mean"], kw["image_std"])
            patches, mask = pad_along_first_dim(convert_image_to_patches(image, patch), max_num_patches)
            values.append(patches)
            masks.append(mask)
            shapes.append([new_height // patch, new_width // patch])
            sizes.append([new_height, new_width])
        data = {"pixel_values": np.stack(values), "pixel_attention_mask": np.stack(masks), "spatial_shapes": np.array(shapes)}
        if kw["return_row_col_info"]:
            data.update(image_rows=[1] * len(images), image_cols=[1] * len(images), image_sizes=sizes)
        return BatchFeature(data=data, tensor_type=kw["return_tensors"])

    @staticmethod
    def _too_large(height: int, width: int, kw: dict) -> bool:
        factor, patch = kw["encoder_patch_size"] * kw["downsample_factor"], kw["encoder_patch_size"]
        h_bar, w_bar = max(patch, round(height / factor) * factor), max(patch, round(width / factor) * factor)
        return h_bar * w_bar > kw["max_image_tokens"] * factor**2 * kw["max_pixels_tolerance"]

    @staticmethod
    def _smart_resize(height: int, width: int, kw: dict) -> tuple[int, int]:
        """(height, width): multiples of patch x downsample factor, aspect kept, token count within the bounds."""
        factor = kw["encoder_patch_size"] * kw["downsample_factor"]
        low, high = kw["min_image_tokens"] * factor**2, kw["max_image_tokens"] * factor**2
        h_bar, w_bar = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
        if h_bar * w_bar > high:
            beta = math.sqrt(height * width / high)
            h_bar, w_bar = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < low:
            beta = math.sqrt(low / (height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h_bar, w_bar


def load_lfm2_vl_processor(path: str, tokenizer, chat_template: str | None):
    """transformers' Lfm2VlProcessor over the PIL stand-in image processor, for an LFM2-VL folder."""
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    _, image_settings = saved_settings(path)
    return Lfm2VlProcessor(Lfm2VlImageProcessorPil(**image_settings), tokenizer, chat_template=chat_template)


# ---------------------------------------------------------------- Llama 4


class Llama4ImagesKwargs(ImagesKwargs, total=False):
    """The settings of transformers' Llama4ImageProcessor (same names, same meaning)."""

    max_patches: int
    resize_to_max_canvas: bool


class Llama4ImageProcessorPil(PilBackend):
    """Llama 4's image processor on PIL/NumPy for images whose best-fit canvas is one tile (every image no larger
    than a tile, whatever max_patches): the image resized without distortion to fit the tile (upscaled only up to the
    tile's side), padded right and bottom with zeros, rescaled and normalised in bfloat16 as transformers' does;
    pixel_values [images, 3, tile, tile], aspect_ratios [images, 2] = (1, 1). An image that would take several tiles
    is refused: tiling is not implemented here. Saves as Llama4ImageProcessor (transformers names a `...Pil` class so)."""

    resample = PILImageResampling.BILINEAR
    image_mean, image_std = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
    size = {"height": 336, "width": 336}
    do_resize = do_rescale = do_normalize = do_convert_rgb = True
    max_patches, resize_to_max_canvas = 16, False
    valid_kwargs = Llama4ImagesKwargs
    model_input_names = ["pixel_values"]

    def _preprocess(self, images: list[np.ndarray], size: SizeDict, **kw) -> BatchFeature:
        import torch

        tile = size.height
        if size.width != tile:
            raise ValueError("Llama 4's image processor size must be square")
        values = []
        for image in images:
            height, width = image.shape[-2:]
            canvas = _llama4_best_fit(height, width, tile, kw["max_patches"], kw["resize_to_max_canvas"])
            if canvas != (tile, tile):
                raise ValueError(
                    f"a {width}x{height} image would be split into tiles {canvas}, which this PIL stand-in does not do (needs torchvision)"
                )
            # One tile as the canvas: transformers' upscaling bound (the tile's side) is the canvas itself.
            new_height, new_width = _max_res_without_distortion((height, width), (tile, tile))
            image = self.resize(image, SizeDict(height=max(new_height, 1), width=max(new_width, 1)), resample=kw["resample"])
            image = np.pad(image, [(0, 0), (0, tile - image.shape[1]), (0, tile - image.shape[2])])
            pixels = torch.from_numpy(np.ascontiguousarray(image)).to(torch.bfloat16) * kw["rescale_factor"]
            mean = torch.tensor(kw["image_mean"], dtype=torch.bfloat16).view(3, 1, 1)
            std = torch.tensor(kw["image_std"], dtype=torch.bfloat16).view(3, 1, 1)
            values.append((pixels - mean) / std)
        data = {"pixel_values": torch.stack(values), "aspect_ratios": torch.ones(len(images), 2, dtype=torch.long)}
        return BatchFeature(data=data, tensor_type=kw["return_tensors"])


def _max_res_without_distortion(image_size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """The largest (height, width) of the image's aspect ratio that fits `target` (transformers' rule for Llama 4)."""
    (height, width), (target_height, target_width) = image_size, target
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.floor(height * scale_w), target_height), target_width
    return target_height, min(math.floor(width * scale_h), target_width)


def _llama4_best_fit(height: int, width: int, tile: int, max_patches: int, to_max_canvas: bool) -> tuple[int, int]:
    """Llama 4's canvas (height, width) for an image: over every grid of at most max_patches tiles, the smallest
    upscale that fits without distortion (the largest with to_max_canvas), else the mildest downscale; ties go to
    the smallest area."""
    canvases = sorted({(a * tile, (n // a) * tile) for n in range(1, max_patches + 1) for a in range(1, n + 1) if n % a == 0})
    scales = [min(h / height, w / width) for h, w in canvases]
    up = [s for s in scales if s >= 1]
    chosen = (max(up) if to_max_canvas else min(up)) if up else max(scales)
    return min((c for c, s in zip(canvases, scales) if s == chosen), key=lambda c: c[0] * c[1])


def load_llama4_processor(path: str, tokenizer, chat_template: str | None):
    """transformers' Llama4Processor over the PIL stand-in image processor, for a Llama 4 folder."""
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    processor_cfg, image_settings = saved_settings(path)
    settings = {k: processor_cfg[k] for k in ("patch_size", "pixel_shuffle_ratio") if k in processor_cfg}
    return Llama4Processor(Llama4ImageProcessorPil(**image_settings), tokenizer, chat_template=chat_template, **settings)


# ---------------------------------------------------------------- GLM-5 (glm5_next)


def glm5_next_image_only_processor():
    """transformers' Glm5NextProcessor without its video processor (torchvision)."""
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor

    return glm_image_only(Glm5NextProcessor)


def load_glm5_next_processor(path: str, tokenizer, chat_template: str | None):
    """The stand-in for a GLM-5 (glm5_next) folder: its PIL image processor, the processor minus its video one."""
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    _, image_settings = saved_settings(path)
    return glm5_next_image_only_processor()(Glm5NextImageProcessorPil(**image_settings), tokenizer, chat_template=chat_template)
