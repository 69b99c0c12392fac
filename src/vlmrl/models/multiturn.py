"""Multi-turn rollouts with tools in the continuous decoder (issue 28, parts 2 and 3): token-exact by construction.

A row decodes as in `continuous.ContinuousDecoder` until its turn ends with the template's turn-end token. If the
turn holds a tool call, the row pauses: its K/V columns (prompt + every token so far) are copied out of its slot, and
its environment's `step(turn text)` (parse, run the tools with their per-call timeout) runs in a thread pool while
the other rows keep decoding. When the result is back and a slot is free, the row resumes:

- the template's glue after the turn-end token (Qwen's "\\n") and the tool turn (`tools.render.render_tool_turn`:
  the text the template appends for the results, next generation prompt included) are tokenised as one suffix,
  with the tool images, by the run's processor (`encode_prompts`: the images are processed once, at the run's
  pixel bounds, and their image tokens expanded as for a prompt). Earlier turns are never re-tokenised: the suffix
  starts right after a special token (the turn end), which tokenizers split on, so tokenising it alone gives the
  tokens the whole rendering would have there.
- one forward of the model (its own forward: vision tower on the tool images once, features scattered at their
  image tokens, Qwen3-VL's DeepStack included) runs the turn-end token and the suffix on top of the row's saved
  K/V, at the positions the model would give them in the whole sequence (M-RoPE: `get_rope_index` of the suffix,
  shifted to the row's next position; the row's later text positions run ahead of `next_pos + t` by `delta`).
- the extended K/V goes into a free slot; the row continues from the forward's last logits, on its own sampling
  stream (the same generator), so its tokens do not depend on which rows share its batch or on tool timing.

Limits (`TurnLimits`): assistant turns (the environment's `max_turns`), tokens per turn, tokens in all (model +
template + tool tokens after the prompt), images per rollout (the environment's `max_images`). A row that hits one
ends with a reason (`end_reasons`): answered, max_turns, image_budget, turn_tokens, total_tokens, stop_token (the
turn ended with an eos that is not the template's turn end, so the conversation cannot go on in its shape).

Families: the attention-only decoders this engine reproduces and whose tool-turn suffix was tested against the chat
template and a naive HF-generate loop (tests/test_multiturn.py): Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA. Sliding-window
(Gemma 3) and linear-attention (Qwen3.5) layers are refused (their cache is not a plain column range per row).

`sequence_logps` scores the whole sequence (prompt, every turn, every image) in one forward, for old / reference /
training log-probs; the loss uses `loss_mask` (the model's own tokens only).
"""

from __future__ import annotations

import concurrent.futures as futures
from dataclasses import dataclass, field
from typing import Callable

import torch

from vlmrl.algo.turn_advantages import numeric_reward
from vlmrl.families import model_types
from vlmrl.models.continuous import ContinuousDecoder, seeded_row_sampler
from vlmrl.models.loading import unwrap
from vlmrl.models.logprobs import accepted_kwargs, decoder_hidden, selective_logps
from vlmrl.models.prefix import chosen_logps
from vlmrl.models.processing import per_image_chunks, tokenizer_of, apply_template, encode_prompts, render_chat, select_rows
from vlmrl.tools.parsing import parse_tool_calls
from vlmrl.tools.render import ToolTemplateError, chat_template_of, for_template, render_tool_turn, tool_role_mode
from vlmrl.tools.trajectory import Trajectory, images_of
from vlmrl.models.logprobs import model_inputs
from vlmrl.models.prefix import repeat_cache_rows, prefill_prompts, prefix_positions

MULTITURN_MODEL_TYPES = model_types("multiturn")
_MARK = "\u00a7assistant-turn\u00a7"


@dataclass(frozen=True)
class TurnLimits:
    """Budgets of one multi-turn rollout (the environment holds max_turns and max_images)."""

    max_turn_tokens: int  # new tokens per assistant turn
    max_total_tokens: int  # tokens after the prompt: model turns, template glue and tool turns (image tokens included)
    workers: int = 4  # threads running tool calls concurrently


