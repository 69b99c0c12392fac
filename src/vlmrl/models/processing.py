"""One processor interface over VLM families: load, build chat prompts, encode batches, select rows.

`load_processor` returns the model's own `AutoProcessor` whenever it loads. Qwen-VL processors need
a video processor, which needs torchvision; without it (this project's CPU setup) they fail to load
or silently come back as a bare tokenizer, so Qwen-VL folders then get `QwenImageProcessor`, a
stand-in that expands `<|image_pad|>` exactly like the real one, and cuts video frames into temporal patches.

Encoded prompt batches are plain dicts of tensors:
  input_ids, attention_mask     [B, P], left padded
  mm_token_type_ids             [B, P] (Qwen-VL: 0 text, 1 image, 2 video; needed for M-RoPE)
  pixel_values                  Qwen-VL: [total_patches, D]; LLaVA: [n_images, 3, H, W]
  image_grid_thw                Qwen-VL only: [n_images, 3]
  images_per_row                [B], bookkeeping (not a model input)
  image_num_patches             InternVL: [n_images] tiles per image; MiniCPM-V: slices per image (bookkeeping)
  target_sizes                  MiniCPM-V: [n_slices, 2] patch rows x columns of each slice, whose pixels are packed
                                along the last axis of pixel_values [1, 3, patch, columns]
  image_token_pooling           Molmo2: [n_image_tokens, pool] indices into the batch's patches (pixel_values
                                [n_crops, patches, D], image_num_crops [n_images], image_grids [n_images, 4])
"""

from __future__ import annotations

import dataclasses
import math
import json
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from vlmrl.models.loading import ModelLoadError
from vlmrl.data.formats import prompt_messages_of
from vlmrl.data.media import target_size
from vlmrl.data.template_budget import bounded, checked_size, remember_source, template_source
from vlmrl.data.video import qwen_video_patches
from vlmrl.families import family_of, model_types

QWEN_VL_MODEL_TYPES = model_types("dynamic_resolution")
# Keys whose first dimension indexes images (or image patches), not batch rows.
VISION_KEYS = (
    *("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask", "image_num_patches", "image_position_ids", "target_sizes"),
    *("image_token_pooling", "image_grids", "image_num_crops", "spatial_shapes"),
)
# Keys whose first dimension indexes videos (or video patches); rows own them through videos_per_row.
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
# Processors that take images as one list per prompt row (they check each row's placeholder count).
NESTED_IMAGE_PROCESSORS = (
    "Gemma3Processor",
    "Gemma4Processor",
    "Gemma4ImageOnlyProcessor",
    "Idefics3Processor",
    "OnevisionImageProcessor",
    "LlavaOnevisionProcessor",
    "SmolVLMProcessor",
    "SmolVLMImageOnlyProcessor",
    "Lfm2VlProcessor",
)
# Keys that are bookkeeping for vlmrl, never passed to the model.
BOOKKEEPING_KEYS = ("images_per_row", "videos_per_row")


class ProcessorLoadError(ModelLoadError):
    """A processor could not be built for a model folder (a ModelLoadError, so the CLI reports it)."""


# ---------------------------------------------------------------- image-only Qwen-VL processor


VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


