"""Shared prompt prefix: prefill once per group, share the KV cache (rollout, scoring, training)."""

import pytest
import torch

from test_logprobs import FAMILIES, G, LENGTHS, LOOSE_GRADS, assert_grads_close, completions, loss_and_grads, model_cfg, prompt_batch, vision_units

from vlmrl.models.logprobs import completion_logps, vision_encode_counter
from vlmrl.models.loading import load_model, vision_tower
from vlmrl.models.prefix import LogprobOptions, completion_logps_for, completion_logps_prefix, prefix_supported, sample_with_shared_prefix
from vlmrl.models.processing import load_processor, select_rows
from vlmrl.models.rollout import eos_token_ids, generate, vision_token_ids


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    path = request.getfixturevalue(request.param)
    model = load_model(model_cfg(path)).eval()
    processor = load_processor(path)
    return request.param, model, processor


class decoder_token_counter:  # noqa: N801 - a context manager
    """Token positions that go through the first decoder layer: .first = the first call (the prefill)."""

    def __init__(self, model):
        from vlmrl.models.loading import unwrap

        self.layer = unwrap(model).model.language_model.layers[0]
        self.first, self.total = None, 0

    def _hook(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        n = hidden.shape[0] * hidden.shape[1]
        self.first = n if self.first is None else self.first
        self.total += n

    def __enter__(self):
        self._handle = self.layer.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def _hf_generate(model, processor, prompts, n, **kw):
    return generate(model, processor.tokenizer, prompts, num_generations=n, max_new_tokens=12, shared_prefix=False, **kw)


def _prefix_generate(model, processor, prompts, n, **kw):
    return generate(model, processor.tokenizer, prompts, num_generations=n, max_new_tokens=12, shared_prefix=True, **kw)


def test_greedy_rollout_equals_hf_generate(family):
    name, model, processor = family
    prompts = prompt_batch(processor, FAMILIES[name], seed=5)
    hf = _hf_generate(model, processor, prompts, 1, do_sample=False)
    ours = _prefix_generate(model, processor, prompts, 1, do_sample=False)
    assert torch.equal(ours.ids, hf.ids) and torch.equal(ours.mask, hf.mask)
    assert ours.ids.shape[1] > 1


def test_sampled_rollout_prefills_once_and_stays_valid(family):
    """HF generate runs the decoder over G copies of every prompt; the shared prefix over one copy, and
    encodes each prompt's images once (transformers 5 generate also encodes them once; 4.x did G times).
    Sampling is seeded: the same seed gives the same completions."""
    name, model, processor = family
    prompts = prompt_batch(processor, FAMILIES[name], seed=6)
    kw = dict(temperature=0.9, top_k=50, top_p=0.95)
    with decoder_token_counter(model) as hf_tokens:
        hf = _hf_generate(model, processor, prompts, G, **kw)
    torch.manual_seed(3)
    with vision_encode_counter(model) as our_calls, decoder_token_counter(model) as our_tokens:
        ours = _prefix_generate(model, processor, prompts, G, **kw)
    torch.manual_seed(3)
    again = _prefix_generate(model, processor, prompts, G, **kw)
    assert torch.equal(ours.ids, again.ids)
    assert our_calls.images == vision_units(model, prompts) and our_calls.calls == 1
    n_prompts, prompt_len = prompts["input_ids"].shape
    assert hf_tokens.first == G * n_prompts * prompt_len  # prefill of G copies
    assert our_tokens.first == n_prompts * prompt_len  # prefill of one copy
    assert ours.ids.shape[0] == hf.ids.shape[0] == G * n_prompts
    assert not torch.isin(ours.ids, torch.tensor(vision_token_ids(model))).any()
    assert len({tuple(r) for r in ours.ids.tolist()}) > 1  # really sampled


def test_sample_rows_draws_from_softmax():
    """Inverse-CDF sampling against the exact distribution: 40,000 draws per row, every frequency within
    5 standard errors; banned (-inf) tokens never drawn."""
    from vlmrl.models.prefix import sample_rows

    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 3.0], [0.0, 0.0, 0.0, 0.0, 0.0, float("-inf")]])
    n = 40_000
    draws = torch.stack([sample_rows(logits) for _ in range(n)], dim=1)  # [2, n]
    for row in range(2):
        p = torch.softmax(logits[row].double(), dim=0)
        freq = torch.bincount(draws[row], minlength=6).double() / n
        se = (p * (1 - p) / n).sqrt()
        assert ((freq - p).abs() <= 5 * se + 1e-12).all(), (freq, p)
        assert freq[p == 0].sum() == 0


