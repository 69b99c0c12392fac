"""Loading, validation (every bad-row kind), image resizing, and the prompt sampler."""

import json
import os

import pytest
from PIL import Image

from vlmrl.data.errors import DataError
from vlmrl.data.sampler import PromptSampler
from vlmrl.data.rows import load_dataset_split
from vlmrl.data.media import load_images, target_size
from vlmrl.data.readers import load_rows
from vlmrl.data.validation import validate_rows


def _png(path, size=(8, 6), colour=(255, 0, 0), mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def good_dir(tmp_path):
    _png(tmp_path / "img" / "a.png")
    _png(tmp_path / "img" / "b.png", colour=(0, 255, 0))
    return tmp_path


GOOD = {"image": "img/a.png", "problem": "How many?", "solution": "3"}


def test_jsonl_loads_and_resolves_relative_paths(good_dir, tmp_path, monkeypatch):
    monkeypatch.chdir("/")  # relative paths must not depend on the working directory
    data = _jsonl(
        good_dir / "train.jsonl",
        [
            GOOD,
            "",  # blank lines are ignored but still counted for line numbers
            {"images": ["img/a.png", str(good_dir / "img" / "b.png")], "problem": "p", "solution": 2.5, "response": "r", "extra": [1]},
            {"problem": "text only", "solution": "x"},
        ],
    )
    rows, report = load_dataset_split(data, limit_images=4, skip_bad_rows=False)
    assert [r["_source"] for r in rows] == [f"{data}:1", f"{data}:3", f"{data}:4"]
    assert rows[0]["images"] == [str(good_dir / "img" / "a.png")] and "image" not in rows[0]
    assert rows[1]["images"] == [str(good_dir / "img" / "a.png"), str(good_dir / "img" / "b.png")]
    assert rows[1]["solution"] == "2.5" and rows[1]["extra"] == [1] and rows[1]["response"] == "r"
    assert rows[2]["images"] == []
    assert (report.total_rows, report.kept_rows, report.num_images, report.text_only_rows) == (3, 3, 3, 1)
    assert report.summary() == "format vlmrl: 3 of 3 rows kept, 3 images; 1 text-only rows"


def test_json_parquet_and_load_from_disk(good_dir):
    import datasets

    rows = [GOOD, {**GOOD, "solution": 4}]
    (good_dir / "list.json").write_text(json.dumps(rows))
    (good_dir / "wrapped.json").write_text(json.dumps({"data": rows}))
    (good_dir / "lines.json").write_text("\n".join(json.dumps(r) for r in rows))  # Dataset.to_json style
    ds = datasets.Dataset.from_list([{**GOOD, "solution": "3"}, {**GOOD, "solution": "4"}])
    ds.to_parquet(str(good_dir / "d.parquet"))
    ds.save_to_disk(str(good_dir / "single"))
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(good_dir / "dd"))

    for name in ("list.json", "wrapped.json", "lines.json", "d.parquet", "single"):
        got, _ = load_dataset_split(good_dir / name, limit_images=None, skip_bad_rows=False)
        assert [r["solution"] for r in got] == ["3", "4"], name
        assert got[0]["images"] == [str(good_dir / "img" / "a.png")], name
    assert load_rows(good_dir / "list.json")[1]["_source"] == f"{good_dir / 'list.json'}:row 2"
    got, _ = load_dataset_split(f"{good_dir / 'dd'}::test", limit_images=None, skip_bad_rows=False)
    assert [r["solution"] for r in got] == ["4"] and got[0]["_source"] == f"{good_dir / 'dd'}::test:row 1"
    assert len(load_rows(good_dir / "dd", split="train")) == 2
    with pytest.raises(DataError, match=r"holds splits train, test; pick one with .*dd::<split>"):
        load_rows(good_dir / "dd")
    with pytest.raises(DataError, match="no split 'val'"):
        load_rows(f"{good_dir / 'dd'}::val")
    with pytest.raises(DataError, match="unsupported format '.csv'"):
        (good_dir / "x.csv").write_text("a\n")
        load_rows(good_dir / "x.csv")
    with pytest.raises(DataError, match="no such file"):
        load_rows(good_dir / "missing.jsonl")


