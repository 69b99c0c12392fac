"""Data validation sees what the model will see: processor shape limits, the pixel limit, the decoded-image cache."""

import json
import struct
import zlib

import pytest
from PIL import Image

from vlmrl.config import ConfigError, load_config
from vlmrl.data.media import DEFAULT_MAX_IMAGE_PIXELS, ImageCache, load_images, shared_image_cache
from vlmrl.data.errors import DataError
from vlmrl.data.rows import load_dataset_split
from vlmrl.models.processing import ImageShapeCheck, encode_prompts, load_processor

BOUNDS = (28 * 28, 448 * 448)


def _data(tmp_path, sizes):
    """One row per image size; returns the jsonl path."""
    rows = []
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (200, 10, 10)).save(tmp_path / f"{i}.png")
        rows.append({"image": f"{i}.png", "problem": "How many?", "solution": "1"})
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _png_header_only(path, width, height):
    """A PNG whose header declares width x height but holds one byte of data: opening it allocates nothing."""

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b""))
    return path


@pytest.fixture(scope="module")
def qwen_processor(tiny_qwen25vl):
    return load_processor(tiny_qwen25vl, min_pixels=BOUNDS[0], max_pixels=BOUNDS[1])


def test_extreme_aspect_fails_validation_with_file_line_not_step_1(tmp_path, qwen_processor):
    path = _data(tmp_path, [(56, 56), (1, 30000), (1000, 5)])  # 1000x5 is exactly 200:1, which smart_resize accepts
    check = ImageShapeCheck(qwen_processor, *BOUNDS, DEFAULT_MAX_IMAGE_PIXELS)
    with pytest.raises(DataError) as e:
        load_dataset_split(path, limit_images=1, skip_bad_rows=False, shape_check=check)
    assert f"{path}:2: image: " in str(e.value) and "side ratio 30000:1 is over the 200:1" in str(e.value)
    assert f"{path}:1" not in str(e.value) and f"{path}:3" not in str(e.value)
    rows, report = load_dataset_split(path, limit_images=1, skip_bad_rows=True, shape_check=check)
    assert report.problem_counts == {"image_shape": 1} and [r["_source"] for r in rows] == [f"{path}:1", f"{path}:3"]
    # What validation lets through, the processor takes; what it refuses, the processor raises on (step 1's crash).
    images = [load_images(r["images"], *BOUNDS) for r in rows]
    batch = encode_prompts(qwen_processor, ["<|vision_start|><|image_pad|><|vision_end|>"] * 2, images)
    assert batch["image_grid_thw"].shape == (2, 3)
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        qwen_processor.image_processor(images=load_images([str(tmp_path / "1.png")], *BOUNDS), return_tensors="pt")


def test_ratio_made_extreme_by_upscaling_is_caught(tmp_path, qwen_processor):
    # 300x1 upscaled to min_pixels becomes 485x2 (242:1): the check uses the size after vlmrl's resize.
    check = ImageShapeCheck(qwen_processor, *BOUNDS, DEFAULT_MAX_IMAGE_PIXELS)
    assert "after resizing to 485x2" in check(300, 1) and check(200, 1) is None and check(56, 56) is None


def test_shortest_edge_processor_refuses_strips_it_would_blow_up(tmp_path, tiny_llava):
    processor = load_processor(tiny_llava)
    check = ImageShapeCheck(processor, *BOUNDS, DEFAULT_MAX_IMAGE_PIXELS)
    reason = check(1, 30000)
    assert "would first scale it to 94,080,000 pixels" in reason and "data.max_image_pixels=89,478,485" in reason
    assert check(5, 1000) is None  # 56 x 11,200: fine (and run through the processor, as an unusual shape)


def test_probe_reports_what_an_unknown_processor_raises():
    class Picky:
        size = {"height": 32, "width": 32}

        def __call__(self, images, return_tensors):
            if min(images[0].size) < 8:
                raise ValueError("side under 8 pixels")
            return {}

    class Proc:
        image_processor = Picky()

    check = ImageShapeCheck(Proc(), None, None, DEFAULT_MAX_IMAGE_PIXELS)
    assert check(4, 100) == "Picky rejects it: ValueError: side under 8 pixels" and check(64, 64) is None


