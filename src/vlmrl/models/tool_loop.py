"""The plain multi-turn loop: HF ``generate`` one turn at a time, re-rendering the whole conversation each turn.

Each turn, every row still running is rendered with the chat template (tool turns as the template sees them:
render.for_template), encoded with all of its images so far, and extended by ``model.generate``; the new text goes to
its environment (``tools.environment``: parse the calls, run them, the observation comes back as messages). Rows of a
batch share one ``generate`` call per turn (left padded, as rollouts are). This re-tokenises every earlier turn, which
the continuous decoder does not: it is the reference the engine's greedy multi-turn rollout is compared with, and the
evaluation loop for tool tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.algo.turn_advantages import numeric_reward
from vlmrl.models.processing import decode, encode_prompts, render_chat
from vlmrl.tools.registry import schemas
from vlmrl.tools.render import chat_template_of, tool_role_mode
from vlmrl.tools.traces import template_messages
from vlmrl.tools.trajectory import Trajectory, images_of


@dataclass
class LoopSettings:
    """How the loop generates: new tokens per turn and greedy (do_sample=False) or sampled turns."""

    max_new_tokens: int = 96
    do_sample: bool = False
    temperature: float = 1.0
    batch_size: int = 32


def conversation_text(processor, messages: list[dict], mode: str | None = None, tools: list[dict] | None = None) -> str:
    """The chat-template text of `messages` (tool turns as the template sees them) with the generation prompt;
    `tools`: the tools' JSON schemas, for templates that describe them."""
    mode = mode or tool_role_mode(chat_template_of(processor))
    return render_chat(processor, template_messages(messages, mode), add_generation_prompt=True, tools=tools)


@torch.no_grad()
def _turn(model, processor, conversations: list[list[dict]], settings: LoopSettings, tools: list[dict] | None = None) -> list[str]:
    """One assistant turn for each conversation (a list of messages): the generated texts, special tokens dropped."""
    mode = tool_role_mode(chat_template_of(processor))
    texts = [conversation_text(processor, m, mode, tools) for m in conversations]
    batch = encode_prompts(processor, texts, [images_of(m) for m in conversations])
    batch.pop("images_per_row", None)
    batch = {k: v.to(model.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    kwargs = {"max_new_tokens": settings.max_new_tokens, "do_sample": settings.do_sample}
    if settings.do_sample:
        kwargs["temperature"] = settings.temperature
    out = model.generate(**batch, **kwargs)
    return decode(processor, out[:, batch["input_ids"].shape[1] :])


def run_tool_loop(model, processor, envs: list, rows: list[dict], settings: LoopSettings | None = None) -> list[Trajectory]:
    """Roll every row out with its environment (``envs[i]`` for ``rows[i]``, each a ToolEnvironment or any
    Environment with a ``trajectory()``) until each is done; returns the trajectories in row order."""
    settings = settings or LoopSettings()
    if len(envs) != len(rows):
        raise ValueError(f"run_tool_loop: {len(envs)} environments for {len(rows)} rows")
    conversations = [list(env.reset(row)) for env, row in zip(envs, rows)]
    tools = schemas(envs[0].tools) if envs and getattr(envs[0], "tools", None) else None  # shown to templates that read them
    active = list(range(len(rows)))
    turn_rewards: list[list[float]] = [[] for _ in rows]
    bad: list[list[str]] = [[] for _ in rows]
    while active:
        still = []
        for start in range(0, len(active), settings.batch_size):
            chunk = active[start : start + settings.batch_size]
            for i, text in zip(chunk, _turn(model, processor, [conversations[i] for i in chunk], settings, tools)):
                observation, reward, done = envs[i].step(text)
                value, ok = numeric_reward(reward)
                turn_rewards[i].append(0.0 if done else value)  # as the engine records them (models/multiturn.py)
                bad[i] += [] if ok else [repr(reward)[:60]]
                conversations[i] += [{"role": "assistant", "content": text}] + observation
                if not done:
                    still.append(i)
        active = still
    out = [env.trajectory() for env in envs]
    for trajectory, rewards, wrong in zip(out, turn_rewards, bad):
        trajectory.turn_rewards, trajectory.bad_turn_rewards = rewards, wrong
    return out