def test_embedded_image_column_is_read(good_dir, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    ds = datasets.Dataset.from_dict(
        {"image": [Image.new("RGB", (4, 4))], "problem": ["p"], "solution": ["s"]},
        features=datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"), "solution": datasets.Value("string")}),
    )
    ds.save_to_disk(str(good_dir / "emb"))
    (row,), _ = load_dataset_split(good_dir / "emb", limit_images=None, skip_bad_rows=False)
    assert row["images"][0].startswith(str(tmp_path / "cache" / "images"))  # more cases: tests/test_embedded_images.py


def _bad_rows_file(d):
    """One good row and one row of every bad kind; returns (path, expected problem lines by line number)."""
    _png(d / "ok.png")
    full = d / "trunc_src.png"
    Image.effect_noise((64, 64), 50).convert("RGB").save(full)  # noise does not compress: the cut is mid-data
    data = full.read_bytes()
    (d / "trunc.png").write_bytes(data[: len(data) // 2])
    (d / "text.png").write_text("this is not an image")
    rows = [
        {"image": "ok.png", "problem": "p", "solution": "1"},  # 1 good
        {"image": "gone.png", "problem": "p", "solution": "1"},  # 2 missing image file
        {"image": "trunc.png", "problem": "p", "solution": "1"},  # 3 truncated PNG
        {"image": "text.png", "problem": "p", "solution": "1"},  # 4 not an image
        {"image": "ok.png", "solution": "1"},  # 5 missing problem
        {"image": "ok.png", "problem": "p", "solution": {"a": 1}},  # 6 solution wrong type
        {"images": "ok.png", "problem": "p", "solution": "1"},  # 7 images not a list
        '{"image": "ok.png", "problem": ',  # 8 malformed JSON
        {"images": ["ok.png", 3], "problem": "p", "solution": "1"},  # 9 an image that is not a string
        {"image": "ok.png", "problem": "  ", "solution": True},  # 10 empty problem + bool solution: two problems
        [1, 2],  # 11 not an object
    ]
    path = _jsonl(d / "bad.jsonl", [r if isinstance(r, str) else json.dumps(r) for r in rows])
    return path


def test_every_bad_row_kind_is_listed_with_file_line_and_field(tmp_path):
    path = _bad_rows_file(tmp_path)
    with pytest.raises(DataError) as err:
        load_dataset_split(path, limit_images=None, skip_bad_rows=False)
    msg = str(err.value)
    assert msg.startswith(f"{path}: 10 of 11 rows are bad (11 problems):\n")
    expected = [
        f"{path}:2: image: file not found: {tmp_path / 'gone.png'}",
        f"{path}:3: image: cannot read image {tmp_path / 'trunc.png'}: OSError:",
        f"{path}:4: image: cannot read image {tmp_path / 'text.png'}: UnidentifiedImageError:",
        f"{path}:5: problem: missing",
        f"{path}:6: solution: expected a string or number, got dict",
        f"{path}:7: images: expected a list of path strings, got str",
        f"{path}:8: row: invalid JSON: Expecting value (column 32)",
        f"{path}:9: images: item 1 is int, expected a path string",
        f"{path}:10: problem: empty",
        f"{path}:10: solution: expected a string or number, got bool",
        f"{path}:11: row: expected a JSON object, got list",
    ]
    lines = msg.splitlines()[1:-1]
    assert len(lines) == len(expected)
    for line, want in zip(lines, expected):
        assert line.strip().startswith(want), (line, want)
    assert msg.endswith("Fix them, or set skip_bad_rows to drop and count them.")


def test_skip_bad_rows_keeps_good_rows_and_counts_kinds(tmp_path):
    path = _bad_rows_file(tmp_path)
    rows, report = load_dataset_split(path, limit_images=None, skip_bad_rows=True)
    assert [r["_source"] for r in rows] == [f"{path}:1"]
    assert (report.total_rows, report.kept_rows, report.skipped_rows) == (11, 1, 10)
    assert report.problem_counts == {"missing_image": 1, "bad_image": 2, "missing_field": 1, "wrong_type": 4, "malformed": 2, "empty_field": 1}
    assert report.summary() == (
        "format vlmrl: 1 of 11 rows kept, 1 images; 10 bad rows skipped (bad_image: 2, empty_field: 1, malformed: 2, "
        f"missing_field: 1, missing_image: 1, wrong_type: 4; rows {path}:2, 3, 4, 5, 6 and 5 more)"
    )


def test_check_images_false_only_checks_existence(tmp_path):
    path = _bad_rows_file(tmp_path)
    _, report = load_dataset_split(path, limit_images=None, skip_bad_rows=True, check_images=False)
    assert report.problem_counts.get("bad_image", 0) == 0 and report.problem_counts["missing_image"] == 1


def test_malformed_line_raises_from_load_rows(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [GOOD, "{not json"])
    with pytest.raises(DataError, match=rf"^{path}:2: invalid JSON"):
        load_rows(path)


def test_problem_list_is_capped_at_20(tmp_path):
    path = _jsonl(tmp_path / "many.jsonl", [{"problem": "p"}] * 25)
    with pytest.raises(DataError) as err:
        load_dataset_split(path, limit_images=None, skip_bad_rows=False)
    msg = str(err.value)
    assert f"{path}:20: solution: missing" in msg and f"{path}:21:" not in msg
    assert "25 of 25 rows are bad (25 problems)" in msg and "... and 5 more" in msg


@pytest.mark.parametrize("skip", [False, True])
def test_empty_inputs_are_errors(tmp_path, skip):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=rf"{empty}: no rows"):
        load_dataset_split(empty, limit_images=None, skip_bad_rows=skip)
    all_bad = _jsonl(tmp_path / "bad.jsonl", [{"image": "nope.png", "problem": "p", "solution": "1"}])
    with pytest.raises(DataError, match=rf"{all_bad}: (no usable rows|1 of 1 rows are bad)"):
        load_dataset_split(all_bad, limit_images=None, skip_bad_rows=skip)


def test_limit_images_truncates_and_counts(good_dir):
    rows = [
        {"images": ["img/a.png", "img/b.png", "img/a.png"], "problem": "p", "solution": "1", "_source": "x:1"},
        {"images": ["img/b.png"], "problem": "p", "solution": "1", "_source": "x:2"},
    ]
    good, report = validate_rows(rows, good_dir, limit_images=2, skip_bad_rows=False)
    assert good[0]["images"] == [str(good_dir / "img" / "a.png"), str(good_dir / "img" / "b.png")]
    assert (report.truncated_rows, report.dropped_images, report.num_images) == (1, 1, 3)
    assert "1 rows over limit_images (1 images dropped)" in report.summary()
    assert rows[0]["images"] == ["img/a.png", "img/b.png", "img/a.png"]  # input untouched
    # Dropped images are not checked: a missing third image does not make the row bad.
    rows[0]["images"][2] = "img/missing.png"
    good, _ = validate_rows(rows, good_dir, limit_images=2, skip_bad_rows=False)
    assert len(good) == 2


def test_both_image_and_images_is_an_error(good_dir):
    rows = [{"image": "img/a.png", "images": ["img/b.png"], "problem": "p", "solution": "1", "_source": "f:1"}]
    with pytest.raises(DataError, match="f:1: image: both 'image' and 'images' are set"):
        validate_rows(rows, good_dir, limit_images=None, skip_bad_rows=False)


def test_solution_conversions(good_dir):
    rows = [{"problem": "p", "solution": s} for s in (3, 2.5, [1, 2, 30, 40], "x")]
    good, _ = validate_rows(rows, good_dir, limit_images=None, skip_bad_rows=False, name="mem")
    assert [r["solution"] for r in good] == ["3", "2.5", "[1, 2, 30, 40]", "x"]
    assert good[0]["_source"] == "mem:row 1"


def test_target_size_exact():
    assert target_size(100, 50, None, None) == (100, 50)
    assert target_size(100, 50, 100, 2000) == (63, 31)  # scale sqrt(0.4): 63.2 x 31.6 floored
    assert target_size(10, 5, 200, 10_000) == (20, 10)  # scale 2 exactly
    assert target_size(10, 5, 201, 10_000) == (21, 11)  # rounded up so area >= min_pixels
    assert target_size(1, 10_000, None, 100) == (1, 100)  # a 1-pixel side: the long side is cut


@pytest.mark.parametrize(
    "size, lo, hi",
    [((400, 200), 28 * 28, 100 * 100), ((7, 3), 28 * 28, 100 * 100), ((50, 50), 10, 10_000), ((1000, 10), 1, 500), ((3, 997), 1000, 5000)],
)
def test_load_images_keeps_aspect_and_respects_caps(tmp_path, size, lo, hi):
    path = _png(tmp_path / "x.png", size=size)
    (im,) = load_images([str(path)], lo, hi)
    w, h = im.size
    assert im.mode == "RGB"
    assert w * h <= hi and (w * h >= lo or size[0] * size[1] > hi)
    if size[0] * size[1] < lo or size[0] * size[1] > hi:
        assert abs(w / h - size[0] / size[1]) <= size[0] / size[1] * (1 / min(w, h)) + 1e-9  # aspect within one pixel
    else:
        assert (w, h) == size


def test_load_images_converts_modes(tmp_path):
    transparent = _png(tmp_path / "t.png", size=(4, 4), colour=(0, 0, 0, 0), mode="RGBA")
    grey = _png(tmp_path / "g.png", size=(4, 4), colour=128, mode="L")
    t, g = load_images([str(transparent), str(grey)], None, None)
    assert t.getpixel((0, 0)) == (255, 255, 255)  # transparent -> white, not black
    assert g.mode == "RGB" and g.getpixel((0, 0)) == (128, 128, 128)
    with pytest.raises(DataError, match="nope.png: cannot read image"):
        load_images([str(tmp_path / "nope.png")], None, None)


def test_sampler_epochs_are_permutations_and_deterministic():
    s = PromptSampler(5, seed=3)
    first = s.next_batch(5)
    assert sorted(first) == [0, 1, 2, 3, 4] and s.epoch == 1
    second = s.next_batch(5)
    assert sorted(second) == [0, 1, 2, 3, 4] and second != first  # a new order each epoch
    again = PromptSampler(5, seed=3)
    assert again.next_batch(10) == first + second
    assert PromptSampler(5, seed=4).next_batch(10) != first + second
    assert PromptSampler(5, seed=3, shuffle=False).next_batch(7) == [0, 1, 2, 3, 4, 0, 1]


def test_sampler_crosses_epochs_and_resumes_exactly():
    reference = PromptSampler(7, seed=0)
    stream = reference.next_batch(7 * 4)
    s = PromptSampler(7, seed=0)
    assert s.next_batch(3) + s.next_batch(3) == stream[:6]
    cross = s.next_batch(3)  # 6..8 crosses into epoch 1
    assert cross == stream[6:9] and s.epoch == 1
    state = s.state_dict()
    assert state == {"epoch": 1, "position": 2, "num_rows": 7, "seed": 0, "shuffle": True}
    resumed = PromptSampler(7, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert resumed.next_batch(19) == stream[9:28] and resumed.epoch == 4
    with pytest.raises(ValueError, match="num_rows=7 .* has 8"):
        PromptSampler(8, seed=0).load_state_dict(state)
    assert PromptSampler(3, seed=0).next_batch(0) == []
    with pytest.raises(ValueError):
        PromptSampler(0, seed=0)


def test_data_module_is_light():
    import subprocess
    import sys

    code = (
        "import sys, vlmrl.data.rows, vlmrl.data.sampler, vlmrl.data.sft_targets, vlmrl.rewards.functions, vlmrl.data.tasks; "
        "print(sorted(m for m in ('torch', 'datasets', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ})
    assert out.stdout.strip() == "[]"
