"""One hand-computed example per device term of the planner (terms), on the hand-made architecture of
tests/test_planner.py: 1,000,000 parameters (vision 200,000, projector 10,000, tied embedding 100,000), hidden 64,
intermediate 128, 4 layers of 4 query / 2 KV heads of 16, vocabulary 1,000; vision 2 blocks of 32 / 64, patch 14,
merge 2, temporal patch 2.

The workload FP32 (float32, no autocast): G 4, 2 prompts per step, micro-batch 4, 20 prompt text tokens, one 56 x 56
image (2 x 2 merge units -> 16 patches -> 4 tokens), 10 completion tokens. So P = 24, C = 10, N = 4, U = 1 (the
micro-batch is one prompt's group), the shared prefix runs (text tokens U P + N C = 64), and one prompt's float32
pixels are 16 patches x 3 channels x 2 frames x 14 x 14 x 4 bytes = 75,264.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_planner import FP32, SPEC

from vlmrl.plan.geometry import micro_batch, unique_prompts
from vlmrl.plan.spec import COMM_BUCKET_BYTES
from vlmrl.plan.terms import (
    TERMS,
    activations_other,
    activations_text,
    activations_vision,
    batch_inputs,
    checkpoint_recompute,
    comm_buffers,
    eager_attention_scores,
    embedding_grad_temporaries,
    full_vocab_logits,
    gathered_for_generation,
    gathered_parameters,
    generation_temporaries,
    gradients,
    head_gradient_temporary,
    kv_cache,
    logprob_buffers,
    logprob_head,
    master_weights,
    model_states,
    naive_row_pixel_copies,
    optimizer_states,
    optimizer_step_temporary,
    pixel_value_copies,
    prefix_backward_activations,
    prefix_held_gradients,
    reference_model,
    reference_moved_in_for_scoring,
    rollout_buffers,
    scoring_temporaries,
    scoring_transient,
    trainable_params,
    weights,
)

P_ = SPEC.total_params
LORA_N = 16 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192)  # r x layers x (in + out) of the 7 adapted Linears = 65,536
PIXELS = 16 * 3 * 2 * 14 * 14 * 4


def _w(**kw):
    return dataclasses.replace(FP32, **kw)


def _mb(w=FP32, fallback=False):
    return micro_batch(SPEC, w, fallback)


def test_the_micro_batch_shape_by_hand():
    mb = _mb()
    assert (mb.patches, mb.vision_tokens, mb.P, mb.C, mb.N, mb.U, mb.prefix, mb.encodes) == (16, 4, 24, 10, 4, 1, True, 1)
    assert mb.text_tokens == 1 * 24 + 4 * 10 and mb.pixel_bytes == PIXELS == 75_264
    assert _mb(_w(gradient_checkpointing=True)).text_tokens == 4 * (24 + 10)  # no shared prefix under checkpointing
    # rows are prompt-major: 4 rows of G 8 are one prompt, 8 of G 4 two; when neither divides the other the bound is
    # ceil(N / G) + 1 (6 rows of G 4 starting at a group's last row span 3 groups), at most N
    assert (unique_prompts(4, 8), unique_prompts(8, 4), unique_prompts(6, 4), unique_prompts(3, 2), unique_prompts(2, 3)) == (1, 2, 3, 3, 2)


def test_weights():
    assert weights(SPEC, FP32) == P_ * 4
    assert weights(SPEC, _w(dtype="bfloat16", sharding="zero3", world_size=4)) == P_ * 2 / 4
    assert weights(SPEC, _w(use_lora=True)) == P_ * 4 + LORA_N * 4  # + the float32 adapters
    assert weights(SPEC, _w(sharding="zero3", world_size=4, offload="optimizer+params")) == 0


def test_gradients():
    assert gradients(SPEC, FP32) == P_ * 4
    assert gradients(SPEC, _w(sharding="zero1", world_size=4)) == P_ * 4  # ZeRO-1 keeps whole gradients
    assert gradients(SPEC, _w(sharding="zero2", world_size=4)) == P_ * 4 / 4
    assert gradients(SPEC, _w(dtype="bfloat16", use_lora=True)) == LORA_N * 4  # adapters are float32
    assert gradients(SPEC, _w(dtype="bfloat16", freeze_vision=True)) == (P_ - 200_000 + 10_000) * 2
    assert gradients(SPEC, _w(projector_only=True)) == 10_000 * 4
    big = dataclasses.replace(SPEC, total_params=10**9)
    assert gradients(big, _w(sharding="zero2", world_size=2, offload="optimizer")) == 4 * COMM_BUCKET_BYTES  # streamed to the host


def test_master_weights():
    assert master_weights(SPEC, FP32) == 0  # torch AdamW on the weights
    assert master_weights(SPEC, _w(dtype="bfloat16", sharding="zero1", world_size=2)) == P_ * 4 / 2  # DeepSpeed's fp32 partitions
    assert master_weights(SPEC, _w(sharding="zero1", world_size=2)) == 0  # float32 weights are their own master copy
    assert master_weights(SPEC, _w(dtype="bfloat16", master_weights="fp32")) == P_ * 4
    assert master_weights(SPEC, _w(dtype="bfloat16", sharding="zero2", world_size=2, offload="optimizer")) == 0  # in host RAM


def test_optimizer_states_and_step_temporary():
    assert optimizer_states(SPEC, FP32) == 2 * P_ * 4  # exp_avg + exp_avg_sq in the parameters' dtype
    assert optimizer_states(SPEC, _w(dtype="bfloat16")) == 2 * P_ * 2
    assert optimizer_states(SPEC, _w(dtype="bfloat16", sharding="zero1", world_size=2)) == P_ * 8 / 2  # float32 moments, sharded
    assert optimizer_states(SPEC, _w(sharding="zero1", world_size=2, offload="optimizer")) == 0
    assert optimizer_step_temporary(SPEC, FP32) == P_ * 4  # foreach sqrt(exp_avg_sq)
    assert optimizer_step_temporary(SPEC, _w(device="cpu")) == 0  # per-tensor AdamW on the CPU
    assert optimizer_step_temporary(SPEC, _w(sharding="zero1", world_size=2, offload="optimizer")) == 0


def test_model_states_keeps_the_offloaded_states_for_the_host():
    st = model_states(SPEC, _w(dtype="bfloat16", sharding="zero2", world_size=2, offload="optimizer"))
    assert (st["trainable"], st["trainable_bytes"], st["scheme"]) == (P_, 2, "fp32")
    assert (st["master"], st["moments"], st["step_temporary"]) == (P_ * 4 / 2, P_ * 8 / 2, 0)
    assert trainable_params(SPEC, _w(use_lora=True)) == (LORA_N, 4)


def test_reference_model():
    kl = _w(beta=0.04)
    assert reference_model(SPEC, kl) == P_ * 4 and reference_moved_in_for_scoring(SPEC, kl) == 0
    assert reference_model(SPEC, _w(beta=0.04, sharding="zero3", world_size=4)) == P_ * 4 / 4
    assert reference_model(SPEC, FP32) == 0  # beta 0: no reference
    assert reference_model(SPEC, _w(beta=0.04, use_lora=True)) == 0  # the base with adapters off
    cpu_ref = _w(beta=0.04, ref_placement="cpu")
    assert reference_model(SPEC, cpu_ref) == 0 and reference_moved_in_for_scoring(SPEC, cpu_ref) == P_ * 4


def test_engine_buffers():
    assert comm_buffers(SPEC, FP32) == 0
    assert comm_buffers(SPEC, _w(sharding="ddp", world_size=2)) == 2 * 25 * 2**20
    z3 = _w(dtype="bfloat16", sharding="zero3", world_size=4)
    # two prefetched layers: (1e6 - 1e5 embedding) / (4 + 2 layers) = 150,000 parameters each, + the embedding
    assert gathered_parameters(SPEC, z3) == 2 * 150_000 * 2 + 100_000 * 2 == 800_000
    assert gathered_parameters(SPEC, _w(sharding="zero2", world_size=4)) == 0
    assert gathered_for_generation(SPEC, z3) == P_ * 2  # generation_gather=full: the whole model once
    assert gathered_for_generation(SPEC, dataclasses.replace(z3, generation_gather="layers")) == 0  # as in the update


def test_inputs_and_rollout_buffers():
    mb = _mb()
    # 8 rows x 34 tokens x 8 bytes (ids, masks) + 8 rows x 10 x float32 log-probs
    assert rollout_buffers(SPEC, FP32, mb) == 8 * 34 * 8 + 8 * 10 * 4 == 2496
    assert rollout_buffers(SPEC, _w(beta=0.04, num_iterations=2), mb) == 8 * 34 * 8 + 8 * 10 * 4 * 3  # + old and reference log-probs
    assert rollout_buffers(SPEC, _w(mode="sft"), mb) == 4 * 10 * 8 * 2
    assert batch_inputs(SPEC, FP32, mb) == 2 * PIXELS + 2496  # one pixel copy per prompt
    naive = _w(profile="naive")
    assert pixel_value_copies(SPEC, naive, _mb(naive)) == 2 * 3 * PIXELS  # G - 1 more per prompt
    assert pixel_value_copies(SPEC, FP32, mb) == 0
    assert naive_row_pixel_copies(SPEC, FP32, mb) == 0
    assert naive_row_pixel_copies(SPEC, FP32, _mb(fallback=True)) == 4 * PIXELS  # each row copies its prompt's pixels


def test_activations_text():
    # text_layer_bytes at c = 4: 2 x (14h + 10 heads x head_dim + 8i) + 4 heads = 2 x (896 + 640 + 1024) + 16 = 5,136
    per_layer = 5136
    prompt_cache = 4 * 4 * 24 * 4 * 2 * (2 + 4) * 16  # layers x N x P x c x (k, v) x (KV heads + repeated) x head_dim
    assert activations_text(SPEC, FP32, _mb()) == 4 * 64 * per_layer + prompt_cache
    flash = _w(attn_implementation="flash_attention_2")  # no k, v repeated to the query heads
    assert activations_text(SPEC, flash, _mb(flash)) == 4 * 64 * (per_layer - 2 * 4 * 2 * 16) + 4 * 4 * 24 * 4 * 2 * 2 * 16
    gc = _w(gradient_checkpointing=True)
    assert activations_text(SPEC, gc, _mb(gc)) == 4 * 136 * 4 * 64  # each layer's input only
    # projector only: the frozen norms' and Linears' inputs (6h + 2 heads x head_dim + 2i at c/2) are not kept
    proj = _w(projector_only=True)
    assert activations_text(SPEC, proj, _mb(proj)) == 4 * 64 * (per_layer - 2 * (6 * 64 + 2 * 64 + 2 * 128))


def test_activations_vision():
    # vision_block_bytes at c = 4: 2 x (30 hv + 8 iv) + 4 heads = 2 x (960 + 512) + 8 = 2,952 per patch
    assert activations_vision(SPEC, FP32, _mb()) == 2 * 16 * 2952
    frozen = _w(freeze_vision=True)
    assert activations_vision(SPEC, frozen, _mb(frozen)) == 0
    gc = _w(gradient_checkpointing=True, freeze_vision=True)
    assert activations_vision(SPEC, gc, _mb(gc)) == 2 * 16 * 4 * 32  # checkpointed blocks keep their inputs even frozen


def test_activations_other():
    assert activations_other(SPEC, FP32, _mb()) == 12 * 64 * 64 * 2 + 8 * 32 * 16 * 2  # 12h per token + 8 hv per patch
    whole = _w(logprob_chunk_tokens=0)  # chunking off: the float32 log-softmax of N x C x V is kept here
    assert activations_other(SPEC, whole, _mb(whole)) == 12 * 64 * 64 * 2 + 8 * 32 * 16 * 2 + 4 * 4 * 10 * 1000
    lora = _w(use_lora=True)
    assert activations_other(SPEC, lora, _mb(lora)) == 12 * 64 * 64 * 2  # the projector does not train


def test_eager_attention_scores():
    eager = _w(attn_implementation="eager")
    mb = _mb(eager)
    # text: calls (1 x 24 x 24) + (4 x 9 x 33) = 1,764 pairs, 60 queries; heads x (pairs x (4 + c) - 4 x queries) per layer
    text = 4 * 4 * (1764 * 8 - 4 * 60)
    # vision: 16 patches, both blocks full attention: 2 heads x (2 x 16^2 x 8 - 4 x 2 x 16) over the 2 blocks
    vision = 2 * (2 * 256 * 8 - 4 * 2 * 16)
    assert eager_attention_scores(SPEC, eager, mb) == text + vision
    assert eager_attention_scores(SPEC, FP32, _mb()) == 0  # sdpa keeps a log-sum-exp (in the layer bytes)
    gc = _w(attn_implementation="eager", gradient_checkpointing=True)
    assert eager_attention_scores(SPEC, gc, _mb(gc)) == 0  # recomputed per layer


def test_logprob_head_terms():
    mb = _mb()  # N x C = 40 completion tokens: one chunk of 40 (chunk size 128)
    head = logprob_head(SPEC, FP32, mb)
    assert head == {"kept": 0, "backward": 12 * 40 * 1000 * 2, "no_grad": 8 * 40 * 1000 * 2, "unit": 40 * 1000 * 4}
    assert logprob_buffers(SPEC, FP32, mb) == 960_000
    assert full_vocab_logits(SPEC, FP32, mb) == 0
    naive = _w(profile="naive")
    assert full_vocab_logits(SPEC, naive, _mb(naive)) == 4 * 4 * 10 * 1000  # a plain trainer keeps the whole float32 log-softmax
    assert head_gradient_temporary(SPEC, FP32, mb) == 0  # one chunk: its gradients come after its logits are freed
    chunked = _w(logprob_chunk_tokens=16)
    assert head_gradient_temporary(SPEC, chunked, _mb(chunked)) == 2 * 1000 * 64 * 4  # fresh + running LM-head gradient
    lora = _w(use_lora=True, logprob_chunk_tokens=16)
    assert head_gradient_temporary(SPEC, lora, _mb(lora)) == 0


def test_embedding_grad_temporaries():
    assert embedding_grad_temporaries(SPEC, FP32) == 3 * 1000 * 64 * 4  # tied: three vocabulary x hidden matrices
    untied = dataclasses.replace(SPEC, lm_head_params=64_000)
    assert embedding_grad_temporaries(untied, FP32) == 2 * 1000 * 64 * 4
    assert embedding_grad_temporaries(SPEC, _w(use_lora=True)) == 0


def test_checkpoint_recompute():
    gc = _w(gradient_checkpointing=True)
    assert checkpoint_recompute(SPEC, gc, _mb(gc)) == pytest.approx(1.35 * 5136 * 136)  # one layer x 1.35
    assert checkpoint_recompute(SPEC, FP32, _mb()) == 0


def test_shared_prefix_terms():
    mb = _mb()
    assert prefix_held_gradients(SPEC, FP32, mb) == (P_ - 200_000 - 100_000) * 4  # the decoder's weights' gradients
    lora = _w(use_lora=True)
    assert prefix_held_gradients(SPEC, lora, _mb(lora)) == LORA_N * 4
    gc = _w(gradient_checkpointing=True)
    assert prefix_held_gradients(SPEC, gc, _mb(gc)) == 0  # no shared prefix
    # the prompt pass's layers (U P = 24 tokens), the tower's and the activations outside the layers
    assert prefix_backward_activations(SPEC, FP32, mb) == 4 * 24 * 5136 + 2 * 16 * 2952 + 12 * 64 * 64 * 2 + 8 * 32 * 16 * 2


def test_scoring_terms():
    mb = _mb()
    assert scoring_temporaries(SPEC, FP32, mb) == 0  # beta 0, one iteration: no scoring pass
    kl = _w(beta=0.04)
    # max(log-prob head without grad 640,000, a layer's 64 tokens x c x (4h + 3i) = 163,840)
    assert scoring_temporaries(SPEC, kl, _mb(kl)) == scoring_transient(SPEC, kl, _mb(kl)) == 640_000


def test_kv_cache_and_generation_temporaries():
    mb = _mb()
    per_token = 2 * 4 * 2 * 16 * 4  # (k, v) x layers x KV heads x head_dim x c
    assert kv_cache(SPEC, FP32, mb) == 8 * 34 * per_token  # 2 prompts x G 4 rows of P + C
    continuous = _w(rollout_engine="continuous", decode_batch_size=4)
    assert kv_cache(SPEC, continuous, _mb(continuous)) == 4 * 34 * per_token  # a cache of 4 slots
    assert kv_cache(SPEC, _w(mode="sft"), mb) == 0
    # max(prefill of 2 prompts: 2 x 24 x c x (4h + 3i) = 122,880, vision 2 x 16 x c x (6 hv + 3 iv) = 49,152,
    #     sampling 8 rows x V x 4 x 3 = 96,000)
    assert generation_temporaries(SPEC, FP32, mb) == 122_880
    assert generation_temporaries(SPEC, _w(mode="sft"), mb) == 0


def test_plan_sums_the_named_terms():
    """plan() reports every TERMS function's value and its phases are the named terms summed."""
    from vlmrl.plan.estimate import plan
    from vlmrl.plan.terms import pixel_inputs

    for w in (FP32, _w(beta=0.04, num_iterations=2), _w(sharding="zero3", world_size=4, dtype="bfloat16"), _w(gradient_checkpointing=True)):
        mb = _mb(w)
        p = plan(SPEC, w)
        t = {name: term(SPEC, w, mb) for name, term in TERMS.items()}
        assert {k: p.terms[k] for k in TERMS} == {k: int(v) for k, v in t.items()}
        persistent = t["weights"] + t["master_weights"] + t["optimizer_states"] + t["reference_model"]
        persistent += pixel_inputs(SPEC, w, mb) + rollout_buffers(SPEC, w, mb) + t["comm_buffers"]
        rollout = persistent + t["kv_cache"] + t["generation_temporaries"] + t["gathered_for_generation"]
        rollout += 0 if t["gathered_for_generation"] else t["gathered_parameters"]
        assert p.phases["rollout"] == int(rollout)
        scored = t["reference_moved_in_for_scoring"] + t["scoring_temporaries"] + t["gathered_parameters"] if w.beta or w.num_iterations > 1 else 0
        assert p.phases["scoring"] == int(persistent + scored)
        assert p.terms["allocator_reserve"] == p.reserved - p.peak_allocated
