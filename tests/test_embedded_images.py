"""Datasets with images embedded as bytes: datasets.Image columns, parquet {bytes, path} structs, raw bytes, data URIs."""

import base64
import io
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlmrl.data.errors import DataError
from vlmrl.data.rows import load_dataset_split
from vlmrl.data.readers import load_rows
from vlmrl.data.media import load_images


def png_bytes(colour, size=(6, 5)):
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(colour):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="JPEG")
    return buf.getvalue()


FEATURES = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"), "solution": datasets.Value("string")})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("VLMRL_CACHE", str(folder))
    return folder / "images"


def _pixel(path):
    (im,) = load_images([path], None, None)
    return im.getpixel((0, 0))


def test_datasets_image_column_save_to_disk_and_parquet(tmp_path, cache):
    ds = datasets.Dataset.from_dict(
        {"image": [Image.new("RGB", (6, 5), "red"), Image.new("RGB", (7, 3), "blue")], "problem": ["a?", "b?"], "solution": ["1", "2"]},
        features=FEATURES,
    )
    ds.save_to_disk(str(tmp_path / "disk"))
    ds.to_parquet(str(tmp_path / "set.parquet"))  # how hub datasets ship: {bytes, path} structs
    for source in (tmp_path / "disk", tmp_path / "set.parquet"):
        rows, report = load_dataset_split(source, limit_images=None, skip_bad_rows=False)
        assert report.num_images == 2
        assert [_pixel(r["images"][0]) for r in rows] == [(255, 0, 0), (0, 0, 255)]
        assert all(p.startswith(str(cache)) and p.endswith(".png") for r in rows for p in r["images"])
        assert not any(isinstance(v, (bytes, dict)) for r in rows for v in r.values())  # no bytes kept in memory
    assert len(list(cache.iterdir())) == 2  # content-addressed: the second file wrote nothing new


