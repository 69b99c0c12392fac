"""Continuous-batching rollout decoder (rollout.engine=continuous): the decode batch stays full.

`prefix.sample_with_shared_prefix` (rollout.engine=loop) decodes all U*G rows of a call together until the
longest one ends: a row that stops after 20 tokens of 256 keeps paying its share of every forward, LM head
and vocabulary-wide sampling for the remaining 236. This engine keeps at most `decode_batch_size` rows in
flight; a row that emits EOS leaves at once and a waiting row takes its slot. The next queued prompts are
prefilled together (once: each image encoded once) when slots are free, and their G rows each join as soon as a
slot is (the prefill is kept until the group's last row has joined).

- KV cache: `SlotCache`, per layer one preallocated [S, kv_heads, P + max_new_tokens, head_dim] tensor
  (S = decode batch size, P = the padded prompt width). A token's K/V is written in place at its row's
  column; decode never concatenates or reallocates. Active rows sit in slots 0..n-1: when rows leave, the
  last active rows move into the holes (one row of KV per move), so every step works on views.
  A prompt's prefix K/V is copied into each of its G slots once at join, then never touched again. It is not
  referenced: SDPA wants each row's keys as one dense [kv, L, d] slice, so a shared block would need a gather per
  step (a copy every token) or a two-part attention (prefix per prompt + completion per row, merged by
  log-sum-exp), or a paged-attention kernel with block tables (GPU).
- Sampling: one stream per row, seeded from (the prompt's seed, generation index), one float64 uniform per
  token fed to `prefix.sample_rows` (inverse CDF). A row's tokens therefore do not depend on which rows
  share its batch, on the decode batch size or on the arrival order; greedy rows take the argmax.
- Positions: each row carries its own step t; Qwen M-RoPE rows sit at the prompt's next position + t on
  all three axes, the others at P + t (what the loop and HF generate use for a left-padded batch).
- Sliding-window layers (Gemma 3): the prefill cache keeps only the window's last columns; they are copied to the
  prompt's last columns, and those layers get their own mask (columns within the window of the row's column).
- Linear-attention layers (Qwen3.5's Gated DeltaNet): each slot holds the layer's conv and recurrent state (copied
  from the prefill at join, moved with the row), which the layer's own single-token step reads and updates.
- Static decode step (rollout.decode_step=static / cuda_graph): the step runs on a fixed batch bucket (the smallest
  power of two >= n, at most S) over every cache column (P + max_new_tokens), so a bucket's step always has the same
  shapes; padding rows sit in free slots, see only their own column and are dropped. cuda_graph captures one CUDA
  graph per bucket (text decoder + LM head, static input buffers) and replays it: one launch per step instead of
  hundreds of kernel launches. The static step without capture is equality-tested on CPU against the dynamic one.
- The text decoder is the model's own (`language_model` forward with a 4D mask and this cache), so the
  arithmetic per row is the model's; the logits of a row equal the loop's up to the batch-size dependence
  of the CPU / GPU matmul kernels (bitwise equal in the tests; a flip needs a near tie).
"""

from __future__ import annotations

import torch

from vlmrl.families import model_types
from vlmrl.models.loading import unwrap
from vlmrl.models.prefix import (
    sampling_warpers,
    SamplingWorkspace,
    prefill_prompts,
    chosen_logps,
    draw_uniforms,
    mrope_positions,
    prefix_positions,
    row_seed,
    sample_rows,
    uses_mrope,
)
from vlmrl.models.processing import select_rows
from vlmrl.models.static_decode import StaticStep
import logging

# Model types whose decode step this engine reproduces exactly (equivalence-tested: tests/test_continuous.py); any
# other model type uses the loop, with a logged reason.
ENGINE_MODEL_TYPES = model_types("continuous")
_fallback_logged: set[str] = set()


