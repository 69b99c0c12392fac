"""Tiny VLM builders, the processor interface, model loading/freezing/LoRA and saving."""

import json
import types

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoTokenizer

from vlmrl.models.loading import (
    ModelLoadError,
    count_parameters,
    language_model,
    load_model,
    output_head,
    projector,
    reference_disabled_adapter,
    save_model,
    unwrap,
    vision_tower,
)
from vlmrl.models.processing import (
    QwenImageProcessor,
    build_prompt,
    decode,
    encode_prompts,
    load_processor,
    select_rows,
    vision_keys,
)
from vlmrl.tiny_models.tiny import build_tiny_qwen2vl, default_model_path, train_tokenizer

FAMILIES = ["tiny_qwen25vl", "tiny_qwen2vl", "tiny_llava", "tiny_qwen3vl", "tiny_gemma3"]
# Image placeholder that the chat template writes once per image, per family (the processor expands it).
PLACEHOLDER = {"tiny_llava": "<image>", "tiny_gemma3": "<start_of_image>"}
NON_MODEL_KEYS = ("images_per_row",)


def model_cfg(path, **overrides):
    """Stand-in for vlmrl.config.ModelConfig with its defaults."""
    base = dict(
        name_or_path=str(path),
        dtype="float32",
        attn_implementation="sdpa",
        freeze_vision_tower=False,
        train_projector_only=False,
        use_lora=False,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_vision=False,
        trust_remote_code=False,
        allow_hub_download=False,
        gradient_checkpointing=False,
    )
    base.update(overrides)
    return types.SimpleNamespace(**base)


