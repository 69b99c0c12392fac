"""Tiled image families, LLaVA-OneVision (anyres) and InternVL (dynamic tiles): image tokens per image vary with its
size. The image-only processor stand-ins, per-row slicing of a batch whose images have different tile counts, and
the fast paths (grouped vision, shared prefix) against the naive path on them."""

import numpy as np
import pytest
import torch
from PIL import Image
from test_logprobs import completions, model_cfg

from vlmrl.models.logprobs import completion_logps, grouped_family
from vlmrl.models.loading import load_model
from vlmrl.models.prefix import prefix_supported
from vlmrl.models.processing import build_prompt, encode_prompts, load_processor, select_rows

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


def _mixed_batch(processor, seed=0):
    """Three prompts of differently tiled images (one of them with two images)."""
    images = pictures([(80, 30), (25, 70), (56, 56), (120, 80)], seed)
    rows = [[images[0]], [images[1], images[2]], [images[3]]]
    texts = [build_prompt(processor, f"what is in picture {i}?", len(r)) for i, r in enumerate(rows)]
    return encode_prompts(processor, texts, rows)


@pytest.mark.integration
def test_grouped_and_shared_prefix_equal_naive_on_mixed_tiles(tiled):
    """Each prompt's images tiled differently (anyres grids / tile counts): the grouped path (one vision pass per
    prompt, features gathered per row through mm_encoder_outputs) and the shared prefix give the naive path's
    log-probs and every gradient, vision tower included; the tower sees each prompt's tiles once; greedy rollout
    with the shared prefix equals HF generate token for token."""
    from test_logprobs import LENGTHS, assert_grads_close, loss_and_grads

    from vlmrl.models.logprobs import completion_logps_grouped, vision_encode_counter
    from vlmrl.models.prefix import completion_logps_prefix
    from vlmrl.models.rollout import generate

    model, processor = tiled
    assert grouped_family(model) is not None
    batch = _mixed_batch(processor)
    assert prefix_supported(model, batch, needs_grad=True)
    rows = torch.tensor([0, 0, 1, 1, 2, 2])
    ids, mask = completions(processor, LENGTHS)
    naive, g_naive = loss_and_grads(model, lambda: (completion_logps(model, select_rows(batch, rows), ids, mask), mask))
    with vision_encode_counter(model) as calls:
        grouped, g_grouped = loss_and_grads(model, lambda: (completion_logps_grouped(model, batch, rows, ids, mask), mask))
    prefix, g_prefix = loss_and_grads(model, lambda: (completion_logps_prefix(model, batch, rows, ids, mask), mask))
    for got, grads in ((grouped, g_grouped), (prefix, g_prefix)):
        torch.testing.assert_close(got * mask, naive * mask, rtol=1e-5, atol=1e-5)
        assert_grads_close(g_naive, grads)
    assert calls.calls == 1
    hf = generate(model, processor.tokenizer, batch, num_generations=1, max_new_tokens=10, shared_prefix=False, do_sample=False)
    ours = generate(model, processor.tokenizer, batch, num_generations=1, max_new_tokens=10, shared_prefix=True, do_sample=False)
    assert torch.equal(ours.ids, hf.ids) and ours.ids.shape[1] > 1


def test_text_only_rows_beside_image_rows_slice_right(tiled):
    """A batch whose rows do not all have images (LLaVA-OneVision's processor lists images per row only for the rows
    with images; vlmrl keeps one entry per row): every row sliced out gives its log-probs alone."""
    model, processor = tiled
    images = pictures([(80, 30), (56, 56)])
    rows_images = [[images[0]], [], [images[1]]]
    texts = [build_prompt(processor, f"what is in picture {i}?", len(r)) for i, r in enumerate(rows_images)]
    batch = encode_prompts(processor, texts, rows_images)
    rows = [2, 1, 0, 0]  # three images in four rows
    ids, mask = completions(processor, [4, 2, 5, 3])
    with torch.no_grad():
        together = completion_logps(model, select_rows(batch, rows), ids, mask)
        for i, r in enumerate(rows):
            alone = completion_logps(model, encode_prompts(processor, [texts[r]], [rows_images[r]]), ids[i : i + 1], mask[i : i + 1])
            n = int(mask[i].sum())
            torch.testing.assert_close(together[i, :n], alone[0, :n], rtol=1e-4, atol=1e-5)