@dataclass
class MultiTurnRollout:
    """N = U*G rows (row u*G+g continues prompt u), T = the longest row. See docs/tools.md."""

    ids: torch.Tensor  # [N, T] every token after the prompt, pad_id after the row's last
    attention_mask: torch.Tensor  # [N, T] 1 on every real token (model and tool)
    loss_mask: torch.Tensor  # [N, T] 1 on the tokens the model sampled
    sampling_logps: torch.Tensor  # [N, T] the sampler's log-probs of model tokens, 0 elsewhere
    truncated: torch.Tensor  # [N] bool: ended by a token budget
    spans: list  # per row [("model" | "tool", start, end)] column ranges of ids
    tool_vision: list  # per row: the processor's vision tensors of its tool images ({} when none)
    tool_images_per_row: torch.Tensor  # [N]
    trajectories: list  # per row: tools.trajectory.Trajectory (TRL conversational shape)
    end_reasons: list  # per row
    num_turns: torch.Tensor  # [N] assistant turns
    num_tool_calls: torch.Tensor  # [N]

    @property
    def lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(dim=1)


def multiturn_supported(model) -> str | None:
    """None when this engine runs multi-turn rollouts for the model, else why not."""
    model_type = getattr(unwrap(model).config, "model_type", None)
    if model_type not in MULTITURN_MODEL_TYPES:
        return f"model_type {model_type}: multi-turn rollouts are built and tested for {', '.join(MULTITURN_MODEL_TYPES)}"
    return None


def turn_end(processor, eos_ids: list[int]) -> tuple[int, str]:
    """(the token id that ends an assistant turn in the chat template, the template's text after it before the next
    turn). The template's rendering of an assistant turn must continue with the text of one of the eos tokens right
    after the content: otherwise the model's own turn end cannot be part of the rendered conversation."""
    tok = tokenizer_of(processor)
    after = _assistant_turn(processor)[1]
    for eos in eos_ids:
        eos_text = tok.convert_ids_to_tokens(eos)
        if eos_text and after.startswith(eos_text):
            return eos, after[len(eos_text) :]
    raise ToolTemplateError(
        f"the chat template ends an assistant turn with {after[:20]!r}, which is not an eos token of the model; the model's "
        "turn end cannot be kept as the template renders it, so multi-turn rollouts cannot be token-exact"
    )


def _assistant_turn(processor) -> tuple[str, str]:
    """(what the template writes between the generation prompt and an assistant turn's content, what it writes after
    the content). LLaVA-1.5's template prompts generation with "ASSISTANT:" but renders a turn as "ASSISTANT: text":
    the model's text must begin with that space for the conversation to render as it was generated."""
    template = chat_template_of(processor)
    user = [{"role": "user", "content": "q"}]
    prompt = apply_template(processor, user, add_generation_prompt=True, chat_template=template)
    text = apply_template(processor, user + [{"role": "assistant", "content": _MARK}], chat_template=template)
    head, after = text[: text.index(_MARK)], text[text.index(_MARK) + len(_MARK) :]
    return (head[len(prompt) :] if head.startswith(prompt) else ""), after


def content_prefix(processor) -> str:
    """The text a generated turn must start with to render as generated ("" for ChatML templates, " " for LLaVA-1.5's)."""
    return _assistant_turn(processor)[0]


def template_messages(trajectory: Trajectory, mode: str, prefix: str = "") -> list[dict]:
    """The conversation as the chat template renders it: the prompt, each assistant turn's text verbatim (tool-call
    markup included: what the model wrote; `prefix`, see `content_prefix`, taken off its start) and each turn's tool
    messages as `render.for_template` shows them."""
    out = list(trajectory.prompt)
    turn, pending = -1, []
    for message in trajectory.completion:
        if message["role"] == "assistant":
            out += for_template(pending, mode) if pending else []
            pending, turn = [], turn + 1
            text = trajectory.turn_texts[turn]
            out.append({"role": "assistant", "content": text[len(prefix) :] if prefix and text.startswith(prefix) else text})
        else:
            pending.append(message)
    return out + (for_template(pending, mode) if pending else [])