def images(n, seed=0):
    """n small RGB images of different sizes (so Qwen grids differ per image)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [(56, 56), (84, 56), (56, 112), (70, 70)]
    out = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        arr = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
        out.append(Image.fromarray(arr))
    return out


def prompt_batch(processor):
    """Three rows with 1, 2 and 0 images (rows of different lengths: left padding is exercised)."""
    imgs = images(3)
    per_row = [[imgs[0]], [imgs[1], imgs[2]], []]
    texts = [build_prompt(processor, f"How many shapes are there in the image? {i}", len(r)) for i, r in enumerate(per_row)]
    return texts, per_row, encode_prompts(processor, texts, per_row)


def inputs(batch):
    return {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}


@torch.no_grad()
def logits(model, batch):
    return model(**inputs(batch)).logits


# ---------------------------------------------------------------- tiny builders


def test_tokenizer_makes_task_words_cheap():
    tok = train_tokenizer()
    for text, most in [
        (" red", 1),
        (" square", 1),
        (" triangle", 1),
        ("<think>", 1),
        ("</answer>", 1),
        ("How many", 2),
        (" 7", 1),
        (" 224", 2),
        ("Give the bounding box", 4),
    ]:
        assert len(tok(text)["input_ids"]) <= most, (text, tok.tokenize(text))
    assert tok.padding_side == "left"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert decode(tok, [tok("<|im_start|><answer>3</answer><|im_end|>")["input_ids"]]) == ["<answer>3</answer>"]


def test_build_is_seeded_and_uses_tokenizer_ids(tmp_path):
    a, b = build_tiny_qwen2vl(tmp_path / "a"), build_tiny_qwen2vl(tmp_path / "b")
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    model = AutoModelForImageTextToText.from_pretrained(a)
    tok = AutoTokenizer.from_pretrained(a)
    assert model.config.text_config.vocab_size == len(tok)
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_default_model_path_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path))
    path = default_model_path()
    assert path == tmp_path / "tiny-qwen2.5-vl-v2" and (path / "config.json").is_file()
    assert json.loads((path / "config.json").read_text())["vlmrl_tiny"] == "tiny-qwen2.5-vl-v2"  # model_defaults' marker
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen2.5-vl-v2"]  # no temp folder left


# ---------------------------------------------------------------- processor


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_encoding_image_token_count(family, request):
    path = request.getfixturevalue(family)
    processor = load_processor(path, min_pixels=28 * 28, max_pixels=56 * 56 * 4)
    texts, per_row, batch = prompt_batch(processor)
    config = AutoModelForImageTextToText.from_pretrained(path).config
    n_tokens = (batch["input_ids"] == config.image_token_id).sum(dim=1)
    assert batch["images_per_row"].tolist() == [1, 2, 0]
    assert batch["attention_mask"][:, 0].tolist() != [1, 1, 1]  # left padded: some row starts with padding
    assert batch["attention_mask"][:, -1].tolist() == [1, 1, 1]
    if "image_grid_thw" in batch:  # Qwen-VL
        try:
            import torchvision  # noqa: F401

            has_torchvision = True
        except Exception:  # missing, or the CUDA build that fails to import beside the CPU torch
            has_torchvision = False
        # Without torchvision the image-only stand-in; with it (seen on a GPU machine) the real processor.
        assert isinstance(processor, QwenImageProcessor) != has_torchvision
        per_image = (batch["image_grid_thw"].prod(dim=1) // 4).tolist()
        assert n_tokens.tolist() == [per_image[0], per_image[1] + per_image[2], 0]
        assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(dim=1).sum())
        assert (batch["mm_token_type_ids"] == 1).sum(dim=1).tolist() == n_tokens.tolist()
        assert sorted(vision_keys(batch)) == ["image_grid_thw", "pixel_values"]
    elif family == "tiny_gemma3":  # Gemma 3: 8x8 patches average-pooled to 4x4 tokens per image
        assert n_tokens.tolist() == [16, 32, 0]
        assert tuple(batch["pixel_values"].shape) == (3, 3, 64, 64)
        assert (batch["token_type_ids"] == 1).sum(dim=1).tolist() == n_tokens.tolist()
    else:  # LLaVA: (56/8)^2 patches per image, CLS dropped
        assert n_tokens.tolist() == [49, 98, 0]
        assert tuple(batch["pixel_values"].shape) == (3, 3, 56, 56)
    assert texts[1].count(PLACEHOLDER.get(family, "<|vision_start|>")) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_select_rows_matches_row_by_row_encoding(family, request):
    path = request.getfixturevalue(family)
    processor = load_processor(path, min_pixels=28 * 28, max_pixels=56 * 56 * 4)
    model = AutoModelForImageTextToText.from_pretrained(path)
    texts, per_row, batch = prompt_batch(processor)
    rows = [2, 1, 1, 0, 0]  # reorder + repeats, including a row without images
    picked = select_rows(batch, rows)
    assert picked["images_per_row"].tolist() == [0, 2, 2, 1, 1]
    out = logits(model, picked)
    for j, r in enumerate(rows):
        single = logits(model, encode_prompts(processor, [texts[r]], [per_row[r]]))[0]
        torch.testing.assert_close(out[j, -single.shape[0] :], single, atol=1e-5, rtol=1e-4)


def test_select_rows_without_images(tiny_qwen25vl):
    processor = load_processor(tiny_qwen25vl)
    batch = encode_prompts(processor, ["a", "b b"], [[], []])
    picked = select_rows(batch, torch.tensor([1, 1, 0]))
    assert picked["input_ids"].shape[0] == 3 and not vision_keys(picked)
    with pytest.raises(IndexError, match="out of range"):
        select_rows(batch, [2])


# ---------------------------------------------------------------- load, save, reload


@pytest.mark.parametrize("family", FAMILIES)
def test_save_reload_gives_identical_logits(family, request, tmp_path):
    path = request.getfixturevalue(family)
    model = load_model(model_cfg(path))
    processor = load_processor(path)
    _, _, batch = prompt_batch(processor)
    save_model(model, processor, tmp_path / "out")
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits(reloaded, batch), logits(model, batch), atol=0, rtol=0)
    again = load_processor(tmp_path / "out")
    assert type(again) is type(processor)
    text = build_prompt(again, "x", 1)
    assert encode_prompts(again, [text], [images(1)])["input_ids"].tolist() == encode_prompts(processor, [text], [images(1)])["input_ids"].tolist()


def test_missing_folder_or_files_name_the_path(tiny_qwen2vl, tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist.*allow_hub_download") as e:
        load_model(model_cfg(tmp_path / "nope"))
    assert str(tmp_path / "nope") in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(model_cfg(tmp_path / "empty"))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_qwen2vl / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no weight files") as e:
        load_model(model_cfg(no_weights))
    assert str(no_weights) in str(e.value)


def test_flash_attention_missing_is_a_clear_error(tiny_qwen2vl):
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash-attn is installed")
    except ImportError:
        pass
    with pytest.raises(ModelLoadError, match="flash-attn package is not installed"):
        load_model(model_cfg(tiny_qwen2vl, attn_implementation="flash_attention_2"))


# ---------------------------------------------------------------- freezing


def trainable_names(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def names_of(model, part):
    ids = {id(p) for p in part.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("family", ["tiny_qwen25vl", "tiny_llava", "tiny_qwen3vl", "tiny_gemma3"])
def test_freezing_options(family, request):
    path = request.getfixturevalue(family)
    full = load_model(model_cfg(path))
    assert count_parameters(full)[0] == count_parameters(full)[1]

    proj_only = load_model(model_cfg(path, train_projector_only=True))
    assert trainable_names(proj_only) == names_of(proj_only, projector(proj_only)) != set()

    frozen_vt = load_model(model_cfg(path, freeze_vision_tower=True))
    vision = names_of(frozen_vt, vision_tower(frozen_vt))
    proj = names_of(frozen_vt, projector(frozen_vt))
    everything = {n for n, _ in frozen_vt.named_parameters()}
    assert trainable_names(frozen_vt) == (everything - vision) | proj
    assert names_of(frozen_vt, language_model(frozen_vt)) <= trainable_names(frozen_vt)
    assert names_of(frozen_vt, output_head(frozen_vt)) <= trainable_names(frozen_vt)


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="cannot find the vision tower"):
        vision_tower(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- LoRA


def randomise_lora(model, seed=0):
    """LoRA B starts at zero (adapters are a no-op); make them matter for the tests."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("family", ["tiny_qwen25vl", "tiny_llava", "tiny_qwen3vl", "tiny_gemma3"])
