"""Supervised fine-tuning on the solutions, with LLaVA's two stages: projector only, then the language model."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .config import Config, save_config
from .logprobs import completion_logps
from .losses import masked_mean
from .planner import measured_vs_predicted, predict_for_sft
from .runtime import encode_rows, load_datasets, load_policy, load_reward_funcs, resolve_device, seed_everything


def sft_target(row: dict) -> str:
    """The text the model learns to produce: the row's `response`, else `<answer>solution</answer>`."""
    return row.get("response") or f"<answer>{row['solution']}</answer>"


def target_batch(tokenizer, rows: list[dict], device) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] right-padded target ids ending in EOS, and their mask (1 on every target token)."""
    eos = tokenizer.eos_token_id
    seqs = [tokenizer(sft_target(r), add_special_tokens=False)["input_ids"] + [eos] for r in rows]
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def longest_target(tokenizer, rows, sample: int = 512) -> int:
    """Tokens of the longest target (+ EOS) among the first `sample` rows: the planner's completion length."""
    return max((len(tokenizer(sft_target(rows[i]), add_special_tokens=False)["input_ids"]) + 1
                for i in range(min(sample, len(rows)))), default=1)


def set_stage_trainable(model, stage: str, train_vision_tower: bool) -> None:
    """stage 'projector': only the projector; 'language': language model + projector (+ vision tower)."""
    from .models import language_model, output_head, projector, vision_tower

    model.requires_grad_(False)
    projector(model).requires_grad_(True)
    if stage == "language":
        language_model(model).requires_grad_(True)
        output_head(model).requires_grad_(True)
        if train_vision_tower:
            vision_tower(model).requires_grad_(True)


def sft(cfg: Config, log=print) -> dict:
    """Run the configured SFT stages; saves output_dir/final and returns the last metrics."""
    from .data import PromptSampler
    from .evaluate import evaluate
    from .models import save_model
    from .tracking import RunLogger
    from .train import clip_and_step, make_optimizer
    from .distributed import DistributedError, env_world

    if env_world()[0] > 1:
        raise DistributedError(f"vlmrl sft runs on one process; this launch has {env_world()[0]} (WORLD_SIZE). Run it without "
                               "accelerate launch / torchrun (only vlmrl train runs on several processes, docs/scaling_out.md)")
    out = Path(cfg.training.output_dir)
    save_config(cfg, out / "config.yaml")
    device = resolve_device(cfg.training.device)
    seed_everything(cfg.training.seed)
    model, processor = load_policy(cfg, device)
    data = load_datasets(cfg)
    for line in data.reports:
        log(line)
    plan = predict_for_sft(cfg, log, longest_target(processor.tokenizer, data.train))  # logged; compared each step
    sampler = PromptSampler(len(data.train), seed=cfg.training.seed, shuffle=cfg.data.shuffle)
    reward_funcs, _ = load_reward_funcs(cfg)
    s = cfg.sft
    stages = [("projector", s.projector_steps, s.projector_learning_rate), ("language", s.steps, s.learning_rate)]
    total = s.projector_steps + s.steps
    logger = RunLogger(out, total_steps=total, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress_bar, desc="SFT")
    step, final = 0, {}
    model.train()
    for stage, steps, lr in stages:
        if steps == 0:
            continue
        if not cfg.model.use_lora:
            set_stage_trainable(model, stage, s.train_vision_tower)
        optimizer, scheduler = make_optimizer(model, cfg, steps, learning_rate=lr)
        for _ in range(steps):
            step += 1
            t0 = time.perf_counter()
            rows = [data.train[i] for i in sampler.next_batch(s.batch_size)]
            prompts = encode_rows(processor, rows, cfg, device)
            ids, mask = target_batch(processor.tokenizer, rows, device)
            logps = completion_logps(model, prompts, ids, mask)
            loss = -masked_mean(logps, mask)
            loss.backward()
            grad_norm = clip_and_step(model, optimizer, scheduler, cfg.optim.max_grad_norm)
            final = {"loss": loss.item(), "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0],
                     "time/step": time.perf_counter() - t0, "stage": 1.0 if stage == "projector" else 2.0,
                     **measured_vs_predicted(plan, log)}
            logger.log(step, final)
            if data.eval and cfg.training.eval_steps and step % cfg.training.eval_steps == 0 and step < total:
                logger.log_eval(step, evaluate(model, processor, data.eval, cfg, reward_funcs, device))
    if data.eval:
        metrics = evaluate(model, processor, data.eval, cfg, reward_funcs, device)
        logger.log_eval(step, metrics)
        final.update(metrics)
    logger.close()
    save_model(model, processor, out / "final")
    return final