@dataclass
class _RowState:
    env: object
    turn: int = 0
    spans: list = field(default_factory=list)
    vision: list = field(default_factory=list)  # one encode_prompts batch per tool turn with images
    end_reason: str | None = None
    extra_turn: str | None = None  # a turn cut by a budget (not stepped through the environment)
    turn_rewards: list = field(default_factory=list)  # per turn: its step's reward when the rollout went on, else 0.0
    bad_rewards: list = field(default_factory=list)  # step rewards that were not finite numbers (repr)

    def record(self, reward, done: bool) -> None:
        """One stepped turn's reward (the rollout's own reward, when `done`, is the trajectory's: not counted twice)."""
        value, ok = numeric_reward(reward)
        if not ok:
            self.bad_rewards.append(repr(reward)[:60])
        self.turn_rewards.append(0.0 if done else value)


@dataclass
class _Paused:
    row: int
    keys: list  # per layer [kv, P + t, d]
    values: list
    valid: torch.Tensor  # [P + t] columns the row attends to
    t: int  # the turn-end token's index (it is not in the cache yet)
    next_pos: int
    delta: int
    generator: object
    future: futures.Future | None = None
    suffix: dict | None = None  # the encoded glue + tool turn, once the tools returned


class MultiTurnDecoder(ContinuousDecoder):
    """`ContinuousDecoder` whose rows pause on a tool call and resume from their K/V with the tool turn appended."""

    def __init__(self, model, processor, prompt_batch, envs, *, limits: TurnLimits, eos_ids, sampler, force=None, **kw):
        why = multiturn_supported(model)
        if why:
            raise ValueError(why)
        super().__init__(model, prompt_batch, max_new_tokens=limits.max_total_tokens, sampler=sampler, **kw)
        self.processor, self.limits, self.force = processor, limits, force
        self.turn_end_id, self.glue = turn_end(processor, eos_ids)
        self.mode = tool_role_mode(chat_template_of(processor))
        self.tokenizer = tokenizer_of(processor)
        self.states = [_RowState(env) for env in envs]
        if len(envs) != self.out.shape[0]:
            raise ValueError(f"multi-turn rollout: {len(envs)} environments for {self.out.shape[0]} rows")
        self.loss = torch.zeros_like(self.out, dtype=torch.bool)
        self.paused: list[_Paused] = []
        self.pool = futures.ThreadPoolExecutor(max_workers=max(1, limits.workers), thread_name_prefix="vlmrl-tool")
        self.image_token_id = getattr(unwrap(model).config, "image_token_id", getattr(unwrap(model).config, "image_token_index", None))

    # ------------------------------------------------------------ turns
    def _turn_text(self, row: int, start: int, end: int) -> str:
        return self.tokenizer.decode(self.out[row, start:end].tolist(), skip_special_tokens=False)

    def _end_turn(self, slot: int, chosen: int, reason: str | None) -> None:
        """The turn of the row in `slot` ended (chosen: its last token): pause it for its tools, or finish it."""
        r = self.rows
        row, t, start = int(r.row[slot]), int(r.t[slot]), int(r.turn_start[slot])
        state = self.states[row]
        state.spans.append(("model", start, t + 1))
        if reason is None and chosen != self.turn_end_id:
            reason = "stop_token"
        if reason is not None:
            state.extra_turn, state.end_reason = self._turn_text(row, start, t + 1), reason
            state.turn_rewards.append(0.0)
            return
        text = self._turn_text(row, start, t)
        parsed = parse_tool_calls(text)
        if not (parsed.calls or parsed.errors):  # an answer: the environment ends the rollout at once
            _observation, reward, done = state.env.step(text)
            state.record(reward, bool(done))
            state.end_reason = "answered"
            return
        cols = self.P + t
        saved = _Paused(
            row=row,
            keys=[k[slot, :, :cols].clone() for k in self.cache.keys],
            values=[v[slot, :, :cols].clone() for v in self.cache.values],
            valid=r.valid[slot, :cols].clone(),
            t=t,
            next_pos=int(r.next_pos[slot]),
            delta=int(r.delta[slot]),
            generator=r.gens[slot],
        )
        saved.future = self.pool.submit(state.env.step, text)
        self.paused.append(saved)

    def _collect(self, block: bool) -> None:
        """Finish or ready the paused rows whose tools returned (block: wait for one when none has)."""
        waiting = [p.future for p in self.paused if p.suffix is None]
        if block and waiting and not any(f.done() for f in waiting):
            futures.wait(waiting, return_when=futures.FIRST_COMPLETED)
        for p in list(self.paused):
            if p.suffix is not None or not p.future.done():
                continue
            state = self.states[p.row]
            observation, reward, done = p.future.result()
            state.record(reward, bool(done))
            state.turn += 1
            if done:
                state.end_reason = state.env.trajectory().end_reason
                self.paused.remove(p)
                continue
            suffix = self._encode_suffix(observation)
            if p.t + suffix["input_ids"].shape[1] + 1 >= self.T:  # eos + suffix + at least one token must fit
                state.end_reason = "total_tokens"
                self.paused.remove(p)
                continue
            p.suffix = suffix

    def _encode_suffix(self, observation: list[dict]) -> dict:
        """The glue after the turn end and the tool turn, tokenised with the tool images (processed once)."""
        text = self.glue + render_tool_turn(self.processor, observation, self.mode)
        images = images_of(for_template(observation, self.mode))
        return encode_prompts(self.processor, [text], [images])

    # ------------------------------------------------------------ resuming
    def join(self) -> None:
        """Resumed rows first (they hold K/V already), then the parent's queued prompts."""
        self._collect(block=False)
        for p in [p for p in self.paused if p.suffix is not None]:
            if self.cache.n >= self.S:
                break
            self.paused.remove(p)
            self._resume(p)
        super().join()

    def _resume(self, p: _Paused) -> None:
        """One forward of [turn end, glue, tool turn] on the row's saved K/V; the extended K/V goes into slot n."""
        from transformers import DynamicCache

        core, suffix, row = self.core, p.suffix, p.row
        chunk = torch.cat([torch.tensor([[self.out[row, p.t]]]), suffix["input_ids"]], dim=1).to(self.device)
        L, cols = chunk.shape[1], self.P + p.t
        past = DynamicCache(ddp_cache_data=[(k.unsqueeze(0), v.unsqueeze(0)) for k, v in zip(p.keys, p.values)])
        inputs = {k: v.to(self.device) for k, v in suffix.items() if k not in ("input_ids", "attention_mask", "images_per_row", "mm_token_type_ids")}
        mask = torch.cat([p.valid.view(1, -1), torch.ones(1, L, dtype=torch.bool, device=self.device)], dim=1).long()
        start = p.next_pos + p.t + p.delta
        positions, delta = None, p.delta
        if self.qwen:
            rel = self._rope_index(chunk, suffix)  # [3, 1, L] from 0
            positions = rel + start
            delta = start + int(rel.max()) + 1 - (p.next_pos + p.t + L)
        if "mm_token_type_ids" in suffix:
            inputs["mm_token_type_ids"] = (chunk == self.image_token_id).to(suffix["mm_token_type_ids"].dtype)
        out = core(
            input_ids=chunk,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=past,
            cache_position=torch.arange(cols, cols + L, device=self.device),
            use_cache=True,
            logits_to_keep=1,
            **inputs,
        )
        slot = self.cache.n
        self.cache.write_prefix(torch.tensor([slot], device=self.device), out.past_key_values, torch.tensor([0], device=self.device), cols + L)
        self.logits[slot] = out.logits[0, -1].to(torch.float32)
        r = self.rows
        r.row[slot], r.t[slot], r.next_pos[slot], r.delta[slot], r.turn_start[slot] = row, p.t + L, p.next_pos, delta, p.t + L
        r.valid[slot] = False
        r.valid[slot, : cols + L] = mask[0].bool()
        r.gens[slot] = p.generator
        self.cache.n += 1
        self.out[row, p.t + 1 : p.t + L] = suffix["input_ids"][0]
        state = self.states[row]
        state.spans.append(("tool", p.t + 1, p.t + L))
        if "pixel_values" in suffix:
            state.vision.append(suffix)

    def _rope_index(self, chunk: torch.Tensor, suffix: dict) -> torch.Tensor:
        inner = self.core.model
        kwargs = {
            "input_ids": chunk,
            "mm_token_type_ids": (chunk == self.image_token_id).long(),
            "image_grid_thw": suffix["image_grid_thw"].to(chunk.device) if "image_grid_thw" in suffix else None,
            "attention_mask": torch.ones_like(chunk),
        }
        position_ids, _ = inner.get_rope_index(**accepted_kwargs(inner.get_rope_index, kwargs))
        return position_ids

    # ------------------------------------------------------------ the loop
    def run(self) -> torch.Tensor:
        try:
            self.join()
            while self.cache.n or self.paused:
                if not self.cache.n:
                    self._collect(block=True)
                    self.join()
                    continue
                self._step()
                self.join()
        finally:
            self.pool.shutdown(wait=True)
        return self.out

    def _step(self) -> None:
        n, r = self.cache.n, self.rows
        turn_t = r.t[:n] - r.turn_start[:n]
        logits = self.logits[:n]
        scores = self._forced(logits, turn_t) if self.force is not None else logits
        chosen = self.sampler.choose(scores, turn_t, r.gens[:n])
        rows, t = r.row[:n], r.t[:n]
        self.out_logps[rows, t] = chosen_logps(logits.float(), chosen, self.sampler.temperature).cpu()
        chosen = chosen.cpu()
        self.out[rows, t] = chosen
        self.loss[rows, t] = True
        eos = self.sampler.is_eos(chosen)
        cut_total, cut_turn = t + 1 >= self.T, turn_t + 1 >= self.limits.max_turn_tokens
        finished = eos | cut_total | cut_turn
        for slot in finished.nonzero().flatten().tolist():
            # A turn that ended with eos is the environment's to judge (an answer, or a call whose result may not fit).
            reason = None if bool(eos[slot]) else ("total_tokens" if bool(cut_total[slot]) else "turn_tokens")
            self._end_turn(slot, int(chosen[slot]), reason)
        tokens = chosen[self.leave(finished)]
        if self.cache.n:
            self.decode(tokens.to(self.device))

    def _forced(self, logits: torch.Tensor, turn_t: torch.Tensor) -> torch.Tensor:
        """Test hook: `force(row, turn, token index in turn) -> id or None` replaces a row's choice (the forward, the
        K/V and the turn bookkeeping stay the engine's)."""
        scores = logits.clone()
        for i in range(logits.shape[0]):
            row = int(self.rows.row[i])
            token = self.force(row, self.states[row].turn, int(turn_t[i]))
            if token is not None:
                scores[i] = float("-inf")
                scores[i, token] = 0.0
        return scores

    # ------------------------------------------------------------ results
    def result(self, pad_id: int) -> MultiTurnRollout:
        real = self.out >= 0
        width = max(1, int(real.sum(dim=1).max())) if self.out.numel() else 1
        ids = self.out[:, :width].masked_fill(~real[:, :width], pad_id)
        trajectories, reasons = [], []
        for state in self.states:
            traj = state.env.trajectory()
            reason = state.end_reason or "answered"
            if state.extra_turn is not None:
                traj.turn_texts.append(state.extra_turn)
                traj.completion.append({"role": "assistant", "content": state.extra_turn})
            traj.end_reason = reason
            traj.turn_rewards, traj.bad_turn_rewards = list(state.turn_rewards), list(state.bad_rewards)
            trajectories.append(traj)
            reasons.append(reason)
        vision = [_merge_vision(s.vision) for s in self.states]
        return MultiTurnRollout(
            ids=ids,
            attention_mask=real[:, :width].long(),
            loss_mask=self.loss[:, :width].long(),
            sampling_logps=self.out_logps[:, :width].masked_fill(~self.loss[:, :width], 0.0),
            truncated=torch.tensor([r in ("turn_tokens", "total_tokens") for r in reasons]),
            spans=[s.spans for s in self.states],
            tool_vision=vision,
            tool_images_per_row=torch.tensor([int(v["images_per_row"].sum()) if v else 0 for v in vision], dtype=torch.long),
            trajectories=trajectories,
            end_reasons=reasons,
            num_turns=torch.tensor([t.num_turns for t in trajectories], dtype=torch.long),
            num_tool_calls=torch.tensor([len(t.tool_calls) for t in trajectories], dtype=torch.long),
        )


