"""Log-prob paths: the grouped path (one vision pass per unique prompt) against the naive path
(prompts repeated per completion with select_rows), and the chunked LM head against a full softmax."""

import types

import numpy as np
import pytest
import torch
from PIL import Image

from vlmrl.models.logprobs import (
    completion_logps,
    completion_logps_grouped,
    grouped_family,
    selective_logps,
    vision_encode_counter,
)
from vlmrl.models.loading import load_model, vision_tower
from vlmrl.models.processing import build_prompt, encode_prompts, load_processor, select_rows

G = 3
# Completion lengths of the 2 * G rows (right padded to the longest): different per row.
LENGTHS = [7, 3, 5, 1, 6, 4]


def model_cfg(path, **overrides):
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
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lora_vision=False,
        trust_remote_code=False,
        allow_hub_download=False,
        gradient_checkpointing=False,
    )
    base.update(overrides)
    return types.SimpleNamespace(**base)


def images(rng, n, size=56):
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def prompt_batch(processor, images_per_prompt, seed=0):
    rng = np.random.default_rng(seed)
    problems = ["what is shown?", "compare these pictures and describe every detail you can see", "count"]
    texts = [build_prompt(processor, problems[i % 3], k) for i, k in enumerate(images_per_prompt)]
    return encode_prompts(processor, texts, [images(rng, k) for k in images_per_prompt])


def completions(processor, lengths, seed=0):
    """Ordinary (non-special) token ids, right padded with the pad id; mask marks the real tokens."""
    tok = processor.tokenizer
    vocab = sorted(set(tok("the answer is 42 because two cats sit on a red mat", add_special_tokens=False).input_ids) - set(tok.all_special_ids))
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.tensor(vocab)[torch.randint(len(vocab), (len(lengths), t), generator=g)]
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids[mask == 0] = tok.pad_token_id
    return ids, mask


def grads(model):
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters() if p.requires_grad}


# Qwen3.5's Gated DeltaNet decay parameters: their gradients are small sums of large cancelling terms from the
# chunked delta rule, which runs in float32 whatever the model dtype. The naive path against itself with 3 more
# left-pad columns (same math, other chunk boundaries) already differs by 9e-4 of their scale; allowed: 1e-2.
LOOSE_GRADS = {"linear_attn.A_log": 1e-2, "linear_attn.dt_bias": 1e-2}


def assert_grads_close(ga, gb, rtol=1e-5, loose: dict | None = None):
    """Every gradient within rtol of its own scale (or loose[part] for names containing part). Gradients that
    are mathematically zero (attention key biases: softmax ignores them) or tiny beside the rest are rounding noise
    at the model's gradient scale, so the floor is one float32 rounding of the largest gradient of the model
    (eps * max|g|). The floor used to be 1e-8 * max|g|, below float32's own resolution: an Intel Xeon missed it on a
    Gated DeltaNet gradient (1.15e-7 against 1.07e-7 allowed, max|g| 10.7) that an AMD EPYC met."""
    assert ga.keys() == gb.keys()
    floor = torch.finfo(torch.float32).eps * max(g.abs().max().item() for g in ga.values() if g is not None)
    for name in ga:
        a, b = ga[name], gb[name]
        assert (a is None) == (b is None), name
        if a is None:
            continue
        scale = a.abs().max().item()
        err = (a - b).abs().max().item()
        tol = next((t for part, t in (loose or {}).items() if part in name), rtol)
        assert err <= tol * scale + floor, f"{name}: max error {err} vs scale {scale}"


def loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    logps, mask = fn()
    (logps * mask).sum().backward()
    return logps.detach(), grads(model)


# Families whose vision tower sees tiles (anyres / dynamic tiles), not one input per image.
TILED = ("tiny_llava_onevision", "tiny_internvl")


def vision_units(model, prompts) -> int:
    """What vision_encode_counter counts when the model's own forward encodes `prompts` once: their images
    (their tiles for the tiled families)."""
    from vlmrl.models.logprobs import model_inputs
    from vlmrl.models.loading import unwrap

    with torch.no_grad(), vision_encode_counter(model) as calls:
        unwrap(model)(**model_inputs(prompts))
    return calls.images