def test_list_of_images_and_path_only_structs(tmp_path, cache):
    Image.new("RGB", (5, 5), "green").save(tmp_path / "on_disk.png")
    features = datasets.Features(
        {"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"), "solution": datasets.Value("string")}
    )
    ds = datasets.Dataset.from_dict(
        {"images": [[Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")]], "problem": ["p"], "solution": ["s"]}, features=features
    )
    ds.save_to_disk(str(tmp_path / "multi"))
    (row,), _ = load_dataset_split(tmp_path / "multi", limit_images=None, skip_bad_rows=False)
    assert [_pixel(p) for p in row["images"]] == [(255, 0, 0), (0, 0, 255)]
    # A struct that only points to a file is that path (relative to the data file, like any path).
    table = pa.table({"image": [{"bytes": None, "path": "on_disk.png"}], "problem": ["p"], "solution": ["s"]})
    pq.write_table(table, tmp_path / "paths.parquet")
    (row,), _ = load_dataset_split(tmp_path / "paths.parquet", limit_images=None, skip_bad_rows=False)
    assert row["images"] == [str(tmp_path / "on_disk.png")]


def test_raw_bytes_and_data_uris(tmp_path, cache):
    pq.write_table(pa.table({"image": [jpeg_bytes("white")], "problem": ["p"], "solution": ["s"]}), tmp_path / "raw.parquet")
    (row,), _ = load_dataset_split(tmp_path / "raw.parquet", limit_images=None, skip_bad_rows=False)
    assert row["images"][0].endswith(".jpg") and _pixel(row["images"][0])[0] > 240
    uri = "data:image/png;base64," + base64.b64encode(png_bytes("red")).decode()
    lines = [
        {"image": uri, "problem": "p", "solution": "s"},
        {"image": "data:image/png;base64,@@not-base64@@", "problem": "p", "solution": "s"},
        {"images": ["data:image/png,rawtext"], "problem": "p", "solution": "s"},
    ]
    (tmp_path / "uri.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    rows, report = load_dataset_split(tmp_path / "uri.jsonl", limit_images=None, skip_bad_rows=True)
    assert len(rows) == 1 and _pixel(rows[0]["images"][0]) == (255, 0, 0)
    reasons = [str(p) for p in report.problems]
    assert reasons[0].startswith(f"{tmp_path / 'uri.jsonl'}:2: row: image: data URI holds invalid base64")
    assert reasons[1].startswith(f"{tmp_path / 'uri.jsonl'}:3: row: images: data URI") and "not base64" in reasons[1]


def test_corrupt_and_empty_embedded_images_are_reported_with_their_row(tmp_path, cache):
    good, bad = png_bytes("red"), png_bytes("blue")[:40]  # cut mid-data
    table = pa.table(
        {
            "image": [{"bytes": good, "path": "a.png"}, {"bytes": bad, "path": "b.png"}, {"bytes": b"", "path": None}, {"bytes": None, "path": None}],
            "problem": ["p"] * 4,
            "solution": ["s"] * 4,
        }
    )
    pq.write_table(table, tmp_path / "mixed.parquet")
    with pytest.raises(DataError) as e:
        load_dataset_split(tmp_path / "mixed.parquet", limit_images=None, skip_bad_rows=False)
    text = str(e.value)
    assert f"{tmp_path / 'mixed.parquet'}:row 2: image: cannot read image" in text
    assert f"{tmp_path / 'mixed.parquet'}:row 3: row: image: embedded image has no bytes" in text
    assert (
        f"{tmp_path / 'mixed.parquet'}:row 4: image: expected a path string or a list of them, got an image struct with neither bytes nor path"
        in text
    )
    assert "row 1:" not in text


def test_unwritable_cache_is_one_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")  # the cache folder cannot be created under a file (as with a full or read-only disk)
    monkeypatch.setenv("VLMRL_CACHE", str(blocker))
    pq.write_table(pa.table({"image": [png_bytes("red")], "problem": ["p"], "solution": ["s"]}), tmp_path / "r.parquet")
    with pytest.raises(DataError, match=r"r.parquet:row 1: cannot write its embedded image to the cache .*set VLMRL_CACHE"):
        load_rows(tmp_path / "r.parquet")


def test_truncated_cache_file_is_rewritten(tmp_path, cache):
    data = png_bytes("red")
    pq.write_table(pa.table({"image": [data], "problem": ["p"], "solution": ["s"]}), tmp_path / "r.parquet")
    (row,) = load_rows(tmp_path / "r.parquet")
    with open(row["image"], "r+b") as f:  # a cache file cut short (killed copy, disk trouble)
        f.truncate(10)
    (row2,) = load_rows(tmp_path / "r.parquet")
    assert row2["image"] == row["image"]
    with open(row["image"], "rb") as f:
        assert f.read() == data


def test_hub_style_parquet_shards_by_pattern(tmp_path, cache):
    shards = tmp_path / "data"
    shards.mkdir()
    for i, colour in enumerate(["red", "green", "blue"]):
        ds = datasets.Dataset.from_dict({"image": [Image.new("RGB", (4, 4), colour)], "problem": [f"q{i}"], "solution": ["s"]}, features=FEATURES)
        ds.to_parquet(str(shards / f"train-{i:05d}-of-00003.parquet"))
    (shards / "test-00000-of-00001.parquet").write_bytes(b"not read")
    rows, _ = load_dataset_split(f"{shards}/train-*.parquet", limit_images=None, skip_bad_rows=False)
    assert [r["problem"] for r in rows] == ["q0", "q1", "q2"]
    assert rows[2]["_source"] == f"{shards / 'train-00002-of-00003.parquet'}:row 1"
    assert [_pixel(r["images"][0]) for r in rows] == [(255, 0, 0), (0, 128, 0), (0, 0, 255)]
    with pytest.raises(DataError, match="no file matches"):
        load_rows(f"{shards}/val-*.parquet")
