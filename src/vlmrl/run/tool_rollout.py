"""Multi-turn rollouts with tools in the GRPO loop (tools.tools set): loading the tools, one environment per row,
the engine's rollout as the loop's `Completions`, and the metrics it logs.

The engine is `models.multiturn.sample_multiturn`; this module only connects it to the run: tools from
`tools.tools` (a load error names the field), a `ToolEnvironment` per completion row (budgets from tools.*, the
pixel boxes of Qwen-style models scaled from the size the model saw, data.min_pixels / data.max_pixels), seeds as
the continuous decoder's, and the rollout handed on with `mask` = every real token (scoring attends to the tool
turns), `loss_mask` = the model's own tokens, the tool images and the trajectories (rewards get them in TRL's
conversational shape).
"""

from __future__ import annotations

import functools
import os

from vlmrl.config import Config, ConfigError
from vlmrl.data.media import target_size
from vlmrl.models.multiturn import TurnLimits, multiturn_supported, sample_multiturn
from vlmrl.models.rollout import Completions, eos_token_ids, vision_token_ids
from vlmrl.models.processing import ImageShapeCheck
from vlmrl.tools.environment import environment_factory
from vlmrl.tools.registry import ToolError, load_tools, schemas
from vlmrl.tools.render import PARSE_ERROR_NAME


def _environments(tool_specs: tuple, environment: str) -> tuple:
    """(make, tools) of tools.tools and tools.environment (tools.environment.environment_factory), loaded once per
    working directory (specs may be relative paths)."""
    return _environments_in(tool_specs, environment, os.getcwd())


@functools.lru_cache(maxsize=4)
def _environments_in(tool_specs: tuple, environment: str, cwd: str) -> tuple:
    try:
        tools = load_tools(list(tool_specs))
    except ToolError as e:
        raise ConfigError(f"tools.tools: {e}") from None
    try:
        return environment_factory(environment, tools)
    except ToolError as e:
        raise ConfigError(f"tools.environment: {e}") from None


def load_run_tools(cfg: Config, model=None) -> dict:
    """The tools the model may call (tools.tools, or tools.environment's; empty: single-turn); a bad spec or an
    unsupported model is a ConfigError naming the field."""
    if not cfg.multiturn:
        return {}
    tools = _environments(tuple(cfg.tools.tools), cfg.tools.environment)[1]
    why = multiturn_supported(model) if model is not None else None
    if why:
        raise ConfigError(f"tools.tools is set but {why}")
    return tools


def tool_schemas(cfg: Config) -> list[dict] | None:
    """The tools= list the chat template is given with the run's prompts (None: a single-turn run)."""
    return schemas(load_run_tools(cfg)) if cfg.multiturn else None


def environment_row(row: dict, limit_images: int | None) -> dict:
    """What a row's environment starts from: the whole dataset row (tools read it as context.row), its images cut to
    data.limit_images (full resolution, for the tools)."""
    images = list(row.get("images") or [])
    return {**row, "images": images[:limit_images] if limit_images else images}


def make_environments(cfg: Config, rows: list[dict], G: int, shape_check=None) -> list:
    """One environment per completion row (row u*G + g continues prompt u), each reset with its dataset row.
    shape_check: the run's processor check of image sizes (models.processing.ImageShapeCheck), for tool images."""
    d, t = cfg.data, cfg.tools
    make = _environments(tuple(t.tools), t.environment)[0]

    def seen(image):
        return target_size(image.width, image.height, d.min_pixels, d.max_pixels)

    budgets = dict(
        max_turns=t.max_turns,
        timeout_s=t.timeout_s,
        max_images=t.max_images,
        seen_size=seen,
        max_calls_per_turn=t.max_calls_per_turn,
        max_image_pixels=t.max_image_pixels,
        shape_check=shape_check,
    )
    envs = []
    for row in rows:
        start = environment_row(row, d.limit_images)
        for _ in range(G):
            env = make(**budgets)
            env.reset(start)
            envs.append(env)
    return envs