FAMILIES = {
    "tiny_qwen25vl": [1, 2],
    "tiny_qwen2vl": [1, 2],
    "tiny_llava": [1, 1],
    "tiny_qwen3vl": [1, 2],
    "tiny_gemma3": [1, 2],
    "tiny_qwen3vl_moe": [1, 2],
    "tiny_qwen35": [1, 2],
    "tiny_qwen35_moe": [1, 2],
    "tiny_llava_onevision": [1, 2],
    "tiny_internvl": [1, 2],
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    path = request.getfixturevalue(request.param)
    model = load_model(model_cfg(path)).eval()  # all weights trainable: vision tower, projector, LM
    processor = load_processor(path)
    return request.param, model, processor


def test_grouped_equals_naive_values_grads_and_vision_calls(family):
    name, model, processor = family
    assert grouped_family(model) in ("qwen", "qwen3", "gemma3", "llava", "onevision", "internvl")
    per_prompt = FAMILIES[name]
    prompts = prompt_batch(processor, per_prompt)
    row_prompt = torch.arange(len(per_prompt)).repeat_interleave(G)
    ids, mask = completions(processor, LENGTHS)
    repeated = select_rows(prompts, row_prompt)
    unique_images = vision_units(model, prompts)
    assert unique_images == sum(per_prompt) or name in TILED

    # temperature != 1 with gradients: test_grouped_lora_checkpointing_qwen; without: the scoring test.
    with vision_encode_counter(model) as naive_calls:
        naive, g_naive = loss_and_grads(model, lambda: (completion_logps(model, repeated, ids, mask), mask))
    with vision_encode_counter(model) as grouped_calls:
        grouped, g_grouped = loss_and_grads(model, lambda: (completion_logps_grouped(model, prompts, row_prompt, ids, mask), mask))
    assert grouped.shape == naive.shape == ids.shape
    m = mask.bool()
    torch.testing.assert_close(grouped[m], naive[m], rtol=0, atol=1e-5)
    assert_grads_close(g_naive, g_grouped)
    # The vision tower encodes each unique prompt's images once, vs once per completion naively.
    assert grouped_calls.images == unique_images
    assert naive_calls.images == G * unique_images
    assert grouped_calls.calls == naive_calls.calls == 1
    # A vision-tower gradient really flowed (the equality above is not vacuous).
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision_tower(model).parameters())


def test_grouped_no_grad_scoring_and_chunking(family):
    """Scoring (no_grad) with a small LM-head chunk, rows in any order, prompts used unevenly."""
    name, model, processor = family
    prompts = prompt_batch(processor, FAMILIES[name], seed=1)
    row_prompt = torch.tensor([1, 0, 1, 1])
    ids, mask = completions(processor, [2, 5, 4, 1], seed=1)
    with torch.no_grad(), vision_encode_counter(model) as calls:
        grouped = completion_logps_grouped(model, prompts, row_prompt, ids, mask, 1.3, chunk_tokens=3)
        naive = completion_logps(model, select_rows(prompts, row_prompt), ids, mask, 1.3, chunk_tokens=5)
    torch.testing.assert_close(grouped[mask.bool()], naive[mask.bool()], rtol=0, atol=1e-5)
    assert calls.images == vision_units(model, prompts) + vision_units(model, select_rows(prompts, row_prompt))


def test_grouped_with_text_only_prompt_qwen(tiny_qwen25vl):
    """A prompt without images next to one with two: image features go to the right rows."""
    model = load_model(model_cfg(tiny_qwen25vl)).eval()
    processor = load_processor(tiny_qwen25vl)
    prompts = prompt_batch(processor, [0, 2, 1], seed=2)
    row_prompt = torch.tensor([0, 1, 0, 2, 1])
    ids, mask = completions(processor, [3, 6, 2, 4, 5], seed=2)
    with torch.no_grad(), vision_encode_counter(model) as calls:
        grouped = completion_logps_grouped(model, prompts, row_prompt, ids, mask)
    naive = completion_logps(model, select_rows(prompts, row_prompt), ids, mask).detach()
    torch.testing.assert_close(grouped[mask.bool()], naive[mask.bool()], rtol=0, atol=1e-5)
    assert calls.images == 3