def engine_supported(model) -> bool:
    """True when rollout.engine=continuous can decode this model; otherwise log once why the loop is used."""

    model_type = getattr(unwrap(model).config, "model_type", None)
    if model_type in ENGINE_MODEL_TYPES:
        return True
    if model_type not in _fallback_logged:
        _fallback_logged.add(model_type)
        logging.getLogger("vlmrl").warning(
            "model_type %s: rollout.engine=continuous is not equivalence-tested for it; using the loop (same per-row streams)", model_type
        )
    return False


class SlotCache:
    """Preallocated per-layer K/V for S decode slots of `columns` positions each; rows 0..n-1 active.

    The model's attention layers call `update(k, v, layer_idx)` with the new token's k, v [n, kv, 1, d]; it is
    written at column `write_col[slot]` and views [n, kv, length, d] of the whole cache come back (columns past
    a row's own length are masked by the caller's 4D mask)."""

    def __init__(self, num_layers: int, slots: int, columns: int):
        self.num_layers, self.slots, self.columns = num_layers, slots, columns
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        # Linear-attention layers (Qwen3.5's Gated DeltaNet): per slot a conv state [C, K] and a recurrent state.
        self.conv: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent: list[torch.Tensor | None] = [None] * num_layers
        self.n = 0  # active rows, in slots 0..n-1
        self.step_rows = 0  # rows of this step's forward: n, or the bucket of a static step (padding rows in free slots)
        self.length = 0  # columns visible this step
        self.write_col: torch.Tensor | None = None  # [n] column of this step's token

    def allocate_like(self, prefill_cache) -> None:
        """Storage in the prefill's dtypes (under bf16 autocast keys leave RoPE in float32, values stay bf16)."""
        if self.keys:
            return
        for layer in prefill_cache.layers:
            if _is_linear(layer):
                conv, rec = layer.conv_states[0], layer.recurrent_states[0]
                self.keys.append(None)
                self.values.append(None)
                self.conv[len(self.keys) - 1] = conv.new_zeros((self.slots, *conv.shape[1:]))
                self.recurrent[len(self.keys) - 1] = rec.new_zeros((self.slots, *rec.shape[1:]))
                continue
            k, v = layer.keys, layer.values
            shape = (self.slots, k.shape[1], self.columns, k.shape[3])
            self.keys.append(torch.zeros(shape, dtype=k.dtype, device=k.device))
            self.values.append(torch.zeros(shape[:3] + v.shape[3:], dtype=v.dtype, device=v.device))

    def write_prefix(self, slots: torch.Tensor, prefill_cache, rows: torch.Tensor, prompt_width: int) -> None:
        """Copy prefix K/V rows `rows` of an HF prefill cache ([k, kv, L, d] per layer) into `slots`, at the prompt's
        last L columns: L = P, or fewer for a sliding-window layer (Gemma 3), whose cache keeps only its window.
        A linear-attention layer's conv and recurrent states are copied whole."""
        self.allocate_like(prefill_cache)
        for i, layer in enumerate(prefill_cache.layers):
            if _is_linear(layer):
                self.conv[i][slots] = layer.conv_states[0].index_select(0, rows)
                self.recurrent[i][slots] = layer.recurrent_states[0].index_select(0, rows)
                continue
            width = layer.keys.shape[2]
            start = prompt_width - width
            self.keys[i][slots, :, start:prompt_width] = layer.keys.index_select(0, rows)
            self.values[i][slots, :, start:prompt_width] = layer.values.index_select(0, rows)

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for store in (*self.keys, *self.values, *self.conv, *self.recurrent):
            if store is not None:
                store[dst] = store[src]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        n = key_states.shape[0]
        slots = torch.arange(n, device=key_states.device)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[slots, :, self.write_col] = key_states[:, :, 0].to(keys.dtype)
        values[slots, :, self.write_col] = value_states[:, :, 0].to(values.dtype)
        return keys[:n, :, : self.length], values[:n, :, : self.length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # The linear-attention layer's decode step: it updates the conv state in place and hands back the recurrent one.
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv[layer_idx][: self.step_rows]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.recurrent[layer_idx][: self.step_rows]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent[layer_idx][: self.step_rows] = recurrent_states
        return recurrent_states

    def is_recording_past(self, layer_idx: int) -> bool:
        return False


def _is_linear(layer) -> bool:
    return hasattr(layer, "recurrent_states") and not hasattr(layer, "keys")


class _Rows:
    """Per-slot bookkeeping of the active rows (host tensors; slot i = row i of every field)."""

    def __init__(self, slots: int, columns: int, device):
        self.row = torch.zeros(slots, dtype=torch.long)  # output row (prompt u, generation g -> u*G + g)
        self.t = torch.zeros(slots, dtype=torch.long)  # tokens generated so far
        self.next_pos = torch.zeros(slots, dtype=torch.long)  # position of the row's first generated token
        # Multi-turn rows (multiturn.py): M-RoPE positions past a tool turn's images run ahead of next_pos + t by delta;
        # turn_start is t at the start of the row's current assistant turn. Both stay 0 for single-turn rows.
        self.delta = torch.zeros(slots, dtype=torch.long)
        self.turn_start = torch.zeros(slots, dtype=torch.long)
        self.valid = torch.zeros(slots, columns, dtype=torch.bool, device=device)  # KV columns the row attends to
        self.gens: list[torch.Generator | None] = [None] * slots

    def move(self, dst: list[int], src: list[int]) -> None:
        d, s = torch.tensor(dst), torch.tensor(src)
        for field in (self.row, self.t, self.next_pos, self.delta, self.turn_start):
            field[d] = field[s]
        self.valid[d.to(self.valid.device)] = self.valid[s.to(self.valid.device)]
        for a, b in zip(dst, src):
            self.gens[a] = self.gens[b]


class ContinuousDecoder:
    """One rollout call: queue of prompts, S decode slots, `run()` -> ids [U*G, T]."""

    def __init__(
        self, model, prompt_batch: dict, *, num_generations, max_new_tokens, decode_batch_size, sampler, prompt_order=None, decode_step="dynamic"
    ):
        core = unwrap(model)
        self.model, self.core = model, core
        self.text_model = core.model.language_model
        self.head = core.get_output_embeddings()
        self.qwen = uses_mrope(model)
        self.batch, self.G, self.T = prompt_batch, num_generations, max_new_tokens
        self.sampler = sampler
        n_prompts, self.P = prompt_batch["input_ids"].shape
        self.S = min(decode_batch_size, n_prompts * num_generations)
        self.device = prompt_batch["input_ids"].device
        self.queue = list(prompt_order) if prompt_order is not None else list(range(n_prompts))
        self.cache = SlotCache(len(self.text_model.layers), self.S, self.P + max_new_tokens)
        self.rows = _Rows(self.S, self.P + max_new_tokens, self.device)
        self.logits: torch.Tensor | None = None  # [S, V] float32, rows 0..n-1 pending a draw
        self.pending: dict | None = None  # the last prefilled prompts while some of their rows wait for a slot
        self.out = torch.full((n_prompts * num_generations, max_new_tokens), -1, dtype=torch.long)
        self.out_logps = torch.zeros((n_prompts * num_generations, max_new_tokens), dtype=torch.float32)  # sampler's log-probs
        eager = getattr(core.config, "_attn_implementation", "sdpa") == "eager"
        self.mask_value = torch.finfo(self.head.weight.dtype).min if eager else None
        # Gemma 3: sliding-window layers see only the last `window` columns (HF's rule: key column > query column - window).
        text_config = getattr(core.config, "text_config", core.config)
        layer_types = getattr(text_config, "layer_types", None) or []
        self.window = getattr(text_config, "sliding_window", None) if "sliding_attention" in layer_types else None
        self.linear = "linear_attention" in layer_types
        self.static = None
        if decode_step != "dynamic":
            self.static = StaticStep(self, graphs=decode_step == "cuda_graph")

    # ------------------------------------------------------------ joining
    def join(self) -> None:
        """Fill the free slots n.. with waiting rows: first the rows left of the last prefilled prompts, then rows of
        queued prompts, prefilled together (enough prompts for the free slots). A prompt's rows may join over several
        steps (its prefill is kept until the last one has joined), so the batch stays full whatever G."""
        while self.cache.n < self.S and (self.pending is not None or self.queue):
            if self.pending is None:
                self.pending = self._prefill_next(-(-(self.S - self.cache.n) // self.G))
            self._take(self.pending, self.S - self.cache.n)
            if not self.pending["rows"]:
                self.pending = None

    def _prefill_next(self, k: int) -> dict:
        """Prefill the next k queued prompts once: their cache, first-token logits, positions and rows to join."""
        prompts, self.queue = self.queue[:k], self.queue[k:]
        chunk = select_rows(self.batch, prompts)
        position_ids, next_pos = prefix_positions(self.model, chunk)
        out = prefill_prompts(self.model, chunk, position_ids, lm_logits=True)
        return dict(
            cache=out.past_key_values,
            logits=out.logits[:, -1].to(torch.float32),
            next_pos=next_pos.cpu(),
            mask=chunk["attention_mask"].bool(),
            rows=[(j, p * self.G + g) for j, p in enumerate(prompts) for g in range(self.G)],  # (prefill row, output row)
        )

    def _take(self, pending: dict, free: int) -> None:
        """Move up to `free` rows of `pending` into slots n..: prefix K/V copied once, first logits, bookkeeping."""
        taken, pending["rows"] = pending["rows"][:free], pending["rows"][free:]
        start, count = self.cache.n, len(taken)
        slots = torch.arange(start, start + count, device=self.device)
        owner_host = torch.tensor([j for j, _ in taken])
        owner = owner_host.to(self.device)
        self.cache.write_prefix(slots, pending["cache"], owner, self.P)
        if self.logits is None:
            self.logits = pending["logits"].new_zeros(self.S, pending["logits"].shape[1])
        self.logits[start : start + count] = pending["logits"].index_select(0, owner)
        r, host = self.rows, slice(start, start + count)
        r.row[host] = torch.tensor([row for _, row in taken])
        r.t[host] = 0
        r.delta[host] = 0
        r.turn_start[host] = 0
        r.next_pos[host] = pending["next_pos"].index_select(0, owner_host)
        r.valid[host] = False
        r.valid[host, : self.P] = pending["mask"].index_select(0, owner)
        for i, (_, row) in enumerate(taken):
            r.gens[start + i] = self.sampler.generator(row)
        self.cache.n += count

    # ------------------------------------------------------------ leaving
    def leave(self, finished: torch.Tensor) -> list[int]:
        """Drop the finished rows among slots 0..n-1; the last active rows move into their slots. Returns the old
        slot of each remaining row, in its new slot order."""
        n = self.cache.n
        m = n - int(finished.sum())
        holes = finished[:m].nonzero().flatten().tolist()
        movers = (~finished[m:n]).nonzero().flatten().add(m).tolist()
        if holes:
            self.cache.move(torch.tensor(holes, device=self.device), torch.tensor(movers, device=self.device))
            self.rows.move(holes, movers)
            if self.logits is not None:
                self.logits[holes] = self.logits[movers]
        self.cache.n = m
        order = list(range(m))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        return order

    # ------------------------------------------------------------ decoding
    def decode(self, tokens: torch.Tensor) -> None:
        """One forward of the n active rows, each fed its last token ([n] on the device); logits -> self.logits."""
        n, r = self.cache.n, self.rows
        t = r.t[:n]
        cols = (self.P + t).to(self.device)
        r.valid[torch.arange(n, device=self.device), cols] = True
        if self.static is not None:
            self.logits[:n] = self.static.step(self, tokens, cols)
        else:
            self.cache.step_rows = n
            self.cache.write_col = cols
            self.cache.length = self.P + int(t.max()) + 1
            positions = self.positions((r.next_pos[:n] + t + r.delta[:n]).to(self.device), cols)
            self.logits[:n] = self.forward(tokens.view(n, 1), self.masks(r.valid[:n, None, None, : self.cache.length], cols), positions)
        r.t[:n] += 1

    def positions(self, qwen_pos: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Position ids of one decode step's rows: M-RoPE rows at their prompt's next position + t on all three axes
        ([3, n, 1]), the others at their column ([n, 1])."""
        return mrope_positions(qwen_pos, 1) if self.qwen else cols.view(-1, 1)

    def masks(self, visible: torch.Tensor, cols: torch.Tensor):
        """The attention mask(s) of one decode step from the visible columns [n, 1, 1, L] and the rows' columns [n]:
        one mask, or one per layer type (Gemma 3's sliding-window layers, Qwen3.5's linear-attention layers)."""
        mask = self._additive(visible)
        if self.window is not None:  # the model takes one mask per layer type
            columns = torch.arange(visible.shape[-1], device=self.device)
            in_window = columns.view(1, 1, 1, -1) > (cols - self.window).view(-1, 1, 1, 1)
            return {"full_attention": mask, "sliding_attention": self._additive(visible & in_window)}
        if self.linear:  # one new token per row: the linear-attention layers need no mask
            return {"full_attention": mask, "linear_attention": None}
        return mask

    def forward(self, tokens: torch.Tensor, mask, positions: torch.Tensor) -> torch.Tensor:
        """The model's text decoder and LM head on one token per row ([n, 1]) -> float32 logits [n, V]."""
        hidden = self.text_model(
            input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=self.cache, use_cache=True
        ).last_hidden_state
        return self.head(hidden[:, -1]).to(torch.float32)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """A boolean [n, 1, 1, L] mask as the attention implementation wants it (eager adds it to the scores)."""
        if self.mask_value is None:
            return visible
        return torch.zeros(visible.shape, dtype=self.head.weight.dtype, device=self.device).masked_fill_(~visible, self.mask_value)

    def run(self) -> torch.Tensor:
        """Decode every queued prompt's G rows to EOS or max_new_tokens. Returns ids [U*G, T'] (T' = the longest
        row), padded with -1 after a row's last token (generate() turns them into pad ids)."""
        self.join()
        while self.cache.n:
            n, r = self.cache.n, self.rows
            chosen = self.sampler.choose(self.logits[:n], r.t[:n], r.gens[:n])
            self.out_logps[r.row[:n], r.t[:n]] = chosen_logps(self.logits[:n].float(), chosen, self.sampler.temperature).cpu()
            chosen = chosen.cpu()
            self.out[r.row[:n], r.t[:n]] = chosen
            finished = self.sampler.is_eos(chosen) | (r.t[:n] + 1 >= self.T)
            tokens = chosen[self.leave(finished)]
            if self.cache.n:
                self.decode(tokens.to(self.device))
            self.join()
        width = int((self.out >= 0).sum(dim=1).max()) if self.out.numel() else 0
        self.out_logps = self.out_logps[:, : max(width, 1)]
        return self.out[:, : max(width, 1)]


class RowSampler:
    """The loop's token rules per row: suppressed ids and (before min_new_tokens) EOS banned, then HF generate's
    warpers (temperature, top-k, top-p), then a draw from the row's own stream (or the argmax when greedy)."""

    def __init__(self, *, eos_ids, suppress_ids, do_sample, temperature, top_p, top_k, min_new_tokens, row_seeds, device):
        self.warpers = sampling_warpers(do_sample, temperature, top_k, top_p)
        self.temperature = temperature if do_sample else 1.0
        self.do_sample, self.min_new_tokens, self.row_seeds = do_sample, min_new_tokens, row_seeds
        self.eos_host = torch.tensor(eos_ids)
        self.eos = self.eos_host.to(device)
        self.suppress = torch.tensor(suppress_ids, dtype=torch.long, device=device)
        self.workspace = SamplingWorkspace()  # buffers reused at every decode step (SamplingWorkspace: heap fragmentation)

    def generator(self, row: int) -> torch.Generator | None:
        return torch.Generator().manual_seed(self.row_seeds[row]) if self.do_sample else None

    def is_eos(self, chosen: torch.Tensor) -> torch.Tensor:
        return torch.isin(chosen, self.eos_host)

    def choose(self, logits: torch.Tensor, t: torch.Tensor, gens: list) -> torch.Tensor:
        """logits [n, V] float32, t [n] tokens each row has so far -> [n] chosen ids."""
        scores = logits
        early = t < self.min_new_tokens
        any_early = bool(early.any())
        if self.suppress.numel() or any_early:
            scores = self.workspace.banned(logits)  # logits stay as they are: the sampler's log-probs read them
        if self.suppress.numel():
            scores.index_fill_(1, self.suppress, float("-inf"))
        if any_early:  # EOS banned in the rows still short of min_new_tokens
            rows = early.nonzero().flatten().to(scores.device)
            scores[rows.unsqueeze(1), self.eos.unsqueeze(0)] = float("-inf")
        if not self.do_sample:
            return scores.argmax(dim=-1)
        return sample_rows(self.warpers(None, scores), draw_uniforms(gens, scores.device), self.workspace)


@torch.no_grad()
def sample_continuous(
    model: torch.nn.Module,
    prompt_batch: dict,
    *,
    num_generations: int,
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    suppress_ids: list[int],
    decode_batch_size: int,
    prompt_seeds: list[int] | None = None,
    prompt_order: list[int] | None = None,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_new_tokens: int = 0,
    decode_step: str = "dynamic",
    return_logps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """G completions per prompt of `prompt_batch` ([U, P], left padded) -> ids [U*G, T] padded with pad_id after
    EOS, rows of prompt u at u*G .. u*G+G-1: the layout of `prefix.sample_with_shared_prefix`. return_logps: also the
    sampler's [U*G, T] log-probs of the chosen tokens (`prefix.chosen_logps`).

    decode_batch_size: rows decoded together (>= 1). prompt_seeds: [U] seeds of the prompts' sampling streams
    (row g of prompt u draws from row_seed(prompt_seeds[u], g)); required when do_sample. prompt_order: the
    order in which prompts join (default 0..U-1; tokens do not depend on it). decode_step: dynamic (shapes follow the
    active rows), static (fixed batch buckets over every cache column) or cuda_graph (static, captured and replayed
    as CUDA graphs; CUDA only)."""
    G = num_generations if do_sample else 1
    sampler = seeded_row_sampler(prompt_batch, G, prompt_seeds, do_sample, eos_ids, suppress_ids, temperature, top_p, top_k, min_new_tokens)
    engine = ContinuousDecoder(
        model,
        prompt_batch,
        num_generations=G,
        max_new_tokens=max_new_tokens,
        decode_batch_size=max(decode_batch_size, 1),
        sampler=sampler,
        prompt_order=prompt_order,
        decode_step=decode_step,
    )
    ids = engine.run()
    ids = ids.masked_fill(ids < 0, pad_id).to(prompt_batch["input_ids"].device)
    return (ids, engine.out_logps.to(ids.device)) if return_logps else ids


def seeded_row_sampler(prompt_batch, G: int, prompt_seeds, do_sample: bool, eos_ids, suppress_ids, temperature, top_p, top_k, min_new_tokens):
    """The RowSampler of U prompts x G rows: row g of prompt u draws from row_seed(prompt_seeds[u], g) (one seed per
    prompt, required when do_sample)."""
    n_prompts = prompt_batch["input_ids"].shape[0]
    if do_sample and (prompt_seeds is None or len(prompt_seeds) != n_prompts):
        raise ValueError(f"sampling needs one seed per prompt: got {None if prompt_seeds is None else len(prompt_seeds)} for {n_prompts} prompts")
    seeds = [row_seed(s, g) for s in prompt_seeds for g in range(G)] if do_sample else None
    return RowSampler(
        eos_ids=eos_ids,
        suppress_ids=suppress_ids,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_new_tokens=min_new_tokens,
        row_seeds=seeds,
        device=prompt_batch["input_ids"].device,
    )