def _merge_vision(batches: list[dict]) -> dict:
    """One row's tool-turn vision tensors, turn after turn (the order of their image tokens in the row)."""
    if not batches:
        return {}
    out = {}
    for key in batches[0]:
        if key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            continue
        out[key] = torch.cat([b[key] for b in batches], dim=0) if torch.is_tensor(batches[0][key]) else batches[0][key]
    return out


@torch.no_grad()
def sample_multiturn(
    model,
    processor,
    prompt_batch: dict,
    envs: list,
    *,
    num_generations: int,
    limits: TurnLimits,
    eos_ids: list[int],
    pad_id: int,
    suppress_ids: list[int],
    decode_batch_size: int = 0,
    prompt_seeds: list[int] | None = None,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_new_tokens: int = 0,
    force: Callable | None = None,
) -> MultiTurnRollout:
    """G multi-turn rollouts per prompt of `prompt_batch` ([U, P] left padded, as `continuous.sample_continuous`),
    row u*G+g driven by envs[u*G+g] (a `tools.environment.ToolEnvironment`, already `reset` with its row). With
    do_sample=False, G is still num_generations (the environments decide); every row of a prompt is then the same.
    force: tests only (`MultiTurnDecoder._forced`)."""
    G = num_generations
    sampler = seeded_row_sampler(prompt_batch, G, prompt_seeds, do_sample, eos_ids, suppress_ids, temperature, top_p, top_k, min_new_tokens)
    engine = MultiTurnDecoder(
        model,
        processor,
        prompt_batch,
        envs,
        limits=limits,
        eos_ids=eos_ids,
        sampler=sampler,
        force=force,
        num_generations=G,
        decode_batch_size=max(decode_batch_size or prompt_batch["input_ids"].shape[0] * G, 1),
    )
    engine.run()
    return engine.result(pad_id)


