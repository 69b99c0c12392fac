"""More 2026 families (issue 38, second batch), checked as tests/test_families_2026.py checks the first: each builds
offline, its processor feeds the model's own forward, the registry names it; slow tier: 2 GRPO steps with the memory
engine on, exact resume, `final/` reloads in plain transformers; then SFT and a LoRA GRPO run end to end."""

import pytest
import torch

# The checks themselves are test_families_2026's (imported under names pytest does not collect twice).
from test_families_2026 import _weights, built, data  # noqa: F401 (fixtures)
from test_families_2026 import test_builds_and_its_processor_feeds_the_model as builds_and_its_processor_feeds_the_model
from test_families_2026 import test_grpo_resume_and_reload as grpo_resume_and_reload

# (`vlmrl tiny --family` name, config.model_type, the processor class vlmrl loads here)
NEW_FAMILIES = [
    ("smolvlm", "smolvlm", "SmolVLMImageOnlyProcessor"),
    ("lfm2-vl", "lfm2_vl", "Lfm2VlProcessor"),
]
NAMES = [name for name, _, _ in NEW_FAMILIES]


@pytest.mark.integration
@pytest.mark.parametrize("name,model_type,processor_class", NEW_FAMILIES)
def test_builds_and_its_processor_feeds_the_model(name, model_type, processor_class, built):  # noqa: F811 (fixtures imported above)
    builds_and_its_processor_feeds_the_model(name, model_type, processor_class, built)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_grpo_resume_and_reload(name, built, data, tmp_path):  # noqa: F811 (fixtures imported above)
    grpo_resume_and_reload(name, built, data, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_sft_and_lora_grpo(name, built, data, tmp_path):  # noqa: F811 (fixtures imported above)
    """`vlmrl sft` (projector warm-up, then full) and `vlmrl train` with LoRA (beta > 0: the reference is the adapter
    switched off) on image rows: both finish, move weights, and write a `final/` folder."""
    from vlmrl.cli import main

    common = [f"model.name_or_path={built(name)}", f"data.train_path={data['train']}", "data.eval_path="]
    common += ["logging.progress_bar=false", "logging.tensorboard=false", "logging.report=false", "data.min_pixels=3136", "data.max_pixels=3136"]
    sft = [f"training.output_dir={tmp_path / 'sft'}", "sft.projector_steps=1", "sft.steps=1", "sft.batch_size=2"]
    assert main(["sft", *common, *sft]) == 0
    before, after = _weights(built(name)), _weights(tmp_path / "sft" / "final")
    assert after.keys() == before.keys() and any(not torch.equal(before[k], after[k]) for k in before), "SFT changed no weight"
    grpo = [f"training.output_dir={tmp_path / 'lora'}", "training.max_steps=1", "rollout.num_generations=2", "training.per_device_train_batch_size=4"]
    grpo += ["rollout.max_completion_length=4", "model.use_lora=true", "algorithm.beta=0.05", "algorithm.reward_funcs=[accuracy]"]
    assert main(["train", *common, *grpo]) == 0
    assert len([x for x in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]) == 1
    assert any((tmp_path / "lora" / "final").glob("*.safetensors"))


@pytest.mark.integration
def test_select_rows_follows_each_rows_images(built):  # noqa: F811 (fixtures imported above)
    """LFM2-VL rows with 2 and 1 images of different sizes, gathered as [1, 0, 1] (how rollout repeats prompts): every
    tensor equals encoding those rows directly, per-image spatial_shapes and pixel_attention_mask included."""
    from PIL import Image

    from vlmrl.models.processing import build_row_prompt, encode_prompts, load_processor, select_rows

    processor = load_processor(built("lfm2-vl"))
    texts = [build_row_prompt(processor, {"problem": "A <image> B <image>"}, 2), build_row_prompt(processor, {"problem": "C"}, 1)]
    images = [[Image.new("RGB", (56, 56), "red"), Image.new("RGB", (200, 50), "blue")], [Image.new("RGB", (40, 72), "green")]]
    picked = select_rows(encode_prompts(processor, texts, images), [1, 0, 1])
    direct = encode_prompts(processor, [texts[1], texts[0], texts[1]], [images[1], images[0], images[1]])
    assert picked.keys() == direct.keys() and "spatial_shapes" in direct
    for key, value in direct.items():
        if torch.is_tensor(value):
            assert torch.equal(picked[key], value), key


@pytest.mark.integration
def test_lfm2_vl_standin_sizes_follow_its_smart_resize(built):  # noqa: F811 (fixtures imported above)
    """LFM2-VL's rule, worked by hand for the tiny build (patch 8, downsample 2: sides in multiples of 16, 4..16
    tokens): 56x56 rounds to 64x64 (8x8 patches, 16 tokens); 200x50 rounds to 208x48 = 39 tokens, over 16, so it is
    scaled by sqrt(10000/4096) and floored to 128x32 (16x4 patches, 8x2 = 16 tokens); 20x20 rounds to 16x16 = 1
    token, under 4, so it is scaled up to 32x32 (4 tokens). The processor writes one <image> per token."""
    from PIL import Image

    from vlmrl.models.processing import load_processor

    processor = load_processor(built("lfm2-vl"))
    for (width, height), patches, tokens in [((56, 56), [8, 8], 16), ((200, 50), [4, 16], 16), ((20, 20), [4, 4], 4)]:
        out = processor(text=["<image>"], images=[[Image.new("RGB", (width, height))]], return_tensors="pt")
        assert out["spatial_shapes"].tolist() == [patches], (width, height)
        assert int(out["pixel_attention_mask"].sum()) == patches[0] * patches[1] and out["pixel_values"].shape[1] == 64
        assert int((out["input_ids"] == processor.image_token_id).sum()) == tokens, (width, height)


@pytest.mark.integration
def test_lfm2_vl_standin_refuses_an_image_it_would_tile():
    """With image splitting on (LFM2-VL checkpoints' default), an image over the tile threshold is refused with a line
    saying why, not processed as one image the real processor would have tiled."""
    from PIL import Image

    from vlmrl.fixtures.standin_processors_b import Lfm2VlImageProcessorPil

    ip = Lfm2VlImageProcessorPil(encoder_patch_size=8, downsample_factor=2, min_image_tokens=4, max_image_tokens=16, do_image_splitting=True)
    assert ip(Image.new("RGB", (64, 64)), return_tensors="pt")["spatial_shapes"].tolist() == [[8, 8]]  # small: one image
    with pytest.raises(ValueError, match="200x200 image would be split into tiles"):
        ip(Image.new("RGB", (200, 200)), return_tensors="pt")