def test_lora_targets_language_model_only_unless_lora_vision(family, request):
    path = request.getfixturevalue(family)
    model = load_model(model_cfg(path, use_lora=True))
    lora = {n for n in trainable_names(model)}
    assert lora and all("lora_" in n for n in lora)
    vision = names_of(model, vision_tower(model))
    proj = names_of(model, projector(model))
    assert not lora & vision and not lora & proj
    assert any("q_proj" in n for n in lora) and any("down_proj" in n for n in lora)

    with_vision = load_model(model_cfg(path, use_lora=True, lora_vision=True))
    vision_lora = trainable_names(with_vision) & names_of(with_vision, vision_tower(with_vision))
    assert vision_lora and not vision_lora & names_of(with_vision, projector(with_vision))


def test_reference_disabled_adapter_gives_base_logits(tiny_qwen25vl):
    processor = load_processor(tiny_qwen25vl)
    _, _, batch = prompt_batch(processor)
    base = logits(load_model(model_cfg(tiny_qwen25vl)), batch)
    model = load_model(model_cfg(tiny_qwen25vl, use_lora=True))
    randomise_lora(model)
    assert not torch.allclose(logits(model, batch), base, atol=1e-4)
    with reference_disabled_adapter(model) as ref:
        torch.testing.assert_close(logits(ref, batch), base)
    assert not torch.allclose(logits(model, batch), base, atol=1e-4)  # adapters back on
    with pytest.raises(ValueError, match="needs a peft LoRA model"):
        with reference_disabled_adapter(load_model(model_cfg(tiny_qwen25vl))):
            pass


