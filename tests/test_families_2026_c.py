"""The third batch of 2026 families (issue 38; tiny_models/tiny_2026_c.py): each builds offline, its processor feeds an
image prompt into the model's own forward, the registry names it; slow tier: 2 GRPO steps with the memory savers on,
exact resume and `final/` reloading in plain transformers (the checks of tests/test_families_2026.py, reused)."""

import pytest
import torch
from PIL import Image

import test_families_2026 as first_batch
from vlmrl.models.processing import append_tokens, build_row_prompt, encode_prompts, load_processor

# The checks of the first batch, called per family here; its fixtures bound here so that pytest finds them.
built, data = first_batch.built, first_batch.data
check_builds_and_feeds = first_batch.test_builds_and_its_processor_feeds_the_model
check_grpo_resume_and_reload = first_batch.test_grpo_resume_and_reload
check_select_rows = first_batch.test_select_rows_follows_each_rows_images

# (`vlmrl tiny --family` name, config.model_type, the processor class vlmrl loads here)
NEW_FAMILIES = [
    ("ernie4.5-vl", "ernie4_5_vl_moe", "ErnieImageOnlyProcessor"),
    ("minicpm-v4.6", "minicpmv4_6", "MiniCPMVImageOnlyProcessor"),
    ("kimi-k2.5", "kimi_k25", "KimiImageOnlyProcessor"),
    ("molmo2", "molmo2", "Molmo2ImageOnlyProcessor"),
]
NAMES = [name for name, _, _ in NEW_FAMILIES]


@pytest.mark.integration
@pytest.mark.parametrize("name,model_type,processor_class", NEW_FAMILIES)
def test_builds_and_its_processor_feeds_the_model(name, model_type, processor_class, built):
    check_builds_and_feeds(name, model_type, processor_class, built)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_grpo_resume_and_reload(name, built, data, tmp_path):
    check_grpo_resume_and_reload(name, built, data, tmp_path)


@pytest.mark.integration
def test_ernie_completion_tokens_take_the_text_experts(built):
    """ERNIE routes each token to text or vision experts by moe_mm_token_type_ids [B, P]: vlmrl's completion forward
    extends it with zeros (completions are text), so prompt + completion scores equal the model's own forward over
    the same tokens with the processor's ids for the whole sequence."""
    from transformers import AutoModelForImageTextToText

    path = built("ernie4.5-vl")
    processor = load_processor(path)
    text = build_row_prompt(processor, {"problem": "How many shapes?"}, 1)
    batch = encode_prompts(processor, [text], [[Image.new("RGB", (56, 56), "red")]])
    assert int(batch["moe_mm_token_type_ids"].sum()) == int(batch["mm_token_type_ids"].sum()) + 2  # start/end markers too
    completion = torch.tensor([processor.tokenizer(" three shapes", add_special_tokens=False)["input_ids"]])
    full = append_tokens(batch, completion, torch.ones_like(completion))
    assert full["moe_mm_token_type_ids"].shape == full["input_ids"].shape
    assert full["moe_mm_token_type_ids"][:, -completion.shape[1] :].eq(0).all()
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    whole = processor(text=[text + processor.tokenizer.decode(completion[0])], images=[Image.new("RGB", (56, 56), "red")], return_tensors="pt")
    assert torch.equal(whole["input_ids"], full["input_ids"])
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids", "moe_mm_token_type_ids")
    with torch.no_grad():
        ours = model(**{k: full[k] for k in keys}).logits
        theirs = model(**{k: whole[k] for k in keys}).logits
    assert torch.equal(ours, theirs)