def test_grouped_lora_checkpointing_qwen(tiny_qwen25vl):
    """LoRA (vision included) + activation checkpointing, as train.py builds the policy."""
    model = load_model(model_cfg(tiny_qwen25vl, use_lora=True, lora_vision=True, gradient_checkpointing=True))
    model.train()
    processor = load_processor(tiny_qwen25vl)
    prompts = prompt_batch(processor, [1, 2], seed=3)
    row_prompt = torch.arange(2).repeat_interleave(G)
    ids, mask = completions(processor, LENGTHS, seed=3)
    naive, g_naive = loss_and_grads(model, lambda: (completion_logps(model, select_rows(prompts, row_prompt), ids, mask, 0.7), mask))
    grouped, g_grouped = loss_and_grads(model, lambda: (completion_logps_grouped(model, prompts, row_prompt, ids, mask, 0.7), mask))
    torch.testing.assert_close(grouped[mask.bool()], naive[mask.bool()], rtol=0, atol=1e-5)
    assert_grads_close(g_naive, g_grouped)
    assert any(g is not None and g.abs().sum() > 0 for n, g in g_grouped.items() if "visual" in n and "lora_B" in n)


def test_grouped_falls_back_for_unknown_family(tiny_llava, monkeypatch):
    import vlmrl.models.logprobs as lp

    model = load_model(model_cfg(tiny_llava)).eval()
    processor = load_processor(tiny_llava)
    prompts = prompt_batch(processor, [1, 1], seed=4)
    row_prompt = torch.arange(2).repeat_interleave(G)
    ids, mask = completions(processor, LENGTHS, seed=4)
    monkeypatch.setattr(lp, "grouped_family", lambda m: None)
    with torch.no_grad(), vision_encode_counter(model) as calls:
        fallback = lp.completion_logps_grouped(model, prompts, row_prompt, ids, mask)
        naive = completion_logps(model, select_rows(prompts, row_prompt), ids, mask)
    torch.testing.assert_close(fallback, naive, rtol=0, atol=0)
    assert calls.images == 2 * G * 2  # both calls encode every row's image


def test_grouped_rejects_bad_rows(tiny_llava):
    model = load_model(model_cfg(tiny_llava)).eval()
    processor = load_processor(tiny_llava)
    prompts = prompt_batch(processor, [1, 1])
    ids, mask = completions(processor, [2, 2])
    with pytest.raises(IndexError):
        completion_logps_grouped(model, prompts, torch.tensor([0, 2]), ids, mask)
    with pytest.raises(ValueError):
        completion_logps_grouped(model, prompts, torch.tensor([0]), ids, mask)


# ---------------------------------------------------------------- chunked LM head


def reference_logps(hidden, head, targets, temperature):
    logits = head(hidden).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 3), (0.6, 3), (0.6, 0)])
def test_selective_logps_matches_full_softmax(temperature, chunk):
    """chunk 3 splits 15 tokens unevenly; chunk 0 is the engine switched off (one block)."""
    torch.manual_seed(0)
    n, t, h, v = 3, 5, 16, 40  # 15 tokens: chunks of 3 split rows unevenly
    head = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, t, h, requires_grad=True)
    targets = torch.randint(v, (n, t))
    weights = torch.rand(n, t)  # a non-uniform upstream gradient

    out = selective_logps(hidden, head, targets, temperature, chunk_tokens=chunk)
    (out * weights).sum().backward()
    g_hidden, g_head = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    ref = reference_logps(hidden, head, targets, temperature)
    (ref * weights).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(g_hidden, hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_head, head.weight.grad, rtol=1e-5, atol=1e-6)
    assert out.dtype == torch.float32


def test_selective_logps_no_grad_and_bf16_autocast():
    torch.manual_seed(1)
    n, t, h, v = 2, 7, 32, 64
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.mul_(0.5)
    hidden = torch.randn(n, t, h)
    targets = torch.randint(v, (n, t))
    ref = reference_logps(hidden, head, targets, 0.8)
    with torch.no_grad():
        torch.testing.assert_close(selective_logps(hidden, head, targets, 0.8, chunk_tokens=3), ref, rtol=0, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = selective_logps(hidden.requires_grad_(True), head, targets, 0.8, chunk_tokens=3)
    assert low.dtype == torch.float32  # the softmax is upcast
    torch.testing.assert_close(low.detach(), ref.detach(), rtol=0, atol=1e-2)
    low.sum().backward()  # backward through the recomputed bf16 chunks works
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_group_rows():
    from vlmrl.models.logprobs import group_rows

    unique, row_prompt = group_rows(torch.tensor([5, 2, 5, 5, 2]))
    assert unique.tolist() == [2, 5] and row_prompt.tolist() == [1, 0, 1, 1, 0]
