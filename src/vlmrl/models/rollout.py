"""Rollout: sample G completions per prompt with Hugging Face generate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vlmrl.models.logprobs import model_inputs
from vlmrl.models.continuous import engine_supported, sample_continuous
from vlmrl.models.prefix import prefix_supported, row_seed, sample_with_shared_prefix
from vlmrl.families import family_of
from vlmrl.models.processing import select_rows


@dataclass
class Completions:
    """ids, mask: [B*G, T] right-padded; completions of prompt b at rows b*G .. b*G+G-1.
    truncated: [B*G] bool, True where no EOS came within max_new_tokens.
    sampling_logps: [B*G, T] float32 log_softmax(logits / temperature) of each token at the decode step that chose
    it (0 outside the mask), or None where the decode path does not report it (HF generate)."""

    ids: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor
    sampling_logps: torch.Tensor | None = None
    # Multi-turn rollouts (tools.tools, models/multiturn.py): mask = every real token (model and tool turns, what
    # scoring attends to), loss_mask = the model's own tokens; per row the tool images' vision tensors and the
    # trajectory (TRL conversational shape) with its end reason. None for single-turn rollouts.
    loss_mask: torch.Tensor | None = None
    tool_vision: list | None = None
    trajectories: list | None = None

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)

    def take_rows(self, rows: list[int]) -> Completions:
        """Rows of a single-turn rollout's completions."""
        logps = self.sampling_logps
        return Completions(self.ids[rows], self.mask[rows], self.truncated[rows], None if logps is None else logps[rows])


def completion_mask(ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] ids -> (mask [N, T] with 1 up to and including the first EOS, truncated [N] bool)."""
    is_eos = torch.isin(ids, torch.tensor(eos_ids, device=ids.device))
    seen_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()  # EOS count strictly before each position
    mask = (seen_before == 0).long()
    return mask, ~is_eos.any(dim=1)


def eos_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model has no eos_token_id and neither has its tokenizer; generation could never stop")
    return ids


def vision_token_ids(model: torch.nn.Module) -> list[int]:
    """Placeholder ids (image/video pad, vision start/end) that a completion must never contain: the
    model would read them as slots for image features when the completion is scored."""
    cfg = model.config
    ids = set()
    for name in ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id"):
        for holder in (cfg, getattr(cfg, "text_config", None)):
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    return sorted(ids)


def cat_right_padded(pieces: list[torch.Tensor], value) -> torch.Tensor:
    """[n_i, T_i] pieces -> [sum n_i, max T_i], each right-padded with `value`."""
    width = max(p.shape[1] for p in pieces)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in pieces])


def cat_completions(pieces: list[Completions], pad_id: int) -> Completions:
    """Per-prompt rollouts concatenated into one, ids right-padded with pad_id (masks with 0)."""
    if len(pieces) == 1:
        return pieces[0]
    logps = [p.sampling_logps for p in pieces]
    return Completions(
        ids=cat_right_padded([p.ids for p in pieces], pad_id),
        mask=cat_right_padded([p.mask for p in pieces], 0),
        truncated=torch.cat([p.truncated for p in pieces]),
        sampling_logps=None if any(lp is None for lp in logps) else cat_right_padded(logps, 0.0),
    )


def row_streams(rollout_cfg) -> bool:
    """True when rollout.engine samples every row from its own stream (continuous): the caller passes one seed per
    prompt (generate's prompt_seeds) and needs no per-prompt generate calls for rollout.sampling_seed=prompt."""
    return rollout_cfg.engine == "continuous"


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer,
    prompt_batch: dict,
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    prompts_per_call: int | None = None,
    min_new_tokens: int = 0,
    shared_prefix: bool = True,
    engine: str = "loop",
    decode_batch_size: int = 0,
    prompt_seeds: list[int] | None = None,
    decode_step: str = "dynamic",
    decode_agreement: Callable[[bool], bool] | None = None,
) -> Completions:
    """Sample `num_generations` completions for each prompt row of `prompt_batch` ([B, P]).

    prompts_per_call bounds how many prompts go through one generate() call (the generation batch),
    independently of the training micro-batch. shared_prefix prefills each prompt once and shares its
    KV cache across its G samples (`prefix.sample_with_shared_prefix`); otherwise HF generate with
    num_return_sequences (prompt and images processed G times). engine="continuous" (with shared_prefix, on a
    family with a fast path) decodes with `continuous.sample_continuous`: at most decode_batch_size rows (0: all;
    also at most prompts_per_call x G) in flight, finished rows replaced by queued prompts' rows; decode_step (the
    engine's step: dynamic, static or cuda_graph, `static_decode`).
    prompt_seeds: [B] seeds of per-row sampling streams (row g of prompt b: `continuous.row_seed`), so a row's
    tokens do not depend on the batch it is decoded in; the continuous decoder draws them from the global
    stream when not given. Returns [B*G, T] completions grouped by prompt.
    decode_agreement: None (each process decodes alone), or how the processes that decode in step agree to take
    another step (distributed.Engine.decode_agreement: every forward holds collectives); HF generate gets
    synced_gpus then, and the continuous decoder is not used.
    """

    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    n_prompts = prompt_batch["input_ids"].shape[0]
    step = prompts_per_call or n_prompts
    sampling = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k, min_new_tokens=min_new_tokens)
    fixed = dict(num_generations=num_generations, max_new_tokens=max_new_tokens, eos_ids=eos, pad_id=pad, suppress_ids=vision_token_ids(model))

    # The continuous decoder's decode steps depend on this process's rows only: not used when processes decode in step.
    continuous = engine == "continuous" and decode_agreement is None
    if continuous and shared_prefix and prefix_supported(model, prompt_batch) and _engine_supported(model):
        if do_sample and prompt_seeds is None:
            prompt_seeds = torch.randint(0, 2**62, (n_prompts,)).tolist()
        rows = num_generations if do_sample else 1
        batch = min(decode_batch_size or n_prompts * rows, step * rows)
        ids, logps = sample_continuous(
            model, prompt_batch, decode_batch_size=batch, prompt_seeds=prompt_seeds, decode_step=decode_step, return_logps=True, **fixed, **sampling
        )
        return _finish(ids, eos, pad, logps)
    pieces = [
        _generate_chunk(
            model, prompt_batch, range(start, min(start + step, n_prompts)), shared_prefix, prompt_seeds, fixed, sampling, decode_agreement
        )
        for start in range(0, n_prompts, step)
    ]
    logps = None if any(lp is None for _, lp in pieces) else cat_right_padded([lp for _, lp in pieces], 0.0)
    return _finish(cat_right_padded([ids for ids, _ in pieces], pad), eos, pad, logps)