@pytest.mark.integration
def test_ernie_refuses_the_load_balancing_loss_and_routing_replay(built):
    """ERNIE's text and vision routers each see only their own tokens: vlmrl's load-balancing loss (one router over
    every token of a call) would raise mid-update, so it is refused up front with the fix; off, nothing is recorded."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.config import ConfigError
    from vlmrl.models.router import find_routing, routing_for

    model = AutoModelForImageTextToText.from_pretrained(built("ernie4.5-vl"))
    assert find_routing(model) is not None  # it is an MoE model: its routers are found
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.01.*separate expert sets.*set algorithm.router_aux_loss_coef=0"):
        routing_for(model, 0.01)
    with pytest.raises(ConfigError, match="routing_replay=experts"):
        routing_for(model, 0.0, "experts")
    assert routing_for(model, 0.0) is None


@pytest.mark.integration
@pytest.mark.parametrize("name", ["ernie4.5-vl", "minicpm-v4.6", "kimi-k2.5", "molmo2"])
def test_select_rows_follows_each_rows_images(name, built):
    check_select_rows(name, built)


# (family, what the processor makes of [56 px, 300x120 px, 48x40 px] images, the model's vision inputs)
UNEVEN = [
    ("minicpm-v4.6", ("image_num_patches", [1, 4, 1]), ("pixel_values", "target_sizes")),  # slices, packed along the last axis
    ("molmo2", ("image_num_crops", [2, 3, 2]), ("pixel_values", "image_token_pooling", "image_grids", "image_num_crops", "mm_token_type_ids")),
]


@pytest.mark.integration
@pytest.mark.parametrize("name,pieces,vision", UNEVEN)
def test_select_rows_regathers_uneven_images_and_the_model_agrees(name, pieces, vision, built):
    """MiniCPM-V packs every slice of every image along the last axis of pixel_values [1, 3, 14, columns]; Molmo2's
    image_token_pooling indexes the batch's patches. A wide image (more slices / crops) between two small ones, rows
    gathered as [1, 0, 1], equal the rows encoded directly, and the model's logits on both batches are equal."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.processing import select_rows

    processor = load_processor(built(name))
    texts = [build_row_prompt(processor, {"problem": "A <image> B <image>"}, 2), build_row_prompt(processor, {"problem": "C"}, 1)]
    images = [[Image.new("RGB", (56, 56), "red"), Image.new("RGB", (300, 120), "blue")], [Image.new("RGB", (48, 40), "green")]]
    batch = encode_prompts(processor, texts, images)
    key, counts = pieces
    assert batch[key].tolist() == counts
    picked = select_rows(batch, [1, 0, 1])
    direct = encode_prompts(processor, [texts[1], texts[0], texts[1]], [images[1], images[0], images[1]])
    assert picked.keys() == direct.keys()
    for k, value in direct.items():
        if torch.is_tensor(value):
            assert torch.equal(picked[k], value), k
    model = AutoModelForImageTextToText.from_pretrained(built(name)).eval()
    keys = ("input_ids", "attention_mask", *vision)
    with torch.no_grad():
        assert torch.equal(model(**{k: picked[k] for k in keys}).logits, model(**{k: direct[k] for k in keys}).logits)


@pytest.mark.unit
def test_kimi_sizing_rule_on_hand_computed_sizes():
    """Kimi-K2.5's resize-then-pad rule (PIL port of Kimi_K25ImageProcessor's): never enlarges, shrinks to the
    per-side and total patch budgets, pads to a multiple of patch x merge (28 px)."""
    from vlmrl.processors.standin_2026 import kimi_navit_size

    assert kimi_navit_size(56, 56, 14, 2, 16384, 8) == ((56, 56), (56, 56))
    assert kimi_navit_size(50, 70, 14, 2, 16384, 8) == ((50, 70), (56, 84))  # padded, not resized
    assert kimi_navit_size(100, 200, 14, 2, 16384, 8) == ((56, 112), (56, 112))  # 8 patches a side: scale 0.56
    assert kimi_navit_size(56, 56, 14, 2, 4, 8) == ((28, 28), (28, 28))  # 4 patches in all: scale 0.5


@pytest.mark.integration
def test_kimi_patches_are_row_major_per_image(built):
    """pixel_values [patches, 3, 14, 14] lists each image's patches row by row (the layout MoonViT's 2-D positions
    assume): a 56 px image white only in its top-right quadrant has white patches 2, 3, 6, 7 of its 4x4 grid."""
    import numpy as np

    processor = load_processor(built("kimi-k2.5"))
    pixels = np.zeros((56, 56, 3), dtype=np.uint8)
    pixels[:28, 28:] = 255
    out = processor.image_processor(images=[Image.fromarray(pixels)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]] and out["pixel_values"].shape == (16, 3, 14, 14)
    white = [i for i in range(16) if out["pixel_values"][i].mean() > 0]
    assert white == [2, 3, 6, 7]
    assert torch.allclose(out["pixel_values"][white], torch.ones(1)) and torch.allclose(out["pixel_values"][0], -torch.ones(1))