def test_oversized_header_is_refused_before_decoding(tmp_path):
    _png_header_only(tmp_path / "0.png", 100_000, 100_000)  # 10 GP: decoding would need 30 GB
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"image": "0.png", "problem": "p", "solution": "1"}) + "\n")
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(DataError) as e:
        load_dataset_split(path, limit_images=1, skip_bad_rows=False)
    assert f"{path}:1: image: " in str(e.value)
    assert "100000x100000 = 10,000,000,000 pixels, over data.max_image_pixels=89,478,485" in str(e.value)
    assert Image.MAX_IMAGE_PIXELS == before  # PIL's global guard is restored
    with pytest.raises(DataError, match="over data.max_image_pixels"):
        load_images([str(tmp_path / "0.png")], None, None)
    # Raised past the limit, the file is decoded, and is then found to be broken (not refused for its size).
    with pytest.raises(DataError, match="cannot read image"):
        load_dataset_split(path, limit_images=1, skip_bad_rows=False, max_image_pixels=10**10)


def test_configured_pixel_limit_is_applied(tmp_path):
    path = _data(tmp_path, [(100, 100), (50, 50)])
    with pytest.raises(DataError, match=r":1: image: .*100x100 = 10,000 pixels, over data.max_image_pixels=5,000"):
        load_dataset_split(path, limit_images=1, skip_bad_rows=False, max_image_pixels=5000)
    _, report = load_dataset_split(path, limit_images=1, skip_bad_rows=True, max_image_pixels=5000)
    assert report.problem_counts == {"image_too_large": 1}
    with pytest.raises(DataError, match="over data.max_image_pixels=5,000"):
        load_images([str(tmp_path / "0.png")], None, None, max_image_pixels=5000)
    with pytest.raises(ConfigError, match="data.max_image_pixels=0 must be >= 1"):
        load_config(None, ["data.max_image_pixels=0"])
    assert load_config(None, []).data.max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS


def test_cache_hits_equal_a_fresh_decode_and_respect_the_budget(tmp_path):
    paths = [str(tmp_path / f"{i}.png") for i in range(3)]
    for i, p in enumerate(paths):
        Image.new("RGB", (40, 30), (i * 50, 0, 0)).save(p)
    cache = ImageCache(budget_bytes=2 * 40 * 30 * 3)  # room for two images
    first = load_images(paths[:2], None, None, cache=cache)
    again = load_images(paths[:2], None, None, cache=cache)
    assert cache.stats() == {"hits": 2, "misses": 2, "evictions": 0, "images": 2, "bytes": 7200}
    assert all(a is b for a, b in zip(first, again))
    fresh = load_images(paths[:2], None, None)
    assert all(a.tobytes() == b.tobytes() and a.size == b.size for a, b in zip(again, fresh))
    load_images([paths[2]], None, None, cache=cache)  # evicts the least recently used
    assert cache.stats()["evictions"] == 1 and len(cache) == 2
    load_images([paths[1]], None, None, cache=cache)
    assert cache.hits == 3
    load_images([paths[1]], 28 * 28, None, cache=cache)  # other resize bounds: another entry
    assert cache.misses == 4
    Image.new("RGB", (40, 30), (0, 0, 255)).save(paths[1])  # a rewritten file is never served stale
    import os

    os.utime(paths[1], ns=(1, 1))
    (img,) = load_images([paths[1]], None, None, cache=cache)
    assert img.getpixel((0, 0)) == (0, 0, 255) and cache.misses == 5
    assert shared_image_cache(0) is None and shared_image_cache(1) is shared_image_cache(1)


def test_training_set_up_validates_with_the_models_processor(tmp_path, tiny_qwen25vl):
    from vlmrl.run.datasets import load_datasets

    path = _data(tmp_path, [(56, 56), (30000, 1)])
    cfg = load_config(None, [f"model.name_or_path={tiny_qwen25vl}", f"data.train_path={path}", "data.eval_path=" + str(path)])
    with pytest.raises(DataError, match=rf"{path}:2: image: .*side ratio 30000:1"):
        load_datasets(cfg)


def test_a_refusal_validation_did_not_foresee_still_names_the_rows(tmp_path, tiny_qwen25vl, qwen_processor):
    import torch

    from vlmrl.run.datasets import encode_rows

    path = _data(tmp_path, [(56, 56), (30000, 1)])
    rows, _ = load_dataset_split(path, limit_images=1, skip_bad_rows=False)  # no shape check: the strip gets through
    cfg = load_config(None, [f"model.name_or_path={tiny_qwen25vl}"])
    with pytest.raises(
        DataError,
        match=rf"refused a batch of rows: {path}:1 \(images \['56x56'\]\); {path}:2 \(images \['30000x1'\]\): "
        "ValueError: absolute aspect ratio must be smaller than 200",
    ):
        encode_rows(qwen_processor, rows, cfg, torch.device("cpu"))