def _finish(ids: torch.Tensor, eos: list[int], pad: int, logps: torch.Tensor | None = None) -> Completions:
    mask, truncated = completion_mask(ids, eos)
    if logps is not None:
        logps = logps[:, : ids.shape[1]].masked_fill(mask == 0, 0.0)
    return Completions(ids=ids.masked_fill(mask == 0, pad), mask=mask, truncated=truncated, sampling_logps=logps)


def _generate_chunk(model, prompt_batch: dict, rows: range, shared_prefix: bool, prompt_seeds, fixed: dict, sampling: dict, agreement=None):
    """(completion ids [len(rows)*G, T], the sampler's log-probs [len(rows)*G, T] or None) of prompts `rows` by the
    loop (shared prefix) or by HF generate (no log-probs)."""

    n_prompts = prompt_batch["input_ids"].shape[0]
    chunk = select_rows(prompt_batch, list(rows)) if len(rows) < n_prompts else prompt_batch
    if shared_prefix and prefix_supported(model, chunk):
        row_seeds = None
        if prompt_seeds is not None and sampling["do_sample"]:
            row_seeds = [row_seed(prompt_seeds[p], g) for p in rows for g in range(fixed["num_generations"])]
        return sample_with_shared_prefix(model, chunk, **fixed, **sampling, row_seeds=row_seeds, return_logps=True, decode_agreement=agreement)
    do_sample = sampling["do_sample"]
    samples = fixed["num_generations"] if do_sample else 1
    if samples > 1 and family_of(getattr(model.config, "model_type", None)).repeat_rows_for_generate:
        # Each prompt row repeated G times in place, as num_return_sequences orders them (its image features would not be).
        chunk, samples = select_rows(chunk, [r for r in range(len(rows)) for _ in range(samples)]), 1
    chunk = model_inputs(chunk)
    out = model.generate(
        **chunk,
        do_sample=do_sample,
        num_return_sequences=samples,
        max_new_tokens=fixed["max_new_tokens"],
        temperature=sampling["temperature"] if do_sample else None,
        top_p=sampling["top_p"] if do_sample else None,
        top_k=(sampling["top_k"] or None) if do_sample else None,
        eos_token_id=fixed["eos_ids"],
        pad_token_id=fixed["pad_id"],
        suppress_tokens=fixed["suppress_ids"] or None,
        min_new_tokens=sampling["min_new_tokens"] or None,
        synced_gpus=agreement is not None or None,  # HF's own "decode until every process is done"
    )
    return out[:, chunk["input_ids"].shape[1] :], None


def _engine_supported(model) -> bool:

    return engine_supported(model)
