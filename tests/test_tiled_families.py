"""Tiled image families, LLaVA-OneVision (anyres) and InternVL (dynamic tiles): image tokens per image vary with its
size. The image-only processor stand-ins, per-row slicing of a batch whose images have different tile counts, and
the documented naive-path fallback."""

import logging

import numpy as np
import pytest
import torch
from PIL import Image
from test_logprobs import completions, model_cfg

from vlmrl.logprobs import completion_logps, grouped_family
from vlmrl.models import load_model
from vlmrl.prefix import prefix_supported
from vlmrl.processing import build_prompt, encode_prompts, load_processor, select_rows

# (width, height) of one image per prompt: square, wide, tall, tiny — different anyres grids and unpadding.
SIZES = [(56, 56), (80, 30), (25, 70), (12, 12), (120, 80)]


@pytest.fixture(scope="module", params=["tiny_llava_onevision", "tiny_internvl"])
def tiled(request):
    path = request.getfixturevalue(request.param)
    return load_model(model_cfg(path)).eval(), load_processor(path)


def pictures(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def batch_of(processor, indices, images):
    """Prompts `indices` (one image each) encoded together."""
    texts = [build_prompt(processor, f"what is in picture {i}?", 1) for i in indices]
    return encode_prompts(processor, texts, [[images[i]] for i in indices])


def test_image_tokens_follow_the_model_features_for_every_size(tiled):
    """The stand-in is transformers' processor without the video part: its token count per image must equal the
    number of features the model's tiling path produces for that image (the model refuses a mismatch)."""
    model, processor = tiled
    images = pictures(SIZES)
    batch = batch_of(processor, range(len(SIZES)), images)
    per_row = (batch["input_ids"] == model.config.image_token_id).sum(1).tolist()
    assert len(set(per_row)) >= 3, per_row  # different counts for different shapes
    inputs = {k: v for k, v in batch.items() if k not in ("images_per_row", "image_num_patches")}
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"], **{k: v for k, v in inputs.items() if k == "image_sizes"})
    features = getattr(features, "pooler_output", features)
    if "image_num_patches" in batch:  # InternVL: [tiles, tokens per tile, hidden]; tiles per image by the processor's rule
        rule = [processor.image_processor.get_number_of_image_patches(im.height, im.width, {}) for im in images]
        assert batch["image_num_patches"].tolist() == rule
        assert [n * features.shape[1] for n in rule] == per_row
    else:  # LLaVA-OneVision: one [tokens, hidden] per image
        assert [f.shape[0] for f in features] == per_row
    model(**inputs)  # the model's own check that placeholders and features agree


def test_rows_sliced_from_a_mixed_batch_equal_each_row_alone(tiled):
    """select_rows on a batch of differently tiled images (pixel_values padded to the most tiles) gives every row
    the log-probs it gets when its prompt is encoded alone: no image's tiles or sizes land on another row."""
    model, processor = tiled
    images = pictures(SIZES)
    batch = batch_of(processor, range(len(SIZES)), images)
    rows = [3, 0, 4, 2, 1, 0]  # reordered, one repeated (a group of 2)
    ids, mask = completions(processor, [4, 2, 5, 3, 1, 6])
    with torch.no_grad():
        together = completion_logps(model, select_rows(batch, rows), ids, mask)
        for i, r in enumerate(rows):
            alone = completion_logps(model, batch_of(processor, [r], images), ids[i : i + 1], mask[i : i + 1])
            n = int(mask[i].sum())
            torch.testing.assert_close(together[i, :n], alone[0, :n], rtol=1e-4, atol=1e-5)


def test_fast_paths_fall_back_to_the_naive_path_with_the_reason(tiled, caplog):
    from vlmrl import families

    model, processor = tiled
    assert grouped_family(model) is None
    assert not prefix_supported(model, batch_of(processor, [0], pictures(SIZES)))
    model_type = model.config.model_type
    families._logged.discard(model_type)
    with caplog.at_level(logging.WARNING, logger="vlmrl.families"):
        families.log_fallback(model_type)
    assert {"llava_onevision": "anyres", "internvl": "pixel-shuffle"}[model_type] in caplog.text