# ---------------------------------------------------------------- scoring the whole sequence


def with_tool_vision(prompt_batch: dict, row_prompt: torch.Tensor, tool_vision: list[dict]) -> dict:
    """Per row: its prompt (select_rows) with its tool images appended after the prompt's own, in the order of their
    image tokens (prompt first, then each tool turn's), so the model's forward scatters every image to its tokens."""
    rows = select_rows(prompt_batch, row_prompt)
    keys = [k for k in ("pixel_values", "image_grid_thw") if k in rows or any(k in v for v in tool_vision)]
    if not any(tool_vision):
        return rows
    per_row = rows["images_per_row"].tolist()
    out = dict(rows)
    for key in keys:
        prompt_chunks = per_image_chunks(rows, key) if key in rows else []
        pieces, at = [], 0
        for i, count in enumerate(per_row):
            pieces += prompt_chunks[at : at + count]
            at += count
            if tool_vision[i]:
                pieces += per_image_chunks(tool_vision[i], key)
        flat = key == "pixel_values" and "image_grid_thw" in out  # Qwen-VL patches: one flat [patches, d] tensor
        out[key] = torch.cat(pieces) if flat else torch.stack(pieces)
    out["images_per_row"] = torch.tensor([c + (int(v["images_per_row"].sum()) if v else 0) for c, v in zip(per_row, tool_vision)])
    return out