class QwenImageProcessor:
    """Stand-in for the Qwen-VL processors (Qwen2-VL ... Qwen3.5) without torchvision.

    Same call convention as the real processor: every `<|image_pad|>` in the text is expanded to
    grid_t*grid_h*grid_w / merge_size**2 copies, and `mm_token_type_ids` is returned. Videos come as already
    sampled frames (video.qwen_video_patches lays out their temporal patches through the image processor).
    """

    def __init__(self, tokenizer, image_processor, chat_template: str | None = None, model_type: str | None = None):
        self.tokenizer = tokenizer
        self.model_type = model_type  # qwen2_5_vl: videos also carry second_per_grid_ts
        self.image_processor = image_processor
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    def __repr__(self) -> str:
        return f"QwenImageProcessor(image_processor={type(self.image_processor).__name__}, tokenizer={len(self.tokenizer)} tokens)"

    def __call__(
        self, text=None, images=None, videos=None, padding=True, return_tensors="pt", second_per_grid_ts=None, video_timestamps=None, **kwargs
    ):
        """videos: one list of PIL frames per video (already sampled); second_per_grid_ts: seconds per temporal
        patch of each video (Qwen2.5-VL's time-aligned M-RoPE), returned as given; video_timestamps: each video's
        patch mid-times (Qwen3-VL, Qwen3.5: `<t seconds>` and a vision start/end pair around each patch's tokens)."""
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        flat = _flatten_images(images)
        data: dict = {}
        if flat:
            image_inputs = self.image_processor(images=flat, return_tensors="pt")
            data.update(image_inputs)
            texts = self._expand_image_tokens(texts, image_inputs["image_grid_thw"], self.image_token)
        elif any(self.image_token in t for t in texts):
            raise ValueError(f"prompt has {self.image_token} placeholders but no images were given")
        if videos:
            patches, grids = zip(*(qwen_video_patches(frames, self.image_processor) for frames in videos))
            data["pixel_values_videos"] = torch.cat(patches)
            data["video_grid_thw"] = torch.tensor(grids, dtype=torch.long)
            if second_per_grid_ts is not None:
                data["second_per_grid_ts"] = torch.tensor(second_per_grid_ts, dtype=torch.float32)
            texts = self._expand_image_tokens(texts, data["video_grid_thw"], self.video_token, video_timestamps)
        elif any(self.video_token in t for t in texts):
            raise ValueError(f"prompt has {self.video_token} placeholders but no videos were given")
        enc = self.tokenizer(texts, padding=padding, return_tensors=return_tensors, **kwargs)
        ids = enc["input_ids"]
        mm = torch.zeros_like(ids) if torch.is_tensor(ids) else None
        if mm is not None:
            mm[ids == self.image_token_id] = 1
            mm[ids == self.video_token_id] = 2
        data = {**enc, "mm_token_type_ids": mm, **data}
        return BatchFeature(data)

    def _expand_image_tokens(self, texts: list[str], grid_thw: torch.Tensor, token: str, timestamps: list | None = None) -> list[str]:
        """Replace the i-th `token` placeholder (counting over the whole batch) by its image's or video's tokens;
        with `timestamps` (one list per video) each temporal patch's tokens are `<t seconds>` + vision start +
        tokens + vision end, as transformers' Qwen3-VL processor writes them."""
        merge = self.image_processor.merge_size**2
        n_placeholders = sum(t.count(token) for t in texts)
        if n_placeholders != len(grid_thw):
            what = "videos" if token == self.video_token else "images"
            raise ValueError(f"{n_placeholders} {token} placeholders in the prompts but {len(grid_thw)} {what}")
        marker = "\x00IMG\x00"  # a placeholder that cannot be re-expanded while we substitute
        replacements = []
        for k, g in enumerate(grid_thw):
            if timestamps is None:
                replacements.append(marker * (int(g.prod()) // merge))
                continue
            per_patch = marker * (int(g[1:].prod()) // merge)
            replacements.append("".join(f"<{t:.1f} seconds>{VISION_START}{per_patch}{VISION_END}" for t in timestamps[k]))
        it = iter(replacements)
        out = []
        for t in texts:
            parts = t.split(token)
            pieces = [parts[0]]
            for part in parts[1:]:
                pieces += [next(it), part]
            out.append("".join(pieces).replace(marker, token))
        return out

    def apply_chat_template(self, conversation, chat_template: str | None = None, **kwargs):
        return self.tokenizer.apply_chat_template(conversation, chat_template=chat_template or self.chat_template, **kwargs)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    def post_process_image_text_to_text(self, generated_outputs, skip_special_tokens=True, **kwargs):
        return self.tokenizer.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens, **kwargs)

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """Hub layout of a Qwen-VL checkpoint: tokenizer files, preprocessor_config.json, chat template."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(out)
        self.image_processor.save_pretrained(out)
        if self.chat_template:
            (out / "chat_template.jinja").write_text(self.chat_template)


def _flatten_images(images) -> list:
    """None, a flat list of images or a list of per-row lists -> flat list."""
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        return [images]
    flat = []
    for item in images:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    return flat


# ---------------------------------------------------------------- loading


def tokenizer_of(processor):
    return getattr(processor, "tokenizer", processor)


def _model_type(path: str) -> str | None:
    cfg = Path(path) / "config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text()).get("model_type")
    return None


def _read_chat_template(path: str) -> str | None:
    """Processor-level chat template: chat_template.jinja or chat_template.json (older checkpoints)."""
    folder = Path(path)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None


def _qwen_fallback(path: str, trust_remote_code: bool, local_files_only: bool) -> QwenImageProcessor:
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_files_only, trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=local_files_only, trust_remote_code=trust_remote_code)
    if not hasattr(image_processor, "merge_size"):
        raise ProcessorLoadError(f"{path}: image processor {type(image_processor).__name__} has no merge_size; not a Qwen-VL image processor")
    return QwenImageProcessor(tokenizer, image_processor, _read_chat_template(path) or tokenizer.chat_template, _model_type(path))


def _is_full_processor(obj) -> bool:
    """A multimodal processor, not a bare tokenizer that AutoProcessor sometimes returns instead."""
    return hasattr(obj, "tokenizer") and hasattr(obj, "image_processor")


def set_pixel_bounds(processor, min_pixels: int | None = None, max_pixels: int | None = None) -> None:
    """Override the image processor's resize bounds (Qwen-VL style; fixed-size processors ignore them).

    Qwen-VL image processors keep the bounds as size.shortest_edge / size.longest_edge (pixels, not
    edges); transformers 4.x also kept plain min_pixels / max_pixels attributes.
    """
    ip = getattr(processor, "image_processor", None)
    if ip is None or not hasattr(ip, "merge_size") or (min_pixels is None and max_pixels is None):
        return
    bounds = {k: v for k, v in (("shortest_edge", min_pixels), ("longest_edge", max_pixels)) if v is not None}
    size = getattr(ip, "size", None)
    if dataclasses.is_dataclass(size):  # transformers 5 SizeDict
        ip.size = dataclasses.replace(size, **bounds)
    elif isinstance(size, dict):
        ip.size = {**size, **bounds}
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and hasattr(ip, name):
            setattr(ip, name, value)


def load_processor(
    path: str | Path,
    trust_remote_code: bool = False,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    local_files_only: bool = True,
):
    """The processor of a model folder, with left padding and a pad token.

    AutoProcessor first; when it fails or returns only a tokenizer for a Qwen-VL folder (torchvision
    missing), the image-only QwenImageProcessor. min/max_pixels override the image processor's.
    """
    from transformers import AutoProcessor

    path = str(path)
    error: Exception | None = None
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=local_files_only, trust_remote_code=trust_remote_code)
    except Exception as e:  # ImportError (torchvision), OSError (missing files), ValueError (mapping)
        processor, error = None, e
    if processor is None or not _is_full_processor(processor):
        if _model_type(path) in QWEN_VL_MODEL_TYPES:
            processor = _qwen_fallback(path, trust_remote_code, local_files_only)
        elif family_of(_model_type(path)).standin_processor:  # video processors need torchvision: image-only stand-ins
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_files_only, trust_remote_code=trust_remote_code)
            processor = family_of(_model_type(path)).load_standin_processor(path, tokenizer, _read_chat_template(path) or tokenizer.chat_template)
        else:
            got = f"AutoProcessor raised {type(error).__name__}: {error}" if error else f"AutoProcessor returned {type(processor).__name__}"
            raise ProcessorLoadError(
                f"{path}: could not load an image+text processor ({got}). The folder needs tokenizer files, "
                "preprocessor_config.json and a processor class transformers knows."
            ) from error
    tokenizer = tokenizer_of(processor)
    # Generation appends to the right end of every row, so prompts must be left padded.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    set_pixel_bounds(processor, min_pixels, max_pixels)
    _remember_template_source(processor, path)
    return processor


def _remember_template_source(processor, path: str) -> None:
    folder = Path(path)
    names = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
    found = next((folder / n for n in names if (folder / n).is_file()), folder)
    remember_source(processor, f"the chat template in {found}")


def apply_template(processor, messages: list[dict], **kwargs) -> str:
    """`processor.apply_chat_template(messages, tokenize=False, **kwargs)` under the render budget (template_budget.py):
    a template that loops too long or renders a giant text ends in one line naming its file."""
    where = template_source(processor)
    with bounded(where):
        return checked_size(processor.apply_chat_template(messages, tokenize=False, **kwargs), where)


# ---------------------------------------------------------------- prompts and batches


def build_prompt(processor, problem: str, num_images: int, system_prompt: str | None = None, num_videos: int = 0) -> str:
    """Chat-template text: optional system message, one user turn (images, then videos, first, unless the text places
    them with `<image>` / `<video>`), generation prompt."""
    return build_row_prompt(processor, {"problem": problem}, num_images, system_prompt, num_videos)


def build_row_prompt(
    processor, row: dict, num_images: int, system_prompt: str | None = None, num_videos: int = 0, tools: list[dict] | None = None
) -> str:
    """Chat-template text of a data row's prompt (formats.prompt_messages_of: its own turns and system message, each
    image where its placeholder stands), with the generation prompt; `tools`: the tools' JSON schemas, for templates
    that describe them to the model (tool_rollout.tool_schemas)."""

    return render_chat(processor, prompt_messages_of(row, num_images, num_videos, system_prompt), add_generation_prompt=True, tools=tools)


def render_chat(processor, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """The model's chat template applied to `messages` (vlmrl's content blocks), as text; `tools` (JSON schemas) is
    passed as the template's `tools` variable, as TRL and verl pass it (a template that does not read it ignores it)."""
    template_owner = processor if getattr(processor, "chat_template", None) else tokenizer_of(processor)
    if not getattr(template_owner, "chat_template", None):
        raise ValueError("the processor and its tokenizer have no chat template; add chat_template.jinja to the model folder")
    extra = {"tools": tools} if tools else {}
    where = template_source(processor)
    with bounded(where):
        return checked_size(template_owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra), where)