@pytest.mark.parametrize("family", ["tiny_qwen25vl", "tiny_llava", "tiny_qwen3vl", "tiny_gemma3", "tiny_qwen3vl_moe"])
def test_save_lora_model_reloads_in_plain_transformers(family, request, tmp_path):
    path = request.getfixturevalue(family)
    processor = load_processor(path)
    _, _, batch = prompt_batch(processor)
    model = load_model(model_cfg(path, use_lora=True, lora_vision=True, gradient_checkpointing=True))
    randomise_lora(model)
    expected = logits(model, batch)
    out = save_model(model, processor, tmp_path / "final")
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert not any("lora" in k for k in load_file(out / "model.safetensors"))
    plain = AutoModelForImageTextToText.from_pretrained(out)
    torch.testing.assert_close(logits(plain, batch), expected, atol=1e-4, rtol=1e-4)
    gen = plain.generate(**inputs(batch), max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > batch["input_ids"].shape[1]
    assert len(decode(load_processor(out), gen)) == 3
    assert any("lora_" in n for n, _ in model.named_parameters())  # the live model keeps its adapters


def test_lora_with_gradient_checkpointing_trains(tiny_qwen25vl):
    processor = load_processor(tiny_qwen25vl)
    _, _, batch = prompt_batch(processor)
    model = load_model(model_cfg(tiny_qwen25vl, use_lora=True, gradient_checkpointing=True)).train()
    model(**inputs(batch)).logits.float().pow(2).mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    trainable, total = count_parameters(model)
    assert 0 < trainable < total


# ---------------------------------------------------------------- processor fallbacks and completions


def test_real_autoprocessor_is_kept_and_bare_tokenizer_falls_back(tiny_qwen25vl, monkeypatch):
    import transformers

    class FakeFull:  # what AutoProcessor returns when torchvision is installed
        def __init__(self):
            self.tokenizer = AutoTokenizer.from_pretrained(tiny_qwen25vl)
            self.image_processor = load_processor(tiny_qwen25vl).image_processor

    fake = FakeFull()
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda *a, **k: fake)
    assert load_processor(tiny_qwen25vl, max_pixels=3136) is fake
    assert fake.image_processor.size.longest_edge == 3136
    # transformers sometimes returns only the tokenizer for a Qwen-VL folder without torchvision
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda *a, **k: fake.tokenizer)
    assert isinstance(load_processor(tiny_qwen25vl), QwenImageProcessor)


def test_append_tokens_keeps_mrope_inputs_aligned(tiny_qwen25vl):
    from vlmrl.models.processing import append_tokens

    processor = load_processor(tiny_qwen25vl)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen25vl)
    _, _, batch = prompt_batch(processor)
    ids = torch.randint(20, 500, (3, 4))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    full = append_tokens(batch, ids, mask)
    assert full["mm_token_type_ids"].shape == full["input_ids"].shape == (3, batch["input_ids"].shape[1] + 4)
    p = batch["input_ids"].shape[1]
    torch.testing.assert_close(logits(model, full)[:, :p], logits(model, batch), atol=1e-5, rtol=1e-4)


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("family", ["tiny_qwen3vl_moe", "tiny_qwen35_moe"])
def test_lora_on_fused_expert_weights_trains_and_merges(family, request, tmp_path):
    """model.lora_target_parameters puts LoRA on the fused expert tensors (not nn.Linear, out of lora_target_modules'
    reach): every layer's experts get adapters with gradients, and the merged final folder reloads in plain
    transformers with the adapted model's logits."""
    path = request.getfixturevalue(family)
    processor = load_processor(path)
    _, _, batch = prompt_batch(processor)
    model = load_model(model_cfg(path, use_lora=True, lora_target_parameters=EXPERTS)).train()
    expert_lora = [n for n, p in model.named_parameters() if "lora_" in n and "experts" in n]
    layers = unwrap(model).config.get_text_config().num_hidden_layers
    assert len(expert_lora) == 2 * 2 * layers, expert_lora  # A and B of both expert tensors in every layer
    randomise_lora(model)
    model(**inputs(batch)).logits.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if n in expert_lora}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    model.eval()
    expected = logits(model, batch)
    out = save_model(model, processor, tmp_path / "final")
    plain = AutoModelForImageTextToText.from_pretrained(out)
    torch.testing.assert_close(logits(plain, batch), expected, atol=1e-4, rtol=1e-4)
    base = AutoModelForImageTextToText.from_pretrained(path)
    assert not torch.allclose(logits(base, batch), expected, atol=1e-3)  # the expert adapters changed the model


def test_lora_target_parameters_that_match_nothing_are_refused(tiny_qwen3vl_moe):
    with pytest.raises(ModelLoadError, match=r"lora_target_parameters: \['mlp.expert.gate_up_proj'\] matched no parameter"):
        load_model(model_cfg(tiny_qwen3vl_moe, use_lora=True, lora_target_parameters=["mlp.expert.gate_up_proj"]))
