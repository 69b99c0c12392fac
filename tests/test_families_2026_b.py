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
    ("llama4", "llama4", "Llama4Processor"),
    ("glm5-next", "glm5_next", "GlmImageOnlyProcessor"),
]
# LoRA on the fused MoE expert weights too, where the family has them.
LORA_EXPERTS = {
    "llama4": ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"],
    "glm5-next": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "glm4v-moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
NAMES = [name for name, _, _ in NEW_FAMILIES]
# The first batch (tests/test_families_2026.py) runs SFT and LoRA here too.
FIRST_BATCH = ["mistral3", "gemma4", "glm4v", "glm4v-moe", "glm4.6v", "idefics3"]


@pytest.mark.integration
@pytest.mark.parametrize("name,model_type,processor_class", NEW_FAMILIES)
def test_builds_and_its_processor_feeds_the_model(name, model_type, processor_class, built):  # noqa: F811 (fixtures imported above)
    builds_and_its_processor_feeds_the_model(name, model_type, processor_class, built)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_grpo_resume_and_reload(name, built, data, tmp_path):  # noqa: F811 (fixtures imported above)
    grpo_resume_and_reload(name, built, data, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES + FIRST_BATCH)
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
    if name in LORA_EXPERTS:
        grpo.append(f"model.lora_target_parameters=[{','.join(LORA_EXPERTS[name])}]")
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

    from vlmrl.processors.standin_2026b import Lfm2VlImageProcessorPil

    ip = Lfm2VlImageProcessorPil(encoder_patch_size=8, downsample_factor=2, min_image_tokens=4, max_image_tokens=16, do_image_splitting=True)
    assert ip(Image.new("RGB", (64, 64)), return_tensors="pt")["spatial_shapes"].tolist() == [[8, 8]]  # small: one image
    with pytest.raises(ValueError, match="200x200 image would be split into tiles"):
        ip(Image.new("RGB", (200, 200)), return_tensors="pt")


def _prompts(name, built):  # noqa: F811 (fixture imported above)
    from PIL import Image

    from vlmrl.models.processing import build_row_prompt, encode_prompts, load_processor

    processor = load_processor(built(name))
    texts = [build_row_prompt(processor, {"problem": "How many shapes?"}, 1), build_row_prompt(processor, {"problem": "Count"}, 1)]
    batch = encode_prompts(processor, texts, [[Image.new("RGB", (56, 56), "red")], [Image.new("RGB", (30, 50), "blue")]])
    return processor, {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES)
def test_naive_logps_equal_the_models_own_logits(name, built):  # noqa: F811 (fixtures imported above)
    """vlmrl's naive path (hidden states, then the LM head chunk by chunk) gives each completion token the log-prob the
    model's own full forward gives it (Llama 4 has no base `model` to take hidden states from)."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.logprobs import completion_logps, model_inputs
    from vlmrl.models.processing import append_tokens

    processor, batch = _prompts(name, built)
    model = AutoModelForImageTextToText.from_pretrained(built(name)).eval()
    ids = torch.tensor([processor.tokenizer.encode(text, add_special_tokens=False)[:3] for text in ("I see 3 red", "<answer>4</answer>")])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = completion_logps(model, batch, ids, mask)
        logits = model(**model_inputs(append_tokens(batch, ids, mask)), use_cache=False).logits.float()
    prompt_len = batch["input_ids"].shape[1]
    theirs = logits[:, prompt_len - 1 : -1].log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    assert torch.allclose(ours, theirs, atol=1e-5), (ours, theirs)


@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES)
def test_rollout_samples_g_completions_per_prompt(name, built):  # noqa: F811 (fixtures imported above)
    """The naive rollout (HF generate) gives each prompt G sampled completions, grouped by prompt (Llama 4: transformers
    does not repeat its image features for num_return_sequences, so vlmrl repeats the prompt rows itself); greedy
    rows of one prompt are equal."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.rollout import generate

    processor, batch = _prompts(name, built)
    model = AutoModelForImageTextToText.from_pretrained(built(name)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        sampled = generate(model, processor.tokenizer, batch, num_generations=3, max_new_tokens=4, shared_prefix=False)
        greedy = generate(model, processor.tokenizer, batch, num_generations=1, max_new_tokens=4, do_sample=False, shared_prefix=False)
    assert sampled.ids.shape[0] == 6 and greedy.ids.shape[0] == 2
    assert (sampled.mask.sum(1) > 0).all()


@pytest.mark.integration
def test_llama4_standin_fits_each_image_in_its_tile():
    """Llama 4's rule, by hand for a 56 px tile: a 56x56 image stays as is; a 30x50 (w x h) image is scaled by
        min(56/50, 56/30) = 1.12 to 33x56 and padded on the right with zeros (-1 once normalised); values in bfloat16 as
        transformers' processor computes them. With 4 tiles allowed, a 200x100 image has no canvas to upscale to (2x4 tiles
    would be 8), so the mildest downscale (0.56) picks the smallest such canvas, 1x2 tiles: refused."""
    from PIL import Image

    from vlmrl.processors.standin_2026b import Llama4ImageProcessorPil

    ip = Llama4ImageProcessorPil(size={"height": 56, "width": 56}, max_patches=1)
    out = ip([Image.new("RGB", (56, 56), "white"), Image.new("RGB", (30, 50), "white")], return_tensors="pt")
    assert out["pixel_values"].shape == (2, 3, 56, 56) and out["pixel_values"].dtype == torch.bfloat16
    assert out["aspect_ratios"].tolist() == [[1, 1], [1, 1]]
    second = out["pixel_values"][1]
    assert (second[:, :, :33] == 1).all() and (second[:, :, 33:] == -1).all()  # white image, zero padding
    assert (out["pixel_values"][0] == 1).all()
    tiled = Llama4ImageProcessorPil(size={"height": 56, "width": 56}, max_patches=4)
    assert tiled(Image.new("RGB", (40, 40)), return_tensors="pt")["pixel_values"].shape == (1, 3, 56, 56)  # fits one tile
    with pytest.raises(ValueError, match=r"200x100 image would be split into tiles \(56, 112\)"):
        tiled(Image.new("RGB", (200, 100)), return_tensors="pt")


@pytest.mark.integration
def test_encode_rows_gives_pixels_in_the_weights_dtype(built, data, tmp_path):  # noqa: F811 (fixtures imported above)
    """Llama 4's processor computes pixels in bfloat16 and its tower does not cast them: the training batch carries
    them in model.dtype (float32 here), or the first forward fails on mixed dtypes."""
    import json
    import pathlib

    from vlmrl.config import load_config
    from vlmrl.models.processing import load_processor
    from vlmrl.run.datasets import encode_rows

    from test_families_2026 import overrides

    cfg = load_config(None, overrides(built("llama4"), data, tmp_path))
    rows = [json.loads(line) for line in open(data["train"])][:2]
    rows = [{**row, "images": [str(pathlib.Path(data["train"]).parent / row.pop("image"))]} for row in rows]  # as the reader gives them
    batch = encode_rows(load_processor(built("llama4")), rows, cfg, torch.device("cpu"))
    assert batch["pixel_values"].dtype == torch.float32 and batch["input_ids"].dtype == torch.long


@pytest.mark.integration
@pytest.mark.parametrize(
    "name,processor_class,image_processor_class",
    [
        ("smolvlm", "SmolVLMProcessor", "SmolVLMImageProcessor"),
        ("lfm2-vl", "Lfm2VlProcessor", "Lfm2VlImageProcessor"),
        ("llama4", "Llama4Processor", "Llama4ImageProcessor"),
        ("glm5-next", "Glm5NextProcessor", "Glm5NextImageProcessor"),
    ],
)
def test_saved_folder_names_transformers_own_classes(name, processor_class, image_processor_class, built):  # noqa: F811 (fixtures imported above)
    """A folder built (or trained) here names transformers' real processor and image-processor classes, not the
    stand-ins: on a machine with torchvision, AutoProcessor loads the real ones from it."""
    import json

    folder = built(name)
    saved = json.loads((folder / "processor_config.json").read_text())
    assert saved["processor_class"] == processor_class
    assert json.loads((folder / "preprocessor_config.json").read_text())["image_processor_type"] == image_processor_class
    assert saved.get("image_processor", {}).get("image_processor_type", image_processor_class) == image_processor_class


@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES + FIRST_BATCH)
def test_projector_and_vision_tower_are_found(name, built):  # noqa: F811 (fixtures imported above)
    """`vlmrl sft`'s projector stage trains the part `projector` finds (Gemma 4's is `embed_vision`): every family has
    one, distinct from its vision tower, with parameters."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.loading import projector, vision_tower

    model = AutoModelForImageTextToText.from_pretrained(built(name))
    part, tower = projector(model), vision_tower(model)
    assert part is not tower and sum(p.numel() for p in part.parameters()) > 0