def encode_prompts(processor, texts: list[str], images: list[list], videos: list[list] | None = None) -> dict[str, torch.Tensor]:
    """Left-padded batch of prompts with their images (images[i] = the PIL images of row i) and videos
    (videos[i] = row i's videos, each a `video.Video`: sampled frames and seconds per temporal patch)."""
    if len(texts) != len(images):
        raise ValueError(f"encode_prompts: {len(texts)} texts but {len(images)} image lists")
    videos = videos if videos is not None else [[] for _ in texts]
    if type(processor).__name__ in FRAME_VIDEO_PROCESSORS and any(videos):
        texts, images = video_frames_as_images(processor, list(texts), images, videos)
        videos = [[] for _ in texts]
    kwargs = {"text": list(texts), "padding": True, "return_tensors": "pt"}
    flat = [img for row in images for img in row]
    if flat:
        # Some processors (Gemma 3) count images per prompt and need them nested per row; the others take them flat.
        kwargs["images"] = [list(row) for row in images] if type(processor).__name__ in NESTED_IMAGE_PROCESSORS else flat
    flat_videos = [v for row in videos for v in row]
    if flat_videos:
        kwargs.update(video_kwargs(processor, flat_videos))
    batch = dict(processor(**kwargs))
    batch["images_per_row"] = torch.tensor([len(row) for row in images], dtype=torch.long)
    if "batch_num_images" in batch:  # LLaVA-OneVision lists only the rows that have images: one entry per row, as select_rows needs
        batch["batch_num_images"] = batch["images_per_row"].clone()
    if flat_videos:
        batch["videos_per_row"] = torch.tensor([len(row) for row in videos], dtype=torch.long)
    return batch


