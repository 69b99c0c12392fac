"""The 2026 families (issue 38): each builds offline, its processor round-trips an image prompt into the model's
own forward, the registry names it; slow tier: 2 GRPO steps with the memory savers on (chunked log-probs, grouped
vision and shared prefix requested: these families take the naive path), exact resume, and `final/` reloads in
plain transformers."""

import json
import pathlib

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from vlmrl.checkpoints.files import list_checkpoints
from vlmrl.config import load_config
from vlmrl.data.tasks import make_count_task
from vlmrl.families import GENERIC, family_of
from vlmrl.tiny_models.tiny_families import BUILDERS
from vlmrl.models.processing import build_row_prompt, encode_prompts, load_processor
from vlmrl.train import train

# (`vlmrl tiny --family` name, config.model_type, the processor class vlmrl loads here)
NEW_FAMILIES = [
    ("mistral3", "mistral3", "PixtralImageOnlyProcessor"),
    ("gemma4", "gemma4", "Gemma4ImageOnlyProcessor"),
    ("glm4v", "glm4v", "GlmImageOnlyProcessor"),
    ("glm4v-moe", "glm4v_moe", "GlmImageOnlyProcessor"),
    ("glm4.6v", "glm46v", "GlmImageOnlyProcessor"),
    ("idefics3", "idefics3", "Idefics3Processor"),
]
NAMES = [name for name, _, _ in NEW_FAMILIES]
LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = BUILDERS[name](tmp_path_factory.mktemp(f"tiny-{name}"))
        return cache[name]

    return get


@pytest.mark.integration
@pytest.mark.parametrize("name,model_type,processor_class", NEW_FAMILIES)
def test_builds_and_its_processor_feeds_the_model(name, model_type, processor_class, built):
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = built(name)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == model_type
    family = family_of(model_type)
    assert family is not GENERIC and name in family.tiny and family.grouped is None  # naive path only, by design
    processor = load_processor(path)
    assert type(processor).__name__ == processor_class
    tokenizer = getattr(processor, "tokenizer", processor)
    assert len(tokenizer) <= config.get_text_config().vocab_size  # every id the model samples decodes
    texts = [build_row_prompt(processor, {"problem": "How many shapes?"}, 1), build_row_prompt(processor, {"problem": "Count <image> again"}, 1)]
    images = [[Image.new("RGB", (56, 56), "red")], [Image.new("RGB", (48, 40), "blue")]]
    batch = encode_prompts(processor, texts, images)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    inputs = {k: v for k, v in batch.items() if k not in ("images_per_row", "videos_per_row", "image_num_patches")}
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}  # as encode_rows does (Llama 4: bf16 pixels)
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(out.logits).all()
    # Each image's features take exactly its placeholder tokens (the model raises otherwise), and the images count.
    image_id = config.image_token_id if getattr(config, "image_token_id", None) is not None else config.image_token_index
    assert int((batch["input_ids"] == image_id).sum()) > 0
    decoded = tokenizer.decode(batch["input_ids"][0], skip_special_tokens=True)
    assert "How many shapes?" in decoded


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=12, n_test=0, seed=0, image_size=56)


def overrides(model, data, out):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        "data.eval_path=",
        f"training.output_dir={out}",
        "training.max_steps=2",
        "rollout.num_generations=4",
        "training.per_device_train_batch_size=4",
        "rollout.generation_batch_size=8",
        "rollout.max_completion_length=5",
        "optim.learning_rate=1e-3",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "memory.group_vision=true",
        "memory.shared_prefix=true",
        f"algorithm.reward_funcs=['{LENGTH_REWARD}']",
    ]


def _losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(folder):
    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_grpo_resume_and_reload(name, built, data, tmp_path):
    from transformers import AutoModelForImageTextToText

    path = built(name)
    straight = tmp_path / "straight"
    train(load_config(None, overrides(path, data, straight)))
    resumed = tmp_path / "resumed"
    cfg = load_config(None, overrides(path, data, resumed))
    train(cfg, stop_after=1)
    assert [p.name for p in list_checkpoints(resumed)] == ["checkpoint-1"]
    lines = []
    train(cfg, log=lines.append)
    assert any("resumed from" in line and "checkpoint-1" in line for line in lines), lines
    assert _losses(resumed) == _losses(straight) and len(_losses(straight)) == 2
    a, b, before = _weights(straight / "final"), _weights(resumed / "final"), _weights(path)
    assert a.keys() == b.keys() == before.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(before[k], a[k]) for k in a), "no weight changed"
    model = AutoModelForImageTextToText.from_pretrained(resumed / "final")
    assert type(model).__name__ == type(AutoModelForImageTextToText.from_pretrained(path)).__name__
    assert model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False).shape[1] >= 3


@pytest.mark.integration
@pytest.mark.parametrize("name", ["mistral3", "gemma4", "glm4v"])
def test_select_rows_follows_each_rows_images(name, built):
    """Rows with 2 and 1 images, gathered as [1, 0, 1] (how rollout repeats prompts): every tensor equals encoding
    those rows directly, per-image keys (pixel_values, image_sizes, image_position_ids, image_grid_thw) included.
    (Idefics3 batches images per row, [rows, images, ...]: only one image per row is supported; docs/families.md.)"""
    from vlmrl.models.processing import select_rows

    processor = load_processor(built(name))
    texts = [build_row_prompt(processor, {"problem": "A <image> B <image>"}, 2), build_row_prompt(processor, {"problem": "C"}, 1)]
    red, blue, green = (Image.new("RGB", (56, 56), c) for c in ("red", "blue", "green"))
    images = [[red, blue], [green]]
    picked = select_rows(encode_prompts(processor, texts, images), [1, 0, 1])
    direct = encode_prompts(processor, [texts[1], texts[0], texts[1]], [images[1], images[0], images[1]])
    assert picked.keys() == direct.keys()
    for key, value in direct.items():
        if torch.is_tensor(value):
            assert torch.equal(picked[key], value), key


@pytest.mark.integration
def test_mistral3_standin_refuses_a_placeholder_image_mismatch(built):
    processor = load_processor(built("mistral3"))
    with pytest.raises(ValueError, match=r"2 \[IMG\] placeholders in the prompts but 1 images"):
        processor(text=["[INST][IMG][IMG]two[/INST]"], images=[Image.new("RGB", (56, 56))], padding=True, return_tensors="pt")
