"""rollout.backend=vllm with tools (tools.tools / tools.environment): multi-turn rollouts sampled by vLLM one turn at a
time, laid out token for token as the in-process decoder lays them out (models/multiturn.py).

Each row keeps two forms of its sequence: vLLM's (the prompt's chat text tokenised with one placeholder per image,
then every turn's tokens, then each tool turn tokenised the same way, its images appended to the row's image list:
vLLM expands the placeholders itself) and the trainer's (the processor's expanded prompt, then the same turns, each
tool turn encoded by the processor with its images, as the in-process decoder's suffix). Every turn's request is
checked: the prompt vLLM expanded must be the trainer's sequence so far, token for token (parity.check_prompts), so
the turns are trained on what they were sampled from. The turn logic (a turn ends at the template's turn end; an
answer ends the rollout; tool calls go to the row's environment and its result comes back as the template's tool
turn; the budgets and end reasons: tools.max_turns, max_turn_tokens, max_total_tokens, the images, stop_token) is
the in-process decoder's, so under greedy decoding the two give the same trajectories (tests/test_vllm.py).

Sampled turns: each turn is a vLLM request with its own seed, from the prompt's seed, the generation and the turn
(the in-process decoder draws a row's turns from one generator): reproducible, not the in-process decoder's draws.
Tool calls run one after another, between turns (the in-process decoder runs them in a thread pool while other rows
decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmrl.algo.turn_advantages import numeric_reward
from vlmrl.models.multiturn import turn_end
from vlmrl.models.prefix import row_seed
from vlmrl.models.processing import ImageShapeCheck, encode_prompts, tokenizer_of
from vlmrl.models.rollout import Completions
from vlmrl.rollout.parity import RolloutParityError, prompt_mismatch
from vlmrl.run.datasets import row_prompt_inputs
from vlmrl.run.tool_rollout import make_environments
from vlmrl.tools.parsing import parse_tool_calls
from vlmrl.tools.render import chat_template_of, for_template, render_tool_turn, tool_role_mode
from vlmrl.tools.trajectory import images_of


@dataclass
class ToolRow:
    """One rollout row: its environment, vLLM's form of the sequence and the trainer's tokens after the prompt."""

    env: object
    name: str  # how an error line names the row
    seed: int
    vllm_ids: list  # vLLM's form: the prompt and everything after it, placeholders not expanded
    images: list  # the prompt's images, then every tool image, in placeholder order
    trainer_prompt: list  # the processor's expanded prompt ids
    out: list = field(default_factory=list)  # every token after the prompt (model and tool turns), the trainer's form
    loss: list = field(default_factory=list)  # per token of `out`: sampled by the model
    logps: list = field(default_factory=list)  # per token of `out`: the sampler's log-prob (0.0 off the model's tokens)
    spans: list = field(default_factory=list)
    vision: list = field(default_factory=list)  # one encode_prompts batch per tool turn with images
    turn: int = 0
    end_reason: str | None = None
    extra_turn: str | None = None  # a turn cut by a budget (not stepped through the environment)
    turn_rewards: list = field(default_factory=list)
    bad_rewards: list = field(default_factory=list)

    def record(self, reward, done: bool) -> None:
        """One stepped turn's reward (when `done`, the rollout's own reward is the trajectory's: not counted twice)."""
        value, ok = numeric_reward(reward)
        if not ok:
            self.bad_rewards.append(repr(reward)[:60])
        self.turn_rewards.append(0.0 if done else value)


