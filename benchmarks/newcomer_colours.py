"""A VQA set no test uses, for trying the newcomer path (benchmarks/results/newcomer_path_cpu_2026-11-23.md):
"What colour is the shape?" -- one square or circle in one of 4 colours (chance 25%), random size and place, on a
random grey background, 48-80 px images -- written as parquet with the images embedded as PNG bytes by `datasets`
(a `datasets.Image` column), the way hub datasets ship.

    python benchmarks/newcomer_colours.py colours      # colours/train.parquet (1,200 rows), colours/test.parquet (200)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 70, 230), "yellow": (235, 210, 40)}
PROBLEM = "What colour is the shape? Answer with <answer>colour</answer>."


def draw(rng: random.Random):
    """(PIL image, colour name) of one shape."""
    from PIL import Image, ImageDraw

    side = rng.choice([48, 64, 80])
    image = Image.new("RGB", (side, side), tuple(rng.randint(90, 160) for _ in range(3)))
    name = rng.choice(sorted(COLOURS))
    s = rng.randint(side // 5, side // 2)
    x, y = rng.randint(0, side - s), rng.randint(0, side - s)
    draw_shape = ImageDraw.Draw(image).rectangle if rng.random() < 0.5 else ImageDraw.Draw(image).ellipse
    draw_shape([x, y, x + s, y + s], fill=COLOURS[name])
    return image, name


def split(n: int, seed: int):
    import datasets

    rng = random.Random(seed)
    rows = [draw(rng) for _ in range(n)]
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"), "solution": datasets.Value("string")})
    return datasets.Dataset.from_dict(
        {"image": [im for im, _ in rows], "problem": [PROBLEM] * n, "solution": [name for _, name in rows]}, features=features
    )


def main(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    split(1200, 1).to_parquet(f"{out}/train.parquet")
    split(200, 2).to_parquet(f"{out}/test.parquet")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "colours")
