"""Images reach the model as a viewer shows them (issue 26 part 4; images.py): EXIF orientation applied, 16-bit
and float images scaled (not clipped to white / black), animated and multi-page files refused as bad rows, and a
JSON row with a key given twice is a bad row. Every test image is made here."""

import json

import numpy as np
import pytest
from PIL import Image

from vlmrl.data.errors import DataError
from vlmrl.data.rows import load_dataset_split
from vlmrl.data.media import load_images


def load_one(path):
    (image,) = load_images([str(path)], None, None)
    return np.asarray(image)


def test_exif_orientation_is_applied(tmp_path):
    # Stored 40 wide x 20 high, left half red; EXIF 6 = "rotate 90 degrees clockwise to view": 20 wide x 40 high.
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[:, :20] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "phone.jpg"
    Image.fromarray(pixels).save(path, exif=exif, quality=95)
    shown = load_one(path)
    assert shown.shape == (40, 20, 3)
    assert shown[5, 10, 0] > 200 and shown[35, 10, 0] < 60  # the red half is on top, as a viewer shows it
    rows, report = load_dataset_split(write_rows(tmp_path, [{"image": "phone.jpg"}]), limit_images=None, skip_bad_rows=False)
    assert len(rows) == 1


@pytest.mark.parametrize("mode, value, expected", [("I;16", 32768, 128), ("I;16", 65535, 255), ("F", 0.5, 128), ("F", 1.0, 255)])
def test_16_bit_and_float_images_are_scaled_not_clipped(tmp_path, mode, value, expected):
    if mode == "F":
        im = Image.fromarray(np.full((8, 8), value, dtype=np.float32), mode="F")
        path = tmp_path / "float.tif"
    else:
        im = Image.fromarray(np.full((8, 8), value, dtype=np.uint16))
        path = tmp_path / "deep.png"
    im.save(path)
    with Image.open(path) as check:
        assert check.mode in ("I;16", "I", "F")  # the file really is 16-bit / float
    shown = load_one(path)
    assert shown.shape == (8, 8, 3) and abs(int(shown[0, 0, 0]) - expected) <= 1


def test_a_16_bit_gradient_keeps_its_contrast(tmp_path):
    ramp = np.tile(np.linspace(0, 65535, 16).astype(np.uint16), (4, 1))
    Image.fromarray(ramp).save(tmp_path / "ramp.png")
    shown = load_one(tmp_path / "ramp.png")[0, :, 0]
    assert shown[0] == 0 and shown[-1] == 255 and np.all(np.diff(shown.astype(int)) > 0)


def write_rows(folder, rows):
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({"problem": "p", "solution": "1", **r}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("kind", ["gif", "tiff"])
def test_animated_and_multi_page_images_are_bad_rows(tmp_path, kind):
    frames = [Image.new("RGB", (16, 16), c) for c in ("red", "blue", "green")]
    name = "anim.gif" if kind == "gif" else "pages.tif"
    frames[0].save(tmp_path / name, save_all=True, append_images=frames[1:])
    Image.new("RGB", (16, 16), "white").save(tmp_path / "still.png")
    data = write_rows(tmp_path, [{"image": name}, {"image": "still.png"}])
    with pytest.raises(DataError, match=r"(animated|multi-page) .* with 3 frames; vlmrl takes still images only"):
        load_dataset_split(data, limit_images=None, skip_bad_rows=False)
    rows, report = load_dataset_split(data, limit_images=None, skip_bad_rows=True)
    assert [r["images"][0].endswith("still.png") for r in rows] == [True]
    with pytest.raises(DataError, match="3 frames"):
        load_images([str(tmp_path / name)], None, None)  # found late (changed after check): still refused


def test_a_duplicate_json_key_is_a_bad_row(tmp_path):
    Image.new("RGB", (16, 16), "white").save(tmp_path / "a.png")
    path = tmp_path / "rows.jsonl"
    path.write_text('{"image": "a.png", "problem": "p", "solution": "3", "solution": "5"}\n{"image": "a.png", "problem": "p", "solution": "4"}\n')
    with pytest.raises(DataError, match=r"rows.jsonl:1: .*key 'solution' appears twice"):
        load_dataset_split(path, limit_images=None, skip_bad_rows=False)
    rows, _ = load_dataset_split(path, limit_images=None, skip_bad_rows=True)
    assert [r["solution"] for r in rows] == ["4"]
    whole = tmp_path / "rows.json"
    whole.write_text('[{"image": "a.png", "problem": "p", "problem": "q", "solution": "1"}]')
    with pytest.raises(DataError, match="key 'problem' appears twice"):
        load_dataset_split(whole, limit_images=None, skip_bad_rows=False)


def test_an_image_broken_after_the_check_names_its_row(tmp_path):
    from vlmrl.config import load_config
    from vlmrl.run.datasets import encode_rows

    Image.new("RGB", (32, 32), "white").save(tmp_path / "a.png")
    rows, _ = load_dataset_split(write_rows(tmp_path, [{"image": "a.png"}]), limit_images=None, skip_bad_rows=False)
    (tmp_path / "a.png").write_bytes((tmp_path / "a.png").read_bytes()[:40])  # truncated on disk after validation
    cfg = load_config(None, ["data.image_cache_mb=0"])
    with pytest.raises(DataError, match=rf"^{tmp_path / 'rows.jsonl'}:1: .*a.png: cannot read image"):
        encode_rows(None, rows, cfg, None)
