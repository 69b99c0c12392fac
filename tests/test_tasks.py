"""Built-in synthetic tasks: determinism, balance, correct answers, and that they load as user data."""

import hashlib
import json
import time
from collections import Counter

import pytest
from PIL import Image

from vlmrl.data.rows import load_dataset_split
from vlmrl.rewards.functions import accuracy, iou, parse_box
from vlmrl.data.tasks import BACKGROUNDS, PALETTE, TASKS, make_count_task, make_ground_task


def _digest(folder):
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _colour_pixels(im, rgb):
    colours = im.getcolors(maxcolors=64)  # no anti-aliasing, so only a handful of colours
    assert colours is not None
    return {colour: n for n, colour in colours}.get(rgb, 0)


@pytest.mark.parametrize("make", [make_count_task, make_ground_task])
def test_same_seed_same_bytes_other_seed_differs(tmp_path, make):
    make(tmp_path / "a", n_train=12, n_test=4, seed=5, image_size=56)
    make(tmp_path / "b", n_train=12, n_test=4, seed=5, image_size=56)
    make(tmp_path / "c", n_train=12, n_test=4, seed=6, image_size=56)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")
    # Regenerating in place changes nothing, and the test split does not depend on n_train.
    before = _digest(tmp_path / "a")
    make(tmp_path / "a", n_train=12, n_test=4, seed=5, image_size=56)
    assert _digest(tmp_path / "a") == before
    files = make(tmp_path / "d", n_train=3, n_test=4, seed=5, image_size=56)
    assert files["test"].read_bytes() == (tmp_path / "a" / "test.jsonl").read_bytes()


def test_count_task_rows_balance_and_pixels(tmp_path):
    files = make_count_task(tmp_path, n_train=40, n_test=8, seed=1, image_size=112, max_count=4)
    assert set(files) == {"train", "test", "images"}
    rows = _rows(files["train"])
    assert len(rows) == 40 and len(_rows(files["test"])) == 8
    assert Counter(r["solution"] for r in rows) == {"1": 10, "2": 10, "3": 10, "4": 10}
    assert [r["solution"] for r in rows[:8]] != ["1", "2", "3", "4"] * 2  # balanced, but in shuffled order
    assert Counter(r["solution"] for r in _rows(files["test"])) == {"1": 2, "2": 2, "3": 2, "4": 2}
    for r in rows:
        assert r["response"] == f"<answer>{r['solution']}</answer>"
        colour = r["problem"].split()[2]
        assert r["problem"] == f"How many {colour} shapes are there in the image? Output the answer as <answer>N</answer>."
        im = Image.open(tmp_path / r["image"]).convert("RGB")
        assert im.size == (112, 112) and im.getpixel((0, 0)) in BACKGROUNDS.values()
        # Shapes have one size, so the target colour's pixel count is count x one shape's area
        # (squares and circles differ, so bound it by count x [circle area, square area]).
        size = int((112 // 3) * 0.65)
        n = _colour_pixels(im, PALETTE[colour])
        count = int(r["solution"])
        assert count * size * size * 0.7 <= n <= count * size * size, (r, n)
    # The same answers pass the accuracy reward.
    assert accuracy(None, [r["response"] for r in rows], [r["solution"] for r in rows]) == [1.0] * 40


def test_ground_task_boxes_are_correct(tmp_path):
    files = make_ground_task(tmp_path, n_train=36, n_test=0, seed=2, image_size=56)
    rows = _rows(files["train"])
    # 3 colours x 2 shapes = 6 targets, 6 each.
    assert Counter(" ".join(r["problem"].split()[2:4]) for r in rows) == {
        f"{c} {k}": 6 for c in ("red", "green", "blue") for k in ("square", "circle")
    }
    assert _rows(files["test"]) == []
    for r in rows:
        colour, kind = r["problem"].split()[2:4]
        assert r["problem"] == f"Locate the {colour} {kind} in the image. Output its bounding box as <answer>[x1, y1, x2, y2]</answer>."
        x1, y1, x2, y2 = (int(v) for v in json.loads(r["solution"]))
        assert r["response"] == f"<answer>{r['solution']}</answer>"
        assert 0 <= x1 < x2 <= 56 and 0 <= y1 < y2 <= 56 and x2 - x1 == y2 - y1
        im = Image.open(tmp_path / r["image"]).convert("RGB")
        rgb = PALETTE[colour]
        assert im.getpixel(((x1 + x2) // 2, (y1 + y2) // 2)) == rgb
        # The box is tight: a square fills it exactly; a circle leaves the corners to the background.
        inside = _colour_pixels(im.crop((x1, y1, x2, y2)), rgb)
        if kind == "square":
            assert inside == (x2 - x1) * (y2 - y1)  # a square fills its box exactly
            assert im.getpixel((x1 - 1, y1)) != rgb and im.getpixel((x2, y1)) != rgb  # and not one pixel more
        else:
            assert inside < (x2 - x1) * (y2 - y1)  # the corners of a circle's box are background
            assert im.getpixel((x1, y1)) != rgb
    assert iou(None, [r["response"] for r in rows], [r["solution"] for r in rows]) == [1.0] * 36
    assert parse_box(rows[0]["solution"]) is not None


def test_tasks_load_as_user_data(tmp_path):
    for name, make in TASKS.items():
        files = make(tmp_path / name, n_train=10, n_test=2, seed=0, image_size=56)
        rows, report = load_dataset_split(files["train"], limit_images=1, skip_bad_rows=False)
        assert report.kept_rows == 10 and report.num_images == 10
        assert all(len(r["images"]) == 1 and r["images"][0].startswith(str(tmp_path)) for r in rows)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown colour"):
        make_count_task(tmp_path, n_train=1, n_test=0, colours=("red", "mauve"))
    with pytest.raises(ValueError, match="too small"):
        make_count_task(tmp_path, n_train=1, n_test=0, image_size=20)
    with pytest.raises(ValueError, match="at least 2 distinct colours"):
        make_count_task(tmp_path, n_train=1, n_test=0, colours=("red",))
    make_count_task(tmp_path, n_train=2, n_test=0, colours=("red",), distractors=False)
    with pytest.raises(ValueError, match="max_shapes"):
        make_ground_task(tmp_path, n_train=1, n_test=0, colours=("red",), max_shapes=3)


def test_fast_enough(tmp_path):
    start = time.perf_counter()
    make_count_task(tmp_path, n_train=500, n_test=0, image_size=112)
    assert time.perf_counter() - start < 5.0
