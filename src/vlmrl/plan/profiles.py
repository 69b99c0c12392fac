"""Trainer profiles of the memory planner: how another trainer's step differs from vlmrl's, as closed-form terms.

`vlmrl plan --profile naive` asks "does my TRL-style config fit, and which vlmrl config does". A profile changes
what one step allocates for the same model and the same work (prompts, G, pixels, completion length, batch):

  vlmrl  (default) what vlmrl runs: each image encoded once per prompt (memory.group_vision), the prompt run once
         per group and its KV cache shared by the G completions (memory.shared_prefix), log-probs projected in
         chunks of memory.logprob_chunk_tokens completion tokens and recomputed in backward.
  naive  a plain trainer (TRL's GRPOTrainer up to 0.2x and the R1-V / VLM-R1 forks of it): every prompt and image
         repeated G times (the sampler repeats each row), so the vision tower encodes each image G times and the
         pixel values are held G times; HF `generate` prefills the G copies (KV cache for prompts x G rows of
         prompt + completion); full-vocabulary logits [rows, C, V] upcast to float32 for
         the log-softmax, kept for backward; the reference model scored the same way.
  trl    the naive data path with TRL 1.x's fused LM head (`trl.trainer.utils.add_fused_lm_head`): log-probs in
         tiles of at most 4,096 tokens x 32,768 vocabulary entries, never the whole logits. With Triton (CUDA) only
         completion positions are projected and a tile is folded in place; elsewhere (CPU) every position of the
         padded prompt + completion rows is projected and the tile is folded with torch ops (float32 temporaries).

The coefficients of the log-prob heads were read off traces of the operations themselves (plan_trace.MemoryTracker
on `x @ W.T -> float -> log_softmax -> gather -> backward`, and on TRL 1.16's `ChunkedLogProbFunction`), see
docs/planner.md "Trainer profiles". Pure functions; nothing here imports torch.
"""

from __future__ import annotations

import dataclasses

PROFILES = ("vlmrl", "naive", "trl")
LOGITS_POSITIONS = ("completion", "sequence")

# TRL 1.x fused LM head (trl/kernels/chunked_logprob.py, trl/trainer/utils.py): tile = TOKENS x VOCAB entries.
TRL_TILE_TOKENS = 4096
TRL_TILE_VOCAB = 32768
# Bytes per tile entry beyond the tile itself (in the compute dtype), torch fallback (no Triton): forward fold
# (float32 logits, exp, exp x logits: 3 float32 tiles) and backward (the recomputed float32 logits, log p, p, the
# gradient, the target mask and its float copy and two products: ~29 bytes). Traced on CPU tensors, fp32 and bf16.
TRL_FOLD_BYTES = 12
TRL_BACKWARD_BYTES = 29
# CPU runtime of a TRL trainer process (python, torch, transformers, trl, datasets, accelerate's Trainer, the model
# family's code, tokenizer and processor): the peak RSS of a near-empty TRL 1.16 GRPO run (config t of
# `benchmarks/planner_accuracy.py trl`, tensors 0.02 GiB) less its planned tensors. vlmrl's own is planner.HOST_RUNTIME_CPU_BYTES.
TRAINER_CPU_RUNTIME_BYTES = int(0.56 * 2**30)


def profile_workload(w):
    """The workload a profile runs: naive and trl repeat every prompt G times (no grouped vision, no shared
    prefix) and use no vlmrl log-prob chunks. vlmrl's is returned unchanged."""
    if w.profile == "vlmrl":
        return w
    return dataclasses.replace(w, group_vision=False, shared_prefix=False, logprob_chunk_tokens=0)


def full_logits_bytes(rows: int, completion: int, vocab: int, cbytes: int, sequence_positions: int = 0) -> dict:
    """A plain trainer's log-prob head over E = rows x completion x vocab logits (bytes).

    kept: the float32 log-softmax output, saved for backward (4 E). backward: beside it, the gradient of the
    log-softmax output and of its input, both float32 (8 E; the cast back to the compute dtype comes after the
    first is freed). no_grad (reference / old log-probs): the logits in the compute dtype, a float32 (or scaled)
    copy and the log-softmax (c + 8) E. Traced: 12.0 E at the backward peak in fp32 and bf16.
    sequence_positions > 0 (trainers that call a VLM without logits_to_keep, e.g. the early-2025 VLM GRPO forks):
    the LM head first projects every position, rows x sequence_positions x vocab in the compute dtype, and the
    completion slice is taken from it; that tensor is alive while the slice's copies are made (forward and no_grad)."""
    e = rows * completion * vocab
    whole = rows * sequence_positions * vocab * cbytes
    forward = whole + (cbytes + 8) * e if sequence_positions else 0
    unit = rows * completion * vocab * cbytes  # the logits slice; every other head tensor is as large or larger
    return {"kept": 4 * e, "backward": max(8 * e, forward - 4 * e), "no_grad": (cbytes + 8) * e + whole, "unit": unit}


def fused_tile_bytes(tokens: int, vocab: int, hidden: int, cbytes: int, triton: bool, head_trains: bool) -> dict:
    """TRL 1.x's fused LM head over `tokens` projected positions (bytes): one tile of min(tokens, 4096) x
    min(vocab, 32768) entries in the compute dtype is reused for every tile; nothing vocabulary-sized is kept.
    With Triton the tile is folded in place; without, the torch fold adds float32 temporaries per entry.
    Backward adds the float32 gradient accumulators of the hidden states (tokens x hidden) and, when the LM head
    trains, of its weight (vocab x hidden)."""
    tile = min(tokens, TRL_TILE_TOKENS) * min(vocab, TRL_TILE_VOCAB)
    fold = 0 if triton else TRL_FOLD_BYTES
    bwd = 0 if triton else TRL_BACKWARD_BYTES
    accumulators = 4 * tokens * hidden + (4 * vocab * hidden if head_trains else 0)
    return {"kept": 0, "backward": tile * (cbytes + bwd) + accumulators, "no_grad": tile * (cbytes + fold), "unit": tile * cbytes}


def logprob_head_bytes(w, rows: int, prompt: int, completion: int, vocab: int, hidden: int, cbytes: int, head_trains: bool) -> dict:
    """{kept, backward, no_grad} of the profile's log-prob head for `rows` rows of prompt + completion tokens.
    vlmrl's own (chunked) head stays in planner.plan; this is the naive and trl heads."""
    if w.profile == "naive":
        sequence = prompt + completion - 1 if w.logits_positions == "sequence" else 0
        return full_logits_bytes(rows, completion, vocab, cbytes, sequence)
    triton = w.device != "cpu"  # TRL projects only completion positions where Triton runs (CUDA / XPU)
    tokens = rows * completion if triton else rows * (prompt + completion - 1)
    return fused_tile_bytes(tokens, vocab, hidden, cbytes, triton, head_trains)


def pixel_copies_bytes(w, pixel_bytes_per_prompt: float) -> float:
    """Pixel values a plain trainer holds beyond vlmrl's one copy per prompt: (G - 1) more per prompt."""
    if w.profile == "vlmrl":
        return 0
    return w.prompts_per_step * (w.num_generations - 1) * pixel_bytes_per_prompt