def video_frames_as_images(processor, texts: list[str], images: list[list], videos: list[list]) -> tuple[list[str], list[list]]:
    """InternVL takes a video as its frames, one tile each: every video placeholder becomes `FrameK: <image>` lines
    (as transformers' InternVLProcessor writes them) and the frames, resized to one tile, follow the row's images."""
    side = processor.image_processor.size
    out_texts, out_images = [], []
    for text, row_images, row_videos in zip(texts, images, videos, strict=True):
        row_images = list(row_images)
        for video in row_videos:
            frames = [f.resize((side["width"], side["height"]), Image.Resampling.BICUBIC) for f in video.frames]
            lines = "\n".join(f"Frame{i + 1}: {processor.image_token}" for i in range(len(frames)))
            if processor.video_token not in text:
                raise ValueError(f"a row has more videos than {processor.video_token} placeholders")
            text = text.replace(processor.video_token, lines, 1)
            row_images += frames
        out_texts.append(text)
        out_images.append(row_images)
    return out_texts, out_images


def video_support(processor) -> str | None:
    """None when vlmrl feeds this processor video rows, else why not (one clause)."""
    if isinstance(processor, QwenImageProcessor):
        if processor.model_type in VIDEO_MODEL_TYPES:
            return None
        return f"video rows work with {' and '.join(VIDEO_MODEL_TYPES)} models here, not {processor.model_type}"
    if type(processor).__name__ in (*VIDEO_PROCESSORS, *FRAME_VIDEO_PROCESSORS, *FIXED_FRAME_PROCESSORS):
        return None
    return f"{type(processor).__name__} takes no video rows here; video rows work with the Qwen-VL families ({', '.join(VIDEO_MODEL_TYPES)})"