# (family, model.lora_target_parameters for its fused MoE experts, or None for a dense decoder)
LORA_RUNS = [
    ("ernie4.5-vl", "[text_moe.experts.gate_up_proj,text_moe.experts.down_proj,vision_moe.experts.gate_up_proj,vision_moe.experts.down_proj]"),
    ("minicpm-v4.6", None),
    ("kimi-k2.5", "[mlp.experts.gate_up_proj,mlp.experts.down_proj]"),
    ("molmo2", None),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,experts", LORA_RUNS, ids=[name for name, _ in LORA_RUNS])
def test_lora_grpo_and_sft_end_to_end(name, experts, built, data, tmp_path):
    """`vlmrl train` with LoRA (on the fused MoE experts too where the family has them; beta > 0, so the reference is
    the adapter-disabled model) trains its adapters, and `final/` reloads in plain transformers; `vlmrl sft`
    (projector stage then full) finishes and its `final/` reloads too."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrl.cli import main

    path = built(name)
    grpo = first_batch.overrides(path, data, tmp_path / "grpo")
    grpo += ["model.use_lora=true", "algorithm.beta=0.05", "optim.learning_rate=1e-2"]
    grpo += [f"model.lora_target_parameters={experts}"] if experts else []
    assert main(["train", *grpo]) == 0
    adapter = load_file(tmp_path / "grpo" / "final" / "adapter" / "adapter_model.safetensors")
    # B starts at zero: every adapter was trained, but the last layer's vision experts (ERNIE), whose outputs (image
    # positions) no later position reads.
    last = f"layers.{AutoConfig.from_pretrained(path).get_text_config().num_hidden_layers - 1}."
    trained = {k: v for k, v in adapter.items() if "lora_B" in k and not ("vision_moe" in k and last in k)}
    assert trained and all(v.abs().sum() > 0 for v in trained.values()), [k for k, v in trained.items() if not v.abs().sum()]
    assert not experts or any("experts" in k for k in trained)
    assert "vision_moe" not in (experts or "") or any("vision_moe" in k for k in trained)
    AutoModelForImageTextToText.from_pretrained(tmp_path / "grpo" / "final")
    common = [f"model.name_or_path={path}", f"data.train_path={data['train']}", "data.eval_path=", "data.min_pixels=3136", "data.max_pixels=3136"]
    common += ["logging.progress_bar=false", "logging.tensorboard=false", "logging.report=false", f"training.output_dir={tmp_path / 'sft'}"]
    assert main(["sft", *common, "sft.projector_steps=1", "sft.steps=1", "sft.batch_size=2"]) == 0
    AutoModelForImageTextToText.from_pretrained(tmp_path / "sft" / "final")


@pytest.mark.unit
@pytest.mark.parametrize("name,model_type,processor_class", NEW_FAMILIES)
def test_matrix_states_each_familys_fallback_reason(name, model_type, processor_class):
    """The families table's grouped-vision and shared-prefix cells of these families are the registry's reason."""
    import json
    import pathlib

    from vlmrl.families import family_of

    matrix = json.loads((pathlib.Path(__file__).parents[1] / "docs" / "families_matrix.json").read_text())
    cells = matrix["families"][name]["cells"]
    family = family_of(model_type)
    assert family.grouped is None
    assert cells["grouped vision"] == cells["shared prefix"] == f"fallback: naive path: {family.fallback_reason}"


@pytest.mark.integration
def test_ernie_folder_names_a_video_processor_the_real_processor_can_build(built):
    """With torchvision, AutoProcessor builds the real Ernie4_5_VLMoeProcessor from the folder; without a video entry
    it built the video processor from the image settings and refused them (temporal patch 1), and its timestamp font
    is a hub download (offline here): the saved entry names the real class with drawing off. (The comparison with
    the real processor itself, ids equal, is scripts/check_standins.py on a machine with torchvision.)"""
    import json

    saved = json.loads((built("ernie4.5-vl") / "processor_config.json").read_text())
    assert saved["processor_class"] == "Ernie4_5_VLMoeProcessor"
    assert saved["video_processor"] == {"video_processor_type": "Ernie4_5_VLMoeVideoProcessor", "draw_on_frames": False}
    assert saved["image_processor"]["image_processor_type"] == "Ernie4_5_VLMoeImageProcessor"
