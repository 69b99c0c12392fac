"""Small data files in other trainers' published layouts, with PIL-drawn images, for the tests of formats.py.

Each writer follows the layout as the peer documents it (the column names, where images live, how paths are
relative); the rows ask how many red squares an image holds, so a correct answer is known."""

from __future__ import annotations

import io
import json
from pathlib import Path

from PIL import Image, ImageDraw

QUESTION = "How many red squares are there?"


def draw(path: Path | None, count: int, size: int = 56) -> bytes:
    """An image with `count` red squares on white; written to `path` when given; returns its PNG bytes."""
    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    for i in range(count):
        x = 4 + (i % 3) * 16
        y = 4 + (i // 3) * 16
        pen.rectangle([x, y, x + 10, y + 10], fill="red")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trl_standard(folder: Path, n: int = 4) -> Path:
    """TRL's standard prompt-only form: a `prompt` string, an `image`, the `solution` and an extra column."""
    rows = []
    for i in range(n):
        draw(folder / "img" / f"{i}.png", 1 + i % 3)
        rows.append({"prompt": QUESTION, "image": f"img/{i}.png", "solution": str(1 + i % 3), "source": "drawn"})
    return _jsonl(folder / "train.jsonl", rows)


def trl_conversational(folder: Path, n: int = 4) -> Path:
    """TRL's conversational form: `prompt` chat messages with a system turn and image / text content blocks;
    solutions in LaTeX as in TRL's math datasets."""
    rows = []
    for i in range(n):
        draw(folder / "img" / f"{i}.png", 1 + i % 3)
        prompt = [
            {"role": "system", "content": "Put the final answer in <answer></answer>."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        ]
        rows.append({"prompt": prompt, "image": f"img/{i}.png", "solution": f"${1 + i % 3}$"})
    return _jsonl(folder / "train.jsonl", rows)


def vlm_r1(folder: Path, n: int = 4) -> tuple[Path, Path]:
    """VLM-R1's JSONL: `id`, `image` relative to the launcher's --image_folders, `conversations` of one human turn
    with `<image>` and one gpt turn holding the answer. Returns (the JSONL, the image folder)."""
    images = folder / "coco"
    rows = []
    for i in range(n):
        draw(images / f"train_{i}.png", 1 + i % 3)
        conversations = [{"from": "human", "value": f"<image>{QUESTION}"}, {"from": "gpt", "value": str(1 + i % 3)}]
        rows.append({"id": i, "image": f"train_{i}.png", "conversations": conversations})
    return _jsonl(folder / "annotations" / "train.jsonl", rows), images


def easyr1(folder: Path, n: int = 4) -> Path:
    """EasyR1's parquet: `images` as a list of embedded image structs, `problem` with an `<image>` placeholder, `answer`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = [[{"bytes": draw(None, 1 + i % 3), "path": None}] for i in range(n)]
    table = pa.table({"images": images, "problem": [f"<image>{QUESTION}"] * n, "answer": [str(1 + i % 3) for i in range(n)]})
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "train.parquet")
    return folder / "train.parquet"


def ms_swift(folder: Path, n: int = 4) -> Path:
    """ms-swift's GRPO JSONL: `messages` (a system and a user turn with `<image>`), `images`, `solution`."""
    rows = []
    for i in range(n):
        draw(folder / "img" / f"{i}.png", 1 + i % 3)
        messages = [
            {"role": "system", "content": "Think, then answer in <answer></answer>."},
            {"role": "user", "content": f"<image>{QUESTION}"},
        ]
        rows.append({"messages": messages, "images": [f"img/{i}.png"], "solution": f"<answer>{1 + i % 3}</answer>"})
    return _jsonl(folder / "train.jsonl", rows)


def llava_instruct(folder: Path, n: int = 4) -> Path:
    """LLaVA-Instruct's JSON: a list of {id, image, conversations} with several human / gpt turns, `<image>` in the first."""
    rows = []
    for i in range(n):
        count = 1 + i % 3
        draw(folder / "images" / f"{i:012d}.png", count)
        conversations = [
            {"from": "human", "value": f"<image>\n{QUESTION}"},
            {"from": "gpt", "value": f"There are {count}."},
            {"from": "human", "value": "What colour is the background?"},
            {"from": "gpt", "value": "White."},
        ]
        rows.append({"id": f"{i:012d}", "image": f"{i:012d}.png", "conversations": conversations})
    (folder / "llava_instruct.json").write_text(json.dumps(rows))
    return folder / "llava_instruct.json"


def imagefolder(folder: Path, n: int = 4) -> Path:
    """A `datasets` imagefolder: the images beside a metadata.jsonl whose `file_name` names each row's image."""
    rows = []
    for i in range(n):
        draw(folder / f"{i}.png", 1 + i % 3)
        rows.append({"file_name": f"{i}.png", "problem": QUESTION, "solution": str(1 + i % 3)})
    _jsonl(folder / "metadata.jsonl", rows)
    return folder