def video_kwargs(processor, videos: list) -> dict:
    """The processor's video arguments for already-sampled frames: the stand-in takes the frames and seconds per
    temporal patch; transformers' Qwen-VL processors take the frames with sampling off and the sampled rate."""
    reason = video_support(processor)
    if reason:
        raise ValueError(reason)
    frames = [list(v.frames) for v in videos]
    if isinstance(processor, QwenImageProcessor):
        seconds = [v.seconds_per_patch for v in videos] if family_of(processor.model_type).video_seconds_per_patch else None
        stamps = [v.patch_timestamps() for v in videos] if processor.model_type in TIMESTAMPED_VIDEO_TYPES else None
        return {"videos": frames, "second_per_grid_ts": seconds, "video_timestamps": stamps}
    if type(processor).__name__ == "OnevisionImageProcessor":
        return {"videos": frames}
    if type(processor).__name__ in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "LlavaOnevisionProcessor"):
        return {"videos": frames, "videos_kwargs": {"do_sample_frames": False, "fps": [v.sampled_fps for v in videos]}}
    # Qwen3-VL / Qwen3.5 write each patch's time from the frames' metadata (not run here: it needs torchvision).
    from transformers.video_utils import VideoMetadata

    metadata = [VideoMetadata(total_num_frames=len(v.frames), fps=1.0, frames_indices=list(v.frame_seconds)) for v in videos]
    return {"videos": frames, "videos_kwargs": {"do_sample_frames": False, "video_metadata": metadata}}


# transformers processors whose video path vlmrl feeds (frames it sampled itself), and the model types that take video rows.
VIDEO_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "Qwen3_5Processor")
VIDEO_MODEL_TYPES = model_types("video")
# Processors that take the sampled frames of a video whole, in a fixed count per batch (data.max_frames exactly).
FIXED_FRAME_PROCESSORS = ("OnevisionImageProcessor", "LlavaOnevisionProcessor")
# Processors that take a video as its frames, each an image of one tile (InternVL: the stand-in and transformers' own).
FRAME_VIDEO_PROCESSORS = ("InternVLImageProcessor", "InternVLProcessor")
# Model types whose processor writes `<t seconds>` before each temporal patch of a video.
TIMESTAMPED_VIDEO_TYPES = model_types("timestamped_video")