def sample_with_tools(
    model, processor, cfg: Config, tools: dict, rows: list[dict], prompts: dict, prompt_seeds: list[int], decode_agreement=None
) -> Completions:
    """G multi-turn rollouts per prompt (rollout.* sampling, tools.* budgets) as the loop's Completions.
    decode_agreement: must be None (each process decodes alone; see models/rollout.generate)."""
    if decode_agreement is not None:  # every process would have to run the same number of forwards, resumes included
        raise ConfigError(
            "tools.tools: multi-turn rollouts need each process to decode on its own; with memory.generation_gather=layers "
            "(ZeRO-3 / FSDP2) the processes decode in step, which the multi-turn engine does not do: use memory.generation_gather=full"
        )
    r = cfg.rollout
    d = cfg.data
    envs = make_environments(cfg, rows, r.num_generations, ImageShapeCheck(processor, d.min_pixels, d.max_pixels, d.max_image_pixels))
    tokenizer = processor.tokenizer
    eos = eos_token_ids(model, tokenizer)
    out = sample_multiturn(
        model,
        processor,
        prompts,
        envs,
        num_generations=r.num_generations,
        limits=TurnLimits(max_turn_tokens=cfg.max_turn_tokens, max_total_tokens=cfg.tools.max_total_tokens, workers=cfg.tools.workers),
        eos_ids=eos,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0],
        suppress_ids=vision_token_ids(model),
        decode_batch_size=r.decode_batch_size,
        prompt_seeds=prompt_seeds,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        min_new_tokens=r.min_completion_length,
    )
    device = prompts["input_ids"].device
    return Completions(
        ids=out.ids.to(device),
        mask=out.attention_mask.to(device),
        truncated=out.truncated.to(device),
        sampling_logps=out.sampling_logps.to(device),
        loss_mask=out.loss_mask.to(device),
        tool_vision=[{k: v.to(device) for k, v in vision.items()} for vision in out.tool_vision],
        trajectories=out.trajectories,
    )


def _failed(message: dict) -> bool:
    """A tool message that reports a failure (`execute.ToolResult.error`, or a tool call that could not be read)."""
    content = message.get("content")
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return message.get("name") == PARSE_ERROR_NAME or text.startswith(f"tool {message.get('name')!r} failed:")


def multiturn_metrics(comp: Completions) -> dict:
    """tools/* of one step: turns and tool calls per rollout, the share of calls that worked, the share of each end
    reason, model tokens per rollout; and completions/mean_length as the model's tokens (as TRL counts them: tool turns
    and template glue are not the model's), completions/mean_total_length with them."""
    if comp.trajectories is None:
        return {}
    trajs = comp.trajectories
    n = max(1, len(trajs))
    out = {
        "completions/mean_length": comp.loss_mask.sum(dim=1).float().mean().item(),
        "completions/mean_total_length": comp.lengths.float().mean().item(),
        "tools/turns_mean": sum(t.num_turns for t in trajs) / n,
        "tools/calls_mean": sum(len(t.tool_calls) for t in trajs) / n,
        "tools/model_tokens_mean": float(comp.loss_mask.sum()) / n,
        "tools/turn_reward_mean": sum(sum(t.turn_rewards) for t in trajs) / n,  # the environments' step rewards per rollout
        "tools/bad_turn_rewards": float(sum(len(t.bad_turn_rewards) for t in trajs)),  # not finite numbers: counted as 0
    }
    results = [m for t in trajs for m in t.completion if m.get("role") == "tool"]
    if results:
        out["tools/call_success_rate"] = sum(not _failed(m) for m in results) / len(results)
    for reason in sorted({t.end_reason for t in trajs}):
        out[f"tools/end_{reason}"] = sum(t.end_reason == reason for t in trajs) / n
    return out


def rollout_record(comp: Completions, prompts: dict, i: int, G: int) -> dict:
    """samples.jsonl's token fields of multi-turn row i ({} for single-turn rows), so a rollout can be checked from
    outside: the prompt's ids (padding dropped), every token after it (model and tool turns), the loss mask (1 on the
    model's own tokens) and the sampler's log-prob of each token (0.0 off the mask)."""
    if comp.trajectories is None:
        return {}
    n = int(comp.lengths[i])
    prompt = prompts["input_ids"][i // G][prompts["attention_mask"][i // G].bool()]
    return {
        "prompt_ids": prompt.tolist(),
        "token_ids": comp.ids[i, :n].tolist(),
        "loss_mask": comp.loss_mask[i, :n].int().tolist(),
        "sampling_logps": comp.sampling_logps[i, :n].float().tolist(),
        "end_reason": comp.trajectories[i].end_reason,
    }
