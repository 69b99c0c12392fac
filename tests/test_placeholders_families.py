"""`<image>` placeholders put each image where it stands in every family's chat template, and the count check
(formats.placeholder_counts, a bad row in validation) keeps the processor from ever seeing a mismatch."""

import pytest
from family_fixtures import ALL_FAMILY_FIXTURES
from PIL import Image

from vlmrl.models.processing import build_row_prompt, encode_prompts, load_processor

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("family", ALL_FAMILY_FIXTURES)
def test_interleaved_images_keep_their_places(family, request):
    processor = load_processor(request.getfixturevalue(family), min_pixels=3136, max_pixels=3136)
    row = {"problem": "First <image> then <image> compare."}
    text = build_row_prompt(processor, row, 2)
    a, b, c = text.index("First "), text.index(" then "), text.index(" compare.")
    assert a + len("First ") < b and b + len(" then ") < c  # an image's tokens stand between the pieces of text
    first, second = text[a + len("First ") : b], text[b + len(" then ") : c]
    assert first == second  # both images get the family's own image markup, each at its placeholder
    images = [[Image.new("RGB", (56, 56), "red"), Image.new("RGB", (56, 56), "blue")]]
    batch = encode_prompts(processor, [text], images)
    assert int(batch["images_per_row"][0]) == 2