def vision_keys(batch: dict) -> list[str]:
    """Keys of an encoded batch whose first dimension indexes images, videos or their patches, not rows."""
    return [k for k in batch if k in VISION_KEYS or k in VIDEO_KEYS]


def per_image_chunks(batch: dict, key: str) -> list[torch.Tensor]:
    """Split a vision tensor into one piece per image or video (Qwen-VL patches via image/video_grid_thw)."""
    value = batch[key]
    if key in ("pixel_values", "target_sizes") and "target_sizes" in batch:
        return _packed_slices(batch, key)
    if key in ("pixel_values", "image_token_pooling") and "image_token_pooling" in batch:
        return _pooled_crops(batch, key)
    if key == "pixel_values" and "image_grid_thw" in batch:
        sizes = batch["image_grid_thw"].prod(dim=-1).tolist()
        return list(torch.split(value, sizes, dim=0))
    if key == "pixel_values_videos" and "video_grid_thw" in batch:  # Qwen-VL: patches; LLaVA-OneVision: [videos, frames, ...]
        return list(torch.split(value, batch["video_grid_thw"].prod(dim=-1).tolist(), dim=0))
    if key == "pixel_values" and "image_num_patches" in batch:  # InternVL: every image's tiles, concatenated
        return list(torch.split(value, batch["image_num_patches"].tolist(), dim=0))
    return list(value.unbind(0)) if value.shape[0] else []


def _packed_slices(batch: dict, key: str) -> list[torch.Tensor]:
    """MiniCPM-V's per-image pieces: each image's rows of target_sizes [slices, 2] (image_num_patches slices each),
    and its columns of pixel_values [1, 3, patch, columns] (rows x columns x patch per slice, packed in order)."""
    slices = batch["image_num_patches"].tolist()
    sizes = batch["target_sizes"]
    if key == "target_sizes":
        return list(torch.split(sizes, slices, dim=0))
    pixels = batch["pixel_values"]
    columns = (sizes[:, 0] * sizes[:, 1] * pixels.shape[2]).tolist()
    starts = [sum(slices[:i]) for i in range(len(slices))]
    return list(torch.split(pixels, [sum(columns[a : a + n]) for a, n in zip(starts, slices)], dim=-1))


def _pooled_crops(batch: dict, key: str) -> list[torch.Tensor]:
    """Molmo2's per-image pieces: its crops of pixel_values (image_num_crops each), and its rows of
    image_token_pooling (low-res rows x columns + high-res rows x columns, from image_grids) with the indices made
    relative to its own first patch (-1, no patch, kept); `_rebased_pooling` makes them global again."""
    crops = batch["image_num_crops"].tolist()
    if key == "pixel_values":
        return list(torch.split(batch["pixel_values"], crops, dim=0))
    grids = batch["image_grids"]
    rows = (grids[:, 0] * grids[:, 1] + grids[:, 2] * grids[:, 3]).tolist()
    patches = batch["pixel_values"].shape[1]
    starts = [sum(crops[:i]) * patches for i in range(len(crops))]
    return [torch.where(c >= 0, c - start, c) for c, start in zip(torch.split(batch["image_token_pooling"], rows), starts)]


