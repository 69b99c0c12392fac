"""Built-in synthetic tasks, written to disk in the same format as user data (JSONL + PNG).

Both tasks are deterministic: the same arguments give byte-identical files, and each split has its own
random stream, so the test split does not change when n_train does. Shapes sit in distinct cells of a
grid with at least two background pixels between them, so they never overlap or touch and drawing is
exact (no anti-aliasing): every pixel of a shape has its colour.

Files: ``out_dir/train.jsonl``, ``out_dir/test.jsonl`` and ``out_dir/images/<split>_<index>.png``; rows use
relative image paths. Files whose bytes are unchanged are not rewritten, and every write is atomic, so
several processes (e.g. one per GPU) may generate the same task at once. Images left over from an earlier,
larger run are not deleted (nothing refers to them).
"""

from __future__ import annotations

import io
import json
import math
import os
import random
from pathlib import Path
from typing import Callable

from PIL import Image, ImageDraw

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "green": (30, 190, 40),
    "blue": (40, 80, 240),
    "yellow": (240, 220, 30),
    "purple": (150, 50, 210),
    "orange": (250, 140, 20),
    "cyan": (30, 210, 220),
    "pink": (250, 120, 190),
}
BACKGROUNDS = {"black": (0, 0, 0), "white": (255, 255, 255)}
SHAPES = ("square", "circle")
MAX_DISTRACTORS = 3  # distractor shapes per counting image: 0..3


# ---------------------------------------------------------------------------------------------------
# Drawing helpers


def _grid(image_size: int, cells_needed: int, min_cell: int = 8) -> tuple[int, int, int]:
    """(cells per side, cell size, margin) of the smallest square grid with enough cells, centred."""
    side = math.ceil(math.sqrt(cells_needed))
    cell = image_size // side
    if cell < min_cell:
        raise ValueError(f"image_size={image_size} is too small for {cells_needed} shapes (cells of {cell}px < {min_cell}px)")
    return side, cell, (image_size - side * cell) // 2


def _place(rng: random.Random, n: int, sizes: list[int], grid: tuple[int, int, int]) -> list[tuple[int, int, int, int]]:
    """Boxes [x1, y1, x2, y2) for n shapes in n distinct random cells, each at least 1px from its cell edge."""
    side, cell, margin = grid
    cells = rng.sample(range(side * side), n)
    boxes = []
    for c, s in zip(cells, sizes):
        row, col = divmod(c, side)
        x = margin + col * cell + rng.randint(1, cell - s - 1)
        y = margin + row * cell + rng.randint(1, cell - s - 1)
        boxes.append((x, y, x + s, y + s))
    return boxes


def _draw(image_size: int, background: str, shapes: list[tuple[str, str, tuple[int, int, int, int]]]) -> bytes:
    """PNG bytes of the shapes (kind, colour, box) on a plain background."""
    im = Image.new("RGB", (image_size, image_size), BACKGROUNDS[background])
    draw = ImageDraw.Draw(im)
    for kind, colour, (x1, y1, x2, y2) in shapes:
        xy = [x1, y1, x2 - 1, y2 - 1]  # PIL boxes include their last pixel
        if kind == "square":
            draw.rectangle(xy, fill=PALETTE[colour])
        else:
            draw.ellipse(xy, fill=PALETTE[colour])
    buf = io.BytesIO()
    im.save(buf, format="PNG")  # PNG without metadata: identical pixels give identical bytes
    return buf.getvalue()


def _write(path: Path, data: bytes) -> None:
    """Write atomically, and not at all when the file already holds these bytes."""
    if path.exists() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _check_colours(colours: tuple[str, ...], minimum: int) -> None:
    unknown = [c for c in colours if c not in PALETTE]
    if unknown:
        raise ValueError(f"unknown colour(s) {', '.join(unknown)}; known: {', '.join(PALETTE)}")
    if len(set(colours)) < minimum:
        raise ValueError(f"need at least {minimum} distinct colours, got {colours}")