def sequence_logps(
    model,
    prompt_batch: dict,
    row_prompt: torch.Tensor,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    tool_vision: list[dict],
    temperature: float = 1.0,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """[N, T] log-probs of every token after the prompt (model and tool tokens; mask with the loss mask), the whole
    multi-turn sequence forwarded once with all its images. prompt_batch: the U unique prompts; row_prompt: [N];
    ids, attention_mask: [N, T] right padded (a rollout's ids / attention_mask); tool_vision: [N] per-row dicts."""

    core = unwrap(model)
    batch = with_tool_vision(prompt_batch, torch.as_tensor(row_prompt).reshape(-1), tool_vision)
    P, T = batch["input_ids"].shape[1], ids.shape[1]
    full = torch.cat([batch["input_ids"], ids.to(batch["input_ids"].device)], dim=1)
    inputs = model_inputs(batch)
    inputs["input_ids"] = full
    inputs["attention_mask"] = torch.cat([batch["attention_mask"], attention_mask.to(batch["attention_mask"])], dim=1)
    image_token = getattr(core.config, "image_token_id", getattr(core.config, "image_token_index", None))
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in batch:
            inputs[key] = (full == image_token).to(batch[key].dtype)
    hidden = decoder_hidden(core, inputs)
    predicting = hidden[:, P - 1 : P - 1 + T]
    return selective_logps(predicting, core.get_output_embeddings(), ids.to(hidden.device), temperature, chunk_tokens)


def _merged_tool_vision(tool_vision: list[dict]) -> dict:
    """The rows' tool-image tensors concatenated in row order (the order of their image tokens in a batch of rows)."""
    present = [v for v in tool_vision if v]
    if not present:
        return {}
    return {k: torch.cat([v[k] for v in present]) for k in ("pixel_values", "image_grid_thw") if k in present[0]}


def _row_grids(prompt_batch: dict, rows: torch.Tensor, tool_vision: list[dict]) -> torch.Tensor | None:
    """image_grid_thw of every image of each row in order (its prompt's, then its tool images'), or None."""
    prompt = per_image_chunks(prompt_batch, "image_grid_thw") if "image_grid_thw" in prompt_batch else []
    per_row = prompt_batch.get("images_per_row", torch.zeros(prompt_batch["input_ids"].shape[0], dtype=torch.long)).tolist()
    starts = [sum(per_row[:i]) for i in range(len(per_row))]
    grids = []
    for r, vision in zip(rows.tolist(), tool_vision):
        grids += [g.cpu() for g in prompt[starts[r] : starts[r] + per_row[r]]]
        if vision and "image_grid_thw" in vision:
            grids += list(vision["image_grid_thw"].cpu().unbind(0))
    return torch.stack(grids) if grids else None


def sequence_logps_prefix(
    model,
    prompt_batch: dict,
    row_prompt: torch.Tensor,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    tool_vision: list[dict],
    temperature: float = 1.0,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """`sequence_logps` with each unique prompt (and its images) run once: the U prompts are prefilled, their K/V
    gathered to the N rows (as `prefix.completion_logps_prefix`), and each row's turns run on top with only its tool
    images (encoded once each). M-RoPE positions of the turns come from the model's get_rope_index over each row's whole
    sequence (a text-only computation), so they are the positions `sequence_logps` gives them."""
    from vlmrl.models.logprobs import MROPE_FAMILIES, grouped_family

    core = unwrap(model)
    rows = torch.as_tensor(row_prompt, dtype=torch.long).reshape(-1).to(prompt_batch["input_ids"].device)
    P, T = prompt_batch["input_ids"].shape[1], ids.shape[1]
    position_ids, _ = prefix_positions(model, prompt_batch)
    out = prefill_prompts(model, prompt_batch, position_ids, lm_logits=False)
    first = out.last_hidden_state[:, -1].index_select(0, rows).unsqueeze(1)  # [N, 1, H] predicts each row's first token
    if T == 1:
        return selective_logps(first, core.get_output_embeddings(), ids, temperature, chunk_tokens)
    cache = out.past_key_values
    repeat_cache_rows(cache, rows=rows)
    turns, turn_mask = ids[:, : T - 1], attention_mask[:, : T - 1].to(prompt_batch["attention_mask"])  # the last token predicts nothing
    mask = torch.cat([prompt_batch["attention_mask"].index_select(0, rows), turn_mask], dim=1)
    image_token = getattr(core.config, "image_token_id", getattr(core.config, "image_token_index", None))
    step = {
        "input_ids": turns,
        "attention_mask": mask,
        "past_key_values": cache,
        "cache_position": torch.arange(P, P + T - 1, device=rows.device),
        "use_cache": True,
        **{k: v.to(rows.device) for k, v in _merged_tool_vision(tool_vision).items()},
    }
    if grouped_family(model) in MROPE_FAMILIES:
        inner = core.model
        full = torch.cat([prompt_batch["input_ids"].index_select(0, rows), turns], dim=1)
        kwargs = {"input_ids": full, "mm_token_type_ids": (full == image_token).long(), "attention_mask": mask}
        grids = _row_grids(prompt_batch, rows, tool_vision)
        kwargs["image_grid_thw"] = grids.to(rows.device) if grids is not None else None
        positions, _ = inner.get_rope_index(**accepted_kwargs(inner.get_rope_index, kwargs))
        step["position_ids"] = positions[..., P:]
        if "mm_token_type_ids" in prompt_batch:
            step["mm_token_type_ids"] = (turns == image_token).to(prompt_batch["mm_token_type_ids"].dtype)
    rest = core.model(**step).last_hidden_state
    del out
    return selective_logps(torch.cat([first.to(rest.dtype), rest], dim=1), core.get_output_embeddings(), ids, temperature, chunk_tokens)


def logps_for_rows(model, prompt_batch: dict, row_prompt, ids, completion_mask, opts, tool_vision: list | None = None) -> torch.Tensor:
    """The trainer's per-token log-probs: `prefix.completion_logps_for` for single-turn rows (tool_vision None), else the
    whole multi-turn sequence (completion_mask: every real token, model and tool): each prompt prefilled once
    (`sequence_logps_prefix`, memory.shared_prefix) or every row forwarded whole (`sequence_logps`)."""
    from vlmrl.models.prefix import completion_logps_for, prefix_supported

    if tool_vision is None:
        return completion_logps_for(model, prompt_batch, row_prompt, ids, completion_mask, opts)
    shared = opts.shared_prefix and prefix_supported(model, prompt_batch, torch.is_grad_enabled())
    fn = sequence_logps_prefix if shared else sequence_logps
    with opts.autocast():
        return fn(model, prompt_batch, row_prompt, ids, completion_mask, tool_vision, opts.temperature, opts.chunk_tokens)


def rendered_conversation(processor, trajectory: Trajectory) -> str:
    """The chat template's rendering of a finished rollout (no generation prompt): what exactness tests compare the
    engine's tokens with."""
    mode = tool_role_mode(chat_template_of(processor))
    return render_chat(processor, template_messages(trajectory, mode, content_prefix(processor)), add_generation_prompt=False)