def _rebased_pooling(batch: dict, picked: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    """Molmo2's image_token_pooling of the images `order` (pieces from `_pooled_crops`), offset by the patches of the
    images before each one in the new order."""
    patches = batch["pixel_values"].shape[1]
    crops = batch["image_num_crops"][order].tolist()
    starts = [sum(crops[:i]) * patches for i in range(len(crops))]
    return torch.cat([torch.where(c >= 0, c + start, c) for c, start in zip(picked, starts)])


def select_rows(batch: dict, rows: Sequence[int] | torch.Tensor) -> dict:
    """Gather rows of an encode_prompts batch (repeats allowed), vision tensors included.

    Row tensors are indexed directly; per-image / per-patch tensors are split per image, grouped by
    row through images_per_row and concatenated again in the new row order.
    """
    idx = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    n_rows = batch["input_ids"].shape[0]
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n_rows):
        raise IndexError(f"select_rows: rows {idx.tolist()} out of range for a batch of {n_rows}")
    per_row = batch.get("images_per_row")
    if per_row is None:
        if vision_keys(batch):
            raise KeyError("select_rows: batch has vision inputs but no images_per_row; build it with encode_prompts")
        per_row = torch.zeros(n_rows, dtype=torch.long)
    image_order = item_order(per_row, idx)
    videos_per_row = batch.get("videos_per_row")
    video_order = item_order(videos_per_row, idx) if videos_per_row is not None else []

    out = {}
    for key, value in batch.items():
        if key in VISION_KEYS or key in VIDEO_KEYS:
            picked = _picked_items(batch, key, video_order if key in VIDEO_KEYS else image_order)
            if picked is not None:
                out[key] = picked
        elif torch.is_tensor(value) and value.ndim and value.shape[0] == n_rows:
            out[key] = value.index_select(0, idx.to(value.device))
        else:
            out[key] = value
    out["images_per_row"] = per_row.index_select(0, idx.to(per_row.device))
    return out


def _picked_items(batch: dict, key: str, order: list[int]) -> torch.Tensor | None:
    """The per-image (per-video) tensor `key` of `batch` in `order`: concatenated where the processor flattens
    patches (grid_thw / num_patches families), stacked otherwise; None when no item is picked."""
    chunks = per_image_chunks(batch, key)
    picked = [chunks[i] for i in order]
    if not picked:
        return None
    if key == "pixel_values" and "target_sizes" in batch:  # MiniCPM-V: slices packed along the last axis
        return torch.cat(picked, dim=-1)
    if key == "image_token_pooling":  # Molmo2: indices into the picked images' patches
        return _rebased_pooling(batch, picked, order)
    flat = (
        (key == "pixel_values_videos" and "video_grid_thw" in batch)
        or (key == "pixel_values" and any(k in batch for k in ("image_grid_thw", "image_num_patches", "image_num_crops")))
        or key == "target_sizes"
    )
    return torch.cat(picked) if flat else torch.stack(picked)


def item_order(per_row: torch.Tensor, rows: torch.Tensor) -> list[int]:
    """Indices of the images (or videos) of `rows`, in row order, given each row's count."""
    starts = torch.cumsum(per_row, 0) - per_row
    return [i for r in rows.tolist() for i in range(int(starts[r]), int(starts[r] + per_row[r]))]


def decode(processor, ids, skip_special_tokens: bool = True) -> list[str]:
    """Token ids [N, T] (tensor or lists) -> N strings, special tokens dropped."""
    if torch.is_tensor(ids):
        ids = ids.tolist()
    return tokenizer_of(processor).batch_decode(ids, skip_special_tokens=skip_special_tokens)


# Per-token modality ids [B, P] some processors return (zeros = text): Qwen-VL's M-RoPE types, Gemma 3's image-block
# mask, ERNIE-4.5-VL's expert choice (vision experts for image tokens and their start/end markers).
TOKEN_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids", "moe_mm_token_type_ids")


