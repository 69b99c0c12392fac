"""Vision-token geometry of the memory planner: patches and LLM tokens of an image at the pixel cap (dynamic
resolution, fixed towers, LLaVA-OneVision anyres and InternVL tiles), a prompt's video, which path a family runs
(grouped vision / shared prefix or the naive one), and the token shape of one micro-batch (`micro_batch`).
Pure arithmetic over a ModelSpec and a Workload."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from vlmrl.families import model_types
from vlmrl.plan.spec import ModelSpec, PlanError, Workload


def image_patches(spec: ModelSpec, max_pixels: int) -> int:
    """Vision patches of one image at the pixel cap (dynamic resolution) or at the tower's fixed size."""
    if spec.v_layers == 0:
        return 0
    if not spec.dynamic_resolution:
        tiles = tiled_image(spec, *square_image(max_pixels))[0] if spec.tiling else 1
        return tiles * (spec.image_size // spec.patch_size) ** 2
    unit = spec.patch_size * spec.merge_size
    side_units = max(1, int(math.isqrt(max(max_pixels, unit * unit)) // unit))  # square image, multiples of patch*merge
    return (side_units * spec.merge_size) ** 2


def image_tokens(spec: ModelSpec, max_pixels: int) -> int:
    """LLM tokens of one image at the pixel cap (a square; tiled families: their tiles of that square)."""
    if spec.tiling and spec.v_layers:
        return tiled_image(spec, *square_image(max_pixels))[1]
    return image_patches(spec, max_pixels) // (spec.merge_size**2)


def square_image(max_pixels: int) -> tuple[int, int]:
    """(height, width) of the square image at the pixel cap the planner assumes."""
    side = max(1, math.isqrt(max(max_pixels, 1)))
    return side, side


def best_pinpoint(height: int, width: int, pinpoints: tuple) -> tuple[int, int]:
    """The anyres canvas (height, width) an image is fitted into: the one that keeps most of the image's pixels once it
    is scaled (aspect kept) to fit, and among those the one with the fewest unused pixels."""
    best, best_key = (0, 0), None
    for ch, cw in pinpoints:
        scale = min(cw / width, ch / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        key = (kept, -(ch * cw - kept))
        if best_key is None or key > best_key:
            best, best_key = (ch, cw), key
    return best


def anyres_image(spec: ModelSpec, height: int, width: int) -> tuple[int, int]:
    """(tiles the tower encodes, LLM tokens) of one image under LLaVA-OneVision's anyres: the base image (one tile)
    plus the grid of tiles of its best canvas; the grid's features are cropped to the image's aspect (the padding
    removed), pooled down when they exceed anyres_max_tiles tiles' worth by more than 10%, and end each row with a
    newline token."""
    side = spec.image_size // spec.patch_size  # features per tile side
    ch, cw = best_pinpoint(height, width, spec.tile_pinpoints)
    rows, cols = ch // spec.image_size, cw // spec.image_size
    fh, fw = side * rows, side * cols
    if width * fh > fw * height:  # wider than the canvas: rows of padding above and below
        fh -= 2 * ((fh - int(round(height * fw / width, 7))) // 2)
    else:
        fw -= 2 * ((fw - int(round(width * fh / height, 7))) // 2)
    ratio = math.sqrt(fh * fw / (spec.anyres_max_tiles * side * side))
    if ratio > 1.1:
        fh, fw = int(fh // ratio), int(fw // ratio)
    return 1 + rows * cols, fh * fw + fh + side * side


def dynamic_tiles(height: int, width: int, tile: int, max_tiles: int, min_tiles: int = 1) -> int:
    """Tiles InternVL's processor cuts an image into: the grid (columns x rows, min_tiles..max_tiles tiles) whose aspect is
    closest to the image's (on a tie the larger grid, while the image covers more than half of it), plus a thumbnail
    of the whole image when the grid has more than one tile."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if min_tiles <= c * r <= max_tiles]
    grids.sort(key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff or (diff == best_diff and area > 0.5 * tile * tile * c * r):
            best, best_diff = (c, r), min(diff, best_diff)
    n = best[0] * best[1]
    return n + (n > 1)


def tiled_image(spec: ModelSpec, height: int, width: int) -> tuple[int, int]:
    """(tiles the tower encodes, LLM tokens) of one height x width image of a tiled family (spec.tiling)."""
    per_tile = (spec.image_size // spec.patch_size) ** 2
    if spec.tiling == "anyres":
        return anyres_image(spec, height, width)
    if spec.tiling == "dynamic":
        tiles = dynamic_tiles(height, width, spec.image_size, spec.max_tiles)
        return tiles, tiles * per_tile // spec.merge_size**2
    return 1, per_tile // spec.merge_size**2


# Qwen3-VL / Qwen3.5 write `<t seconds>` and a vision start/end pair around each temporal patch of a video: text tokens
# per temporal patch (an estimate: "<0.5 seconds>" is about 6 tokens of a Qwen tokenizer, plus the 2 markers).
TIMESTAMPED_VIDEO_FAMILIES = model_types("timestamped_video")
TIMESTAMP_TEXT_TOKENS = 8
# Families whose video rows the planner counts (Qwen-VL temporal patches, checked against the trace); vlmrl also trains
# video rows on LLaVA-OneVision and InternVL, which `vlmrl plan` does not model yet.
VIDEO_FAMILIES = model_types("plan_video")
# Families with vlmrl's grouped-vision and shared-prefix paths (logprobs.grouped_family); the others (SmolVLM, Idefics3,
# ...) take the naive path: every row encodes its own copy of its prompt's images, no shared prefix.
FAST_PATH_FAMILIES = model_types("grouped")


def video_grid(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(temporal patches, patches of one frame) of one prompt's video: ceil(frames / temporal_patch) temporal
    patches (the processor repeats the last frame of an odd count), each frame a square at w.video_max_pixels."""
    if w.video_frames <= 0 or spec.v_layers == 0:
        return 0, 0
    return -(-w.video_frames // max(spec.temporal_patch, 1)), image_patches(spec, w.video_max_pixels)


def naive_fallback(spec: ModelSpec, w: Workload) -> tuple[Workload, bool, list]:
    """(the workload as vlmrl runs it, whether grouped vision / the shared prefix fell back, notes): a family without
    vlmrl's fast paths (not in FAST_PATH_FAMILIES) runs the naive path whatever memory.group_vision / shared_prefix
    say, as vlmrl logs (Family.fallback_reason)."""
    if not (spec.v_layers > 0 and spec.family not in FAST_PATH_FAMILIES and (w.group_vision or w.shared_prefix)):
        return w, False, []
    note = f"{spec.family}: grouped vision and the shared prefix fall back to the naive path (vision encoded per row)"
    return dataclasses.replace(w, group_vision=False, shared_prefix=False), True, [note]


def vision_encodes(spec: ModelSpec, w: Workload, unique: int, prefix: bool) -> tuple[int, bool]:
    """(prompt encodes of one micro-batch's vision pass, whether it is the naive video path). Grouped vision encodes
    each of the `unique` prompts once; a batch with videos takes the naive path (each of the micro-batch's rows encodes
    its own copy of its prompt's pixels) unless the shared prefix runs, whose prefill encodes each video once."""
    if w.video_frames and spec.family not in VIDEO_FAMILIES:
        raise PlanError(f"video rows: the planner models videos on {', '.join(VIDEO_FAMILIES)} only, not {spec.family or spec.name}")
    naive_video = w.video_frames > 0 and not prefix
    return (unique if (w.group_vision and not naive_video) else w.micro_batch), naive_video


def video_text_tokens(spec: ModelSpec, w: Workload) -> int:
    """Text tokens a prompt's video adds besides its vision tokens (Qwen3-VL / Qwen3.5 timestamps and markers)."""
    return video_grid(spec, w)[0] * TIMESTAMP_TEXT_TOKENS if spec.family in TIMESTAMPED_VIDEO_FAMILIES else 0


def prompt_vision(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(vision patches, LLM vision tokens) of one prompt: its images at w.max_pixels + its video (video_grid)."""
    t, frame = video_grid(spec, w)
    patches = image_patches(spec, w.max_pixels) * w.images_per_prompt + t * frame
    return patches, image_tokens(spec, w.max_pixels) * w.images_per_prompt + t * frame // spec.merge_size**2


def tool_images(w: Workload) -> int:
    """Images the tools return in one rollout: tool_images_per_turn per tool turn, as many as the rollout's image budget
    (max_images, the row's own images included) leaves. 0 for single-turn rollouts."""
    return min(w.tool_turns * w.tool_images_per_turn, max(0, w.max_images - w.images_per_prompt))


def multiturn_completion_tokens(spec: ModelSpec, w: Workload) -> int:
    """Tokens of one row after its prompt, the sequence the rollout caches and the update scores: tool_turns + 1 model
    turns of completion_tokens, and per tool turn its text (tool_text_tokens) and image tokens at the pixel cap; at most
    max_total_tokens (when set). Single-turn: completion_tokens."""
    tokens = (w.tool_turns + 1) * w.completion_tokens + w.tool_turns * w.tool_text_tokens + tool_images(w) * image_tokens(spec, w.max_pixels)
    return min(tokens, w.max_total_tokens) if w.max_total_tokens > 0 else tokens


def unique_prompts(micro_batch: int, generations: int) -> int:
    """Prompts among `micro_batch` consecutive rows when rows are prompt-major, `generations` per prompt: N / G rounded
    up when one divides the other, else one more (the bound for a micro-batch not aligned to the groups), at most N."""
    n, g = micro_batch, generations
    return math.ceil(n / g) if (n % g == 0 or g % n == 0) else min(n, math.ceil(n / g) + 1)


@dataclass(frozen=True)
class MicroBatch:
    """The token shape of one forward/backward micro-batch (what the activation terms are counted over)."""

    patches: int  # vision patches of one prompt (its images + its video)
    vision_tokens: int  # LLM tokens of those patches (images + video)
    video_tokens: int  # of which the video's
    P: int  # prompt tokens of one row: text + video timestamps + vision tokens
    C: int  # completion tokens of one row
    N: int  # rows (completions) in the micro-batch
    U: int  # distinct prompts among them (N without grouped vision)
    prefix: bool  # the shared-prefix path runs (prompt once per prompt, completions against its cache)
    encodes: int  # prompt encodes of the vision pass
    naive_video: bool  # a batch with videos takes the naive path (each row encodes its own pixels)
    fallback: bool  # the family has no fast paths: grouped vision and the shared prefix fell back (naive_fallback)
    pixel_bytes: int  # float32 pixel values of one prompt
    tool_patches: int = 0  # vision patches of one row's tool images (each row has its own: not shared by its group)

    @property
    def text_tokens(self) -> int:
        """Decoder tokens of the micro-batch: U prompts + N completions on the shared prefix, else N whole rows."""
        return (self.U * self.P + self.N * self.C) if self.prefix else self.N * (self.P + self.C)

    @property
    def segments(self) -> tuple:
        """((rows, length), ...) of the decoder passes: prompt pass and completion pass on the shared prefix."""
        return ((self.U, self.P), (self.N, self.C - 1)) if self.prefix else ((self.N, self.P + self.C),)

    @property
    def attention_calls(self) -> tuple:
        """((rows, queries, keys), ...) of one decoder layer's attention calls."""
        P, C, U, N = self.P, self.C, self.U, self.N
        return ((U, P, P), (N, C - 1, P + C - 1)) if self.prefix else ((N, P + C, P + C),)

    @property
    def vision_patches(self) -> int:
        """Patches the vision pass encodes: the prompts' (once per encode) and every row's tool images."""
        return self.encodes * self.patches + self.N * self.tool_patches


def micro_batch(spec: ModelSpec, w: Workload, fallback: bool = False) -> MicroBatch:
    """The MicroBatch of `w` (already through naive_fallback; `fallback`: whether it fell back)."""
    patches, vision_tokens = prompt_vision(spec, w)
    U = unique_prompts(w.micro_batch, w.num_generations) if w.group_vision else w.micro_batch
    prefix = w.shared_prefix and w.group_vision and not w.gradient_checkpointing and spec.v_layers > 0
    encodes, naive_video = vision_encodes(spec, w, U, prefix)
    return MicroBatch(
        patches=patches,
        vision_tokens=vision_tokens,
        video_tokens=math.prod(video_grid(spec, w)) // spec.merge_size**2,
        P=w.prompt_text_tokens + video_text_tokens(spec, w) + vision_tokens,
        C=multiturn_completion_tokens(spec, w),
        N=w.micro_batch,
        U=U,
        prefix=prefix,
        encodes=encodes,
        naive_video=naive_video,
        fallback=fallback,
        pixel_bytes=patches * 3 * spec.temporal_patch * spec.patch_size**2 * 4,
        tool_patches=tool_images(w) * image_patches(spec, w.max_pixels),
    )