def test_min_new_tokens_blocks_eos_and_suppress_ids_never_sampled(tiny_qwen25vl):
    from vlmrl.models.loading import unwrap

    model = load_model(model_cfg(tiny_qwen25vl)).eval()
    processor = load_processor(tiny_qwen25vl)
    prompts = prompt_batch(processor, [1, 1], seed=7)
    eos, banned = eos_token_ids(model, processor.tokenizer), vision_token_ids(model)
    # An LM head that all but forces EOS (+50) and vision placeholders (+60): only the bans keep them out.
    core = unwrap(model)
    head = torch.nn.Linear(core.lm_head.in_features, core.lm_head.out_features, bias=True)
    head.weight = core.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[eos] = 50.0
        head.bias[banned] = 60.0
    core.lm_head = head
    kw = dict(num_generations=4, max_new_tokens=6, eos_ids=eos, pad_id=processor.tokenizer.pad_token_id, suppress_ids=banned)
    ids = sample_with_shared_prefix(model, prompts, min_new_tokens=6, **kw)
    assert ids.shape == (8, 6)
    assert not torch.isin(ids, torch.tensor(eos + banned)).any()
    free = sample_with_shared_prefix(model, prompts, **kw)
    assert free.shape == (8, 1) and torch.isin(free, torch.tensor(eos)).all()  # without the length ban: EOS at once


def test_prefix_logps_equal_naive_values_and_grads(family):
    name, model, processor = family
    per_prompt = FAMILIES[name]
    prompts = prompt_batch(processor, per_prompt)
    row_prompt = torch.arange(len(per_prompt)).repeat_interleave(G)
    ids, mask = completions(processor, LENGTHS)
    naive, g_naive = loss_and_grads(model, lambda: (completion_logps(model, select_rows(prompts, row_prompt), ids, mask, 0.8), mask))
    with vision_encode_counter(model) as calls:
        ours, g_ours = loss_and_grads(model, lambda: (completion_logps_prefix(model, prompts, row_prompt, ids, mask, 0.8, chunk_tokens=4), mask))
    m = mask.bool()
    torch.testing.assert_close(ours[m], naive[m], rtol=0, atol=1e-5)
    assert_grads_close(g_naive, g_ours, loose=LOOSE_GRADS if name.startswith("tiny_qwen35") else None)
    assert calls.images == vision_units(model, prompts)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision_tower(model).parameters())


def test_prefix_logps_uneven_rows_and_single_token(family):
    """Rows in any order, prompts used unevenly, and completions of one token (no continuation pass)."""
    name, model, processor = family
    prompts = prompt_batch(processor, FAMILIES[name], seed=1)
    for row_prompt, lengths in ((torch.tensor([1, 0, 1, 1]), [2, 5, 4, 1]), (torch.tensor([1, 0]), [1, 1])):
        ids, mask = completions(processor, lengths, seed=1)
        with torch.no_grad():
            ours = completion_logps_prefix(model, prompts, row_prompt, ids, mask)
            naive = completion_logps(model, select_rows(prompts, row_prompt), ids, mask)
        torch.testing.assert_close(ours[mask.bool()], naive[mask.bool()], rtol=0, atol=1e-5)


def test_prefix_not_used_under_gradient_checkpointing(tiny_qwen25vl):
    model = load_model(model_cfg(tiny_qwen25vl, gradient_checkpointing=True))
    processor = load_processor(tiny_qwen25vl)
    prompts = prompt_batch(processor, [1])
    model.train()
    assert not prefix_supported(model, prompts, needs_grad=True)
    assert prefix_supported(model, prompts, needs_grad=False)
    model.eval()
    assert prefix_supported(model, prompts, needs_grad=True)


def test_dispatch_paths_agree_and_encode_as_documented(tiny_qwen25vl):
    """completion_logps_for: shared prefix, grouped and naive (group_vision off) give the same values;
    vision work is once per prompt for the first two and once per row for the naive one."""
    model = load_model(model_cfg(tiny_qwen25vl)).eval()
    processor = load_processor(tiny_qwen25vl)
    prompts = prompt_batch(processor, [1, 2], seed=8)
    row_prompt = torch.arange(2).repeat_interleave(G)
    ids, mask = completions(processor, LENGTHS, seed=8)
    out, images = {}, {}
    for name, flags in {"prefix": (True, True), "grouped": (False, True), "naive": (False, False)}.items():
        with torch.no_grad(), vision_encode_counter(model) as calls:
            out[name] = completion_logps_for(model, prompts, row_prompt, ids, mask, LogprobOptions(1.0, 0, *flags))
        images[name] = calls.images
    m = mask.bool()
    torch.testing.assert_close(out["prefix"][m], out["naive"][m], rtol=0, atol=1e-5)
    torch.testing.assert_close(out["grouped"][m], out["naive"][m], rtol=0, atol=1e-5)
    assert images == {"prefix": 3, "grouped": 3, "naive": 3 * G}