def append_tokens(batch: dict, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """Prompt batch + completion tokens [N, T]: extends input_ids, attention_mask and the per-token
    modality ids (TOKEN_TYPE_KEYS, zeros = text) that Qwen-VL's M-RoPE and ERNIE's experts need to
    have the same length as input_ids. Vision inputs are passed through unchanged."""
    out = dict(batch)
    out["input_ids"] = torch.cat([batch["input_ids"], ids.to(batch["input_ids"].device)], dim=1)
    out["attention_mask"] = torch.cat([batch["attention_mask"], mask.to(batch["attention_mask"])], dim=1)
    for key in TOKEN_TYPE_KEYS:
        if key in batch:
            out[key] = torch.cat([batch[key], torch.zeros_like(ids, dtype=batch[key].dtype, device=batch[key].device)], dim=1)
    return out


# ---------------------------------------------------------------- image sizes the processor accepts

# transformers' smart_resize (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ...) raises for a longer/shorter side ratio above this.
SMART_RESIZE_MAX_RATIO = 200
# Shapes inside these bounds are accepted by every image processor vlmrl knows; others are tried on the processor itself.
USUAL_MAX_RATIO = 20
USUAL_MIN_SIDE = 28


class ImageShapeCheck:
    """Whether the model's image processor accepts an image of a given size, as validation's `shape_check`.

    Sees what the model will see: the size after vlmrl's own resize (data.min_pixels / data.max_pixels,
    `data.target_size`), then
    - processors built on smart_resize (they have merge_size): a side ratio over 200 raises there;
    - processors that first scale the shortest edge to a fixed length (CLIP / LLaVA): the intermediate image
      of shortest_edge x (shortest_edge x ratio) pixels must stay within data.max_image_pixels (a 1x30000 strip
      becomes a 56 x 1,680,000 image before the crop);
    - any other unusual shape (ratio over 20 or a side under 28 pixels) is run through the image processor on
      a blank image of that size, and its error, if any, is the reason.
    Call with the original (width, height); returns None or the reason. Sizes are remembered.
    """

    def __init__(self, processor, min_pixels: int | None, max_pixels: int | None, max_image_pixels: int):
        self.image_processor = getattr(processor, "image_processor", None)
        self.min_pixels, self.max_pixels, self.max_image_pixels = min_pixels, max_pixels, max_image_pixels
        self.name = type(self.image_processor).__name__
        self._memo: dict[tuple[int, int], str | None] = {}

    def __call__(self, width: int, height: int) -> str | None:
        if (width, height) not in self._memo:
            self._memo[(width, height)] = self._reason(width, height)
        return self._memo[(width, height)]

    def _reason(self, width: int, height: int) -> str | None:

        if self.image_processor is None:
            return None
        w, h = target_size(width, height, self.min_pixels, self.max_pixels)
        ratio = max(w, h) / min(w, h)
        resized = f" (after resizing to {w}x{h} for data.min_pixels/max_pixels)" if (w, h) != (width, height) else ""
        if hasattr(self.image_processor, "merge_size") and ratio > SMART_RESIZE_MAX_RATIO:
            return f"side ratio {ratio:.0f}:1{resized} is over the {SMART_RESIZE_MAX_RATIO}:1 that {self.name} accepts; crop or pad the image"
        shortest = _size_field(self.image_processor, "shortest_edge")
        if not hasattr(self.image_processor, "merge_size") and shortest:
            intermediate = shortest * math.ceil(shortest * ratio)
            if intermediate > self.max_image_pixels:
                return (
                    f"side ratio {ratio:.0f}:1{resized}: {self.name} would first scale it to {intermediate:,} pixels, over "
                    f"data.max_image_pixels={self.max_image_pixels:,}; crop or pad the image"
                )
        if ratio <= USUAL_MAX_RATIO and min(w, h) >= USUAL_MIN_SIDE:
            return None

        try:
            self.image_processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")
        except Exception as e:  # whatever the processor raises is what step 1 would have raised
            return f"{self.name} rejects it{resized}: {type(e).__name__}: {e}"
        return None


def _size_field(image_processor, name: str) -> int | None:
    """A field of the image processor's `size` (a dict, or transformers 5's SizeDict)."""
    size = getattr(image_processor, "size", None)
    value = size.get(name) if isinstance(size, dict) else getattr(size, name, None)
    return int(value) if isinstance(value, (int, float)) and value else None