def _balanced(rng: random.Random, values: list, n: int) -> list:
    """n values cycling through `values`, shuffled: each appears n // len(values) or one more times."""
    out = [values[i % len(values)] for i in range(n)]
    rng.shuffle(out)
    return out


def _write_splits(
    out_dir, task: str, splits: dict[str, int], make_row: Callable[[random.Random, object, str], dict], targets: Callable[[random.Random, int], list]
) -> dict[str, Path]:
    """Generate each split with its own seeded stream and write images and JSONL."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {"images": out / "images"}
    for split, n in splits.items():
        if n < 0:
            raise ValueError(f"n_{split} must be >= 0, got {n}")
        rng = random.Random(f"vlmrl-{task}:{split}")
        lines = []
        for i, target in enumerate(targets(rng, n)):
            rel = f"images/{split}_{i:05d}.png"
            row = make_row(rng, target, rel)
            _write(out / rel, row.pop("_png"))
            lines.append(json.dumps(row) + "\n")
        files[split] = out / f"{split}.jsonl"
        _write(files[split], "".join(lines).encode("utf-8"))
    return files


# ---------------------------------------------------------------------------------------------------
# Chance levels: ``task.json`` next to a split's file

TASK_INFO = "task.json"


def write_task_info(out_dir: str | os.PathLike, info: dict) -> None:
    """``out_dir/task.json``: what the task is and the eval metrics' chance levels (``{"chance": {"accuracy": 0.25}}``),
    which report.png draws as a baseline. User data can hold one too, next to its eval file."""
    _write(Path(out_dir) / TASK_INFO, (json.dumps(info, sort_keys=True) + "\n").encode("utf-8"))


def chance_levels(eval_path: str | os.PathLike) -> dict[str, float]:
    """{metric: chance level} from the ``task.json`` beside `eval_path` (a file) or inside it (a datasets folder);
    {} when there is none or it is unreadable: a baseline is drawn only where the task defines one."""
    path = Path(eval_path)
    info_file = path / TASK_INFO if path.is_dir() else path.parent / TASK_INFO
    try:
        chance = json.loads(info_file.read_text(encoding="utf-8")).get("chance", {})
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(chance, dict):
        return {}
    return {str(k): float(v) for k, v in chance.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


# ---------------------------------------------------------------------------------------------------
# Tasks


def make_count_task(
    out_dir: str | os.PathLike,
    *,
    n_train: int,
    n_test: int,
    seed: int = 0,
    image_size: int = 112,
    max_count: int = 4,
    colours: tuple[str, ...] = ("red", "green", "blue"),
    distractors: bool = True,
) -> dict[str, Path]:
    """Counting: "How many red shapes are there?" over 1..max_count same-size squares/circles of the target
    colour plus 0..3 distractors of the other colours, on black or white.

    Answers are balanced over 1..max_count within each split. Rows: image, problem, solution ("3"),
    response ("<answer>3</answer>"). Returns {"train", "test", "images"} paths.
    """
    if max_count < 1:
        raise ValueError(f"max_count must be >= 1, got {max_count}")
    _check_colours(colours, 2 if distractors else 1)
    grid = _grid(image_size, max_count + (MAX_DISTRACTORS if distractors else 0))
    size = max(3, int(grid[1] * 0.65))

    def make_row(rng: random.Random, count: int, rel: str) -> dict:
        colour = rng.choice(colours)
        others = [c for c in colours if c != colour]
        n_distract = rng.randint(0, MAX_DISTRACTORS) if distractors else 0
        palette = [colour] * count + [rng.choice(others) for _ in range(n_distract)]
        boxes = _place(rng, len(palette), [size] * len(palette), grid)
        shapes = [(rng.choice(SHAPES), c, box) for c, box in zip(palette, boxes)]
        png = _draw(image_size, rng.choice(list(BACKGROUNDS)), shapes)
        return {
            "image": rel,
            "problem": f"How many {colour} shapes are there in the image? Output the answer as <answer>N</answer>.",
            "solution": str(count),
            "response": f"<answer>{count}</answer>",
            "_png": png,
        }

    counts = list(range(1, max_count + 1))
    files = _write_splits(out_dir, f"count:{seed}", {"train": n_train, "test": n_test}, make_row, lambda rng, n: _balanced(rng, counts, n))
    # Answers are balanced over 1..max_count: guessing (or always one answer) scores 1 / max_count.
    write_task_info(out_dir, {"task": "count", "chance": {"accuracy": 1 / max_count}})
    return files


def make_ground_task(
    out_dir: str | os.PathLike,
    *,
    n_train: int,
    n_test: int,
    seed: int = 0,
    image_size: int = 112,
    colours: tuple[str, ...] = ("red", "green", "blue"),
    min_shapes: int = 2,
    max_shapes: int = 4,
) -> dict[str, Path]:
    """Referring expression comprehension (VLM-R1's REC task in miniature): "Locate the blue circle".

    Each image has min_shapes..max_shapes shapes of distinct (colour, shape) combinations and of varied
    sizes; the target combination occurs exactly once, and targets are balanced over all combinations.
    solution is "[x1, y1, x2, y2]" in integer pixel coordinates of the image with x2/y2 exclusive (width =
    x2 - x1), response "<answer>[x1, y1, x2, y2]</answer>". Returns {"train", "test", "images"} paths.
    """
    _check_colours(colours, 1)
    combos = [(c, k) for c in colours for k in SHAPES]
    if not 1 <= min_shapes <= max_shapes or max_shapes > len(combos):
        raise ValueError(f"need 1 <= min_shapes <= max_shapes <= {len(combos)} (distinct colour/shape pairs), got {min_shapes}..{max_shapes}")
    grid = _grid(image_size, max_shapes)
    cell = grid[1]
    small, large = max(3, int(cell * 0.45)), cell - 2

    def make_row(rng: random.Random, target: tuple[str, str], rel: str) -> dict:
        others = rng.sample([c for c in combos if c != target], rng.randint(min_shapes, max_shapes) - 1)
        chosen = [target] + others
        boxes = _place(rng, len(chosen), [rng.randint(small, large) for _ in chosen], grid)
        png = _draw(image_size, rng.choice(list(BACKGROUNDS)), [(k, c, box) for (c, k), box in zip(chosen, boxes)])
        box = "[{}, {}, {}, {}]".format(*boxes[0])
        colour, kind = target
        return {
            "image": rel,
            "problem": f"Locate the {colour} {kind} in the image. Output its bounding box as <answer>[x1, y1, x2, y2]</answer>.",
            "solution": box,
            "response": f"<answer>{box}</answer>",
            "_png": png,
        }

    return _write_splits(out_dir, f"ground:{seed}", {"train": n_train, "test": n_test}, make_row, lambda rng, n: _balanced(rng, combos, n))


TASKS: dict[str, Callable[..., dict[str, Path]]] = {"count": make_count_task, "ground": make_ground_task}


# ---------------------------------------------------------------------------------------------------
# The zoom task (issue 28): a detail too small to read at the model's pixel budget


CORNERS = ("top-left", "top-right", "bottom-left", "bottom-right")


def zoom_spots(image_size: int, seen_size: int, spots: int) -> list[tuple[list[int], tuple[int, int]]]:
    """The candidate places of the zoom task's detail: for each, the box a zoom must ask for, in the pixels of the image
    the model sees (``seen_size`` a side, Qwen2.5-VL's convention), and the original-pixel top-left corner of that box.

    Spots sit at the centres of a ``side x side`` grid (``spots`` must be a square: 1, 4, 9); each box is 2 seen
    pixels a side, so the detail (half a box) is one seen pixel and the zoomed box shows it ~28 pixels across."""
    side = math.isqrt(spots)
    if side * side != spots or side < 1:
        raise ValueError(f"spots must be a square number (1, 4, 9, ...), got {spots}")
    if image_size % seen_size:
        raise ValueError(f"image_size ({image_size}) must be a multiple of seen_size ({seen_size})")
    scale, cell = image_size // seen_size, seen_size // side
    out = []
    for i in range(spots):
        row, col = divmod(i, side)
        x, y = col * cell + cell // 2 - 1, row * cell + cell // 2 - 1
        out.append(([x, y, x + 2, y + 2], (x * scale, y * scale)))
    return out


def _corner_square(draw: ImageDraw.ImageDraw, x: int, y: int, size: int, missing: str) -> None:
    """A white ``size`` square at (x, y) made of 2x2 blocks with the `missing` block left out: the same ink for every
    answer, so the blurred detail (one seen pixel) says nothing about which corner is missing."""
    half = size // 2
    for name, (bx, by) in zip(CORNERS, ((0, 0), (half, 0), (0, half), (half, half))):
        if name != missing:
            draw.rectangle([x + bx, y + by, x + bx + half - 1, y + by + half - 1], fill=(255, 255, 255))


def make_zoom_task(
    out_dir: str | os.PathLike,
    *,
    n_train: int,
    n_test: int,
    seed: int = 0,
    image_size: int = 448,
    seen_size: int = 56,
    spots: int = 4,
    jitter: int | None = None,
    corner_aligned: bool = False,
) -> dict[str, Path]:
    """Zoom: "Which corner of the small square is missing?" about a white square (2x2 blocks, one missing) drawn
    one seen pixel wide at one of `spots` places of a black ``image_size`` image; at a pixel budget of ``seen_size``
    squared (data.max_pixels = seen_size**2) the model sees it as a blur, and reads it only by zooming into its box.

    Answers are balanced over CORNERS (chance 25%). Rows: image, problem, solution ("top-left"), response
    ("<answer>top-left</answer>"), zoom_box (the box to zoom into, in seen pixels: what the tool call must ask for).
    The square is centred in its box and moved by up to `jitter` original pixels (default a quarter of its side) each
    way, so its blurred centre of mass (1/12 of its side off centre, towards the filled corners) does not give the
    answer away, while the zoomed box still shows its blocks in about the same place. `corner_aligned` puts the square
    in its box's top-left quarter instead (with jitter 0: exactly one seen pixel), so that zoomed 2x2 boxes seen at 56x56
    show it as one image token whose four patches are its four blocks: which corner is missing is then that token's
    content (Qwen2.5-VL's merger concatenates the 2x2 patches in order), not which of four tokens is dark, which a
    tiny model reads far more easily. Returns {"train", "test", "images"} paths."""
    places = zoom_spots(image_size, seen_size, spots)
    box_side = 2 * (image_size // seen_size)  # the zoom box in original pixels
    size = box_side // 2
    jitter = (0 if corner_aligned else size // 4) if jitter is None else jitter
    if not 0 <= jitter <= (box_side - size) // 2:
        raise ValueError(f"jitter must be between 0 and {(box_side - size) // 2} pixels, got {jitter}")
    centre = 0 if corner_aligned else (box_side - size) // 2
    if corner_aligned and jitter:
        raise ValueError(f"corner_aligned needs jitter 0, got {jitter}")

    def make_row(rng: random.Random, missing: str, rel: str) -> dict:
        seen_box, (x0, y0) = places[rng.randrange(len(places))]
        im = Image.new("RGB", (image_size, image_size), (0, 0, 0))
        dx, dy = rng.randint(-jitter, jitter), rng.randint(-jitter, jitter)
        _corner_square(ImageDraw.Draw(im), x0 + centre + dx, y0 + centre + dy, size, missing)
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        return {
            "image": rel,
            "problem": "Which corner of the small square is missing? Output the answer as <answer>corner</answer>.",
            "solution": missing,
            "response": f"<answer>{missing}</answer>",
            "zoom_box": seen_box,
            "_png": buf.getvalue(),
        }

    files = _write_splits(out_dir, f"zoom:{seed}", {"train": n_train, "test": n_test}, make_row, lambda rng, n: _balanced(rng, list(CORNERS), n))
    write_task_info(out_dir, {"task": "zoom", "chance": {"accuracy": 1 / len(CORNERS)}, "seen_size": seen_size})
    return files