class ToolRollouts:
    """G multi-turn rollouts per prompt through a VLLMRollout's engine (module docstring). `force(row, turn, j) -> id |
    None`: tests only, as the in-process decoder's (the script's tokens replace the model's choice of token j of a turn)."""

    def __init__(self, vllm, rows: list[dict], prompts: dict, seeds: list[int], names: list[str], greedy: bool = False, force=None):
        self.v, self.cfg, self.greedy, self.force = vllm, vllm.cfg, greedy, force
        processor, G = vllm.processor, vllm.cfg.rollout.num_generations
        self.tokenizer = tokenizer_of(processor)
        self.turn_end_id, self.glue = turn_end(processor, vllm.eos)
        self.mode = tool_role_mode(chat_template_of(processor))
        self.T, self.turn_tokens = self.cfg.tools.max_total_tokens, self.cfg.max_turn_tokens
        d = self.cfg.data
        envs = make_environments(self.cfg, rows, G, ImageShapeCheck(processor, d.min_pixels, d.max_pixels, d.max_image_pixels))
        texts, images, _ = row_prompt_inputs(processor, rows, self.cfg)
        ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
        self.rows = [
            ToolRow(
                env=envs[u * G + g],
                name=f"{names[u]}, generation {g}",
                seed=row_seed(row_seed(seeds[u], g), 0),
                vllm_ids=self.tokenizer(texts[u], add_special_tokens=False)["input_ids"],
                images=list(images[u]),
                trainer_prompt=ids[u][mask[u]].tolist(),
            )
            for u in range(len(rows))
            for g in range(G)
        ]

    # ------------------------------------------------------------ turns
    def run(self) -> Completions:
        active = list(range(len(self.rows)))
        while active:
            forced = [self._forced(i) for i in active]
            outs = self.v.engine.generate([self._request(i, f) for i, f in zip(active, forced)], [self._params(i, f) for i, f in zip(active, forced)])
            for i, f, o in zip(active, forced, outs):
                self._check(self.rows[i], f, o)
            for i, f, o in zip(active, forced, outs):
                self._take_turn(self.rows[i], f, o)
            active = [i for i in active if self.rows[i].end_reason is None]
        return self.result()

    def _check(self, row: ToolRow, forced: list[int], out: dict) -> None:
        """The prompt vLLM built for this turn (its scripted tokens left out) must be the trainer's sequence so far."""
        built = out["prompt_token_ids"][: len(out["prompt_token_ids"]) - len(forced)]
        problem = prompt_mismatch(built, row.trainer_prompt + row.out, self.v.vision_ids)
        if problem is not None:
            raise RolloutParityError(f"{row.name}: {problem}; the turn would be trained on another prompt than the one it was sampled from")

    def _forced(self, i: int) -> list[int]:
        """The scripted tokens of row i's current turn (none without a `force`), up to the turn's end."""
        tokens: list[int] = []
        while self.force is not None and len(tokens) < self.turn_tokens:
            token = self.force(i, self.rows[i].turn, len(tokens))
            if token is None:
                break
            tokens.append(token)
            if token in self.v.eos:
                break
        return tokens

    def _request(self, i: int, forced: list[int]) -> dict:
        row = self.rows[i]
        ids = row.vllm_ids + forced
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": row.images}} if row.images else {"prompt_token_ids": ids}

    def _params(self, i: int, forced: list[int]) -> dict:
        """This turn's sampling: what is left of the turn's and the rollout's budgets after the scripted tokens (at
        least one token is asked for; a fully scripted turn's is dropped), its forced tokens' log-probs from the
        prompt's."""
        row, r = self.rows[i], self.cfg.rollout
        left = min(self.turn_tokens - len(forced), self.T - len(row.out) - len(forced))
        return {
            "n": 1,
            "max_tokens": max(1, left),
            "min_tokens": max(0, min(r.min_completion_length - len(forced), left)),
            "temperature": 0.0 if self.greedy else r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k if r.top_k > 0 else -1,
            "seed": row_seed(row.seed, row.turn) % 2**63,
            "logprobs": 0,
            "prompt_logprobs": 0 if forced else None,
            "stop_token_ids": self.v.eos,
        }

    def _take_turn(self, row: ToolRow, forced: list[int], out: dict) -> None:
        """Append one turn's tokens to `row` and end it the in-process decoder's way (models/multiturn._end_turn)."""
        sample = out["samples"][0]
        scripted_done = bool(forced) and (forced[-1] in self.v.eos or len(forced) >= self.turn_tokens or len(row.out) + len(forced) >= self.T)
        new = forced if scripted_done else forced + list(sample["token_ids"])
        logps = list(out.get("prompt_logprobs") or [])[len(out["prompt_token_ids"]) - len(forced) :] if forced else []
        logps = (logps + ([] if scripted_done else list(sample["logprobs"])))[: len(new)]
        new = new[: min(len(new), self.T - len(row.out), self.turn_tokens)]
        start = len(row.out)
        row.out += new
        row.loss += [True] * len(new)
        row.logps += logps[: len(new)]
        row.vllm_ids += new
        t = len(row.out) - 1  # the turn's last token
        row.spans.append(("model", start, t + 1))
        last = new[-1]
        reason = None if last in self.v.eos else ("total_tokens" if t + 1 >= self.T else "turn_tokens")
        if reason is None and last != self.turn_end_id:
            reason = "stop_token"
        if reason is not None:
            row.extra_turn, row.end_reason = self._text(row.out[start : t + 1]), reason
            row.turn_rewards.append(0.0)
            return
        text = self._text(row.out[start:t])
        parsed = parse_tool_calls(text)
        observation, reward, done = row.env.step(text)
        row.record(reward, bool(done))
        if not (parsed.calls or parsed.errors):
            row.end_reason = "answered"
            return
        row.turn += 1
        if done:
            row.end_reason = row.env.trajectory().end_reason
            return
        self._append_tool_turn(row, observation, t)

    def _append_tool_turn(self, row: ToolRow, observation: list[dict], t: int) -> None:
        """The template's glue after the turn end and the tool turn: the processor's encoding (images expanded) for the
        trainer, the tokenizer's (one placeholder per image) and the images for vLLM."""
        text = self.glue + render_tool_turn(self.v.processor, observation, self.mode)
        images = images_of(for_template(observation, self.mode))
        suffix = encode_prompts(self.v.processor, [text], [images])
        ids = suffix["input_ids"][0].tolist()
        if t + len(ids) + 1 >= self.T:  # eos + suffix + at least one token must fit
            row.end_reason = "total_tokens"
            return
        row.spans.append(("tool", t + 1, t + 1 + len(ids)))
        row.out += ids
        row.loss += [False] * len(ids)
        row.logps += [0.0] * len(ids)
        row.vllm_ids += self.tokenizer(text, add_special_tokens=False)["input_ids"]
        row.images += images
        if "pixel_values" in suffix:
            row.vision.append(suffix)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------ results
    def result(self) -> Completions:
        """[N, T] the loop's Completions, as run/tool_rollout.sample_with_tools returns the in-process decoder's."""
        width = max(1, max(len(row.out) for row in self.rows))
        N, pad = len(self.rows), self.v.pad
        ids = torch.full((N, width), pad, dtype=torch.long)
        mask, loss = torch.zeros((N, width), dtype=torch.long), torch.zeros((N, width), dtype=torch.long)
        logps = torch.zeros((N, width), dtype=torch.float32)
        trajectories = []
        for i, row in enumerate(self.rows):
            n = len(row.out)
            ids[i, :n], mask[i, :n] = torch.tensor(row.out, dtype=torch.long), 1
            loss[i, :n] = torch.tensor(row.loss, dtype=torch.long)
            logps[i, :n] = torch.tensor(row.logps, dtype=torch.float32) * loss[i, :n]
            trajectory = row.env.trajectory()
            if row.extra_turn is not None:
                trajectory.turn_texts.append(row.extra_turn)
                trajectory.completion.append({"role": "assistant", "content": row.extra_turn})
            trajectory.end_reason = row.end_reason or "answered"
            trajectory.turn_rewards, trajectory.bad_turn_rewards = list(row.turn_rewards), list(row.bad_rewards)
            trajectories.append(trajectory)
        truncated = torch.tensor([t.end_reason in ("turn_tokens", "total_tokens") for t in trajectories])
        return Completions(
            ids=ids,
            mask=mask,
            truncated=truncated,
            sampling_logps=logps,
            loss_mask=loss,
            tool_vision=[tool_vision(row.vision) for row in self.rows],
            trajectories=trajectories,
        )


def tool_vision(batches: list[dict]) -> dict:
    """One row's tool-turn vision tensors, turn after turn (the order of their image tokens in the row)."""
    if not batches:
        return {}
    skip = ("input_ids", "attention_mask", "mm_token_type_ids")
    return {k: torch.cat([b[k] for b in batches], dim=0) if torch.is_tensor(v) else v for k, v in batches[0].items() if k not in skip}
