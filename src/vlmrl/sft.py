"""Supervised fine-tuning on the solutions, with LLaVA's two stages: projector only, then the language model."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from vlmrl.config import Config, save_config
from vlmrl.data.rows import sft_target
from vlmrl.algo.losses import masked_mean
from vlmrl.plan.planner import measured_vs_predicted, predict_for_sft
from vlmrl.run.rundir import guard_sft_folder
from vlmrl.run.datasets import encode_rows, load_datasets
from vlmrl.models.policy import load_policy
from vlmrl.rewards.scoring import load_reward_funcs
from vlmrl.engine.device import resolve_device, seed_everything


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
    return max((len(tokenizer(sft_target(rows[i]), add_special_tokens=False)["input_ids"]) + 1 for i in range(min(sample, len(rows)))), default=1)


def set_stage_trainable(model, stage: str, train_vision_tower: bool) -> None:
    """stage 'projector': only the projector; 'language': language model + projector (+ vision tower)."""
    from vlmrl.models.loading import language_model, output_head, projector, vision_tower

    model.requires_grad_(False)
    projector(model).requires_grad_(True)
    if stage == "language":
        language_model(model).requires_grad_(True)
        output_head(model).requires_grad_(True)
        if train_vision_tower:
            vision_tower(model).requires_grad_(True)


@guard_sft_folder  # output_dir rules: lock, a complete run reported complete, overwrite_output_dir (rundir.py)
def sft(cfg: Config, log=print) -> dict:
    """Run the configured SFT stages; saves output_dir/final and returns the last metrics."""
    from vlmrl.data.rows import PromptSampler
    from vlmrl.models.loading import save_model
    from vlmrl.engine.optim import clip_and_step, make_optimizer
    from vlmrl.models.prefix import LogprobOptions, completion_logps_for
    from vlmrl.models.router import capture_routing, micro_batch_aux_loss, routing_for
    from vlmrl.run.tracking import RunLogger, tracker_options
    from vlmrl.engine.distributed import DistributedError
    from vlmrl.engine.device import env_world

    if env_world()[0] > 1:
        raise DistributedError(
            f"vlmrl sft runs on one process; this launch has {env_world()[0]} (WORLD_SIZE). Run it without "
            "accelerate launch / torchrun (only vlmrl train runs on several processes, docs/scaling_out.md)"
        )
    out = Path(cfg.training.output_dir)
    save_config(cfg, out / "config.yaml")
    device = resolve_device(cfg.training.device)
    seed_everything(cfg.training.seed)
    model, processor = load_policy(cfg, device)
    routing = routing_for(model, cfg.algorithm.router_aux_loss_coef)  # MoE: the load-balancing loss, logged (and added)
    data = load_datasets(cfg, processor=processor)
    for line in data.reports:
        log(line)
    plan = predict_for_sft(cfg, log, longest_target(processor.tokenizer, data.train))  # logged; compared each step
    sampler = PromptSampler(len(data.train), seed=cfg.training.seed, shuffle=cfg.data.shuffle)
    reward_funcs, _ = load_reward_funcs(cfg)
    s = cfg.sft
    stages = [("projector", s.projector_steps, s.projector_learning_rate), ("language", s.steps, s.learning_rate)]
    total = s.projector_steps + s.steps
    logger = RunLogger(out, total_steps=total, **tracker_options(cfg), progress=cfg.logging.progress_bar, desc="SFT")
    step, final = 0, {}
    # GRPO's log-prob settings; one target per prompt leaves nothing to share, so one forward of prompt + target.
    opts = dataclasses.replace(LogprobOptions.from_config(cfg, device), shared_prefix=False)
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
            row_prompt = torch.arange(len(rows), device=device)
            with capture_routing(routing) as routed:
                logps = completion_logps_for(model, prompts, row_prompt, ids, mask, opts)
            loss = -masked_mean(logps, mask)
            aux = {}
            if routing is not None:
                aux_loss = micro_batch_aux_loss(routed, prompts, row_prompt, ids.shape[1])
                aux["router/aux_loss"] = aux_loss.item()
                loss = loss + cfg.algorithm.router_aux_loss_coef * aux_loss
            loss.backward()
            result = clip_and_step([p for p in model.parameters() if p.requires_grad], optimizer, scheduler, cfg.optim.max_grad_norm)
            if result.skipped:
                log(f"WARNING: SFT step {step}: loss {loss.item()} / gradient norm {result.grad_norm} not finite; step skipped, nothing changed")
            final = {
                "loss": loss.item(),
                "grad_norm": result.grad_norm,
                "nonfinite/skipped_steps": float(result.skipped),
                "lr": scheduler.get_last_lr()[0],
                "time/step": time.perf_counter() - t0,
                "stage": 1.0 if stage == "projector" else 2.0,
                **aux,
                **measured_vs_predicted(plan, log),
            }
            logger.log(step, final)
            if data.eval and cfg.training.eval_steps and step % cfg.training.eval_steps == 0 and step < total:
                evaluate_and_log(logger, step, model, processor, data.eval, cfg, reward_funcs, device)
    from vlmrl.checkpoints.files import save_folder_atomically

    # Before the last evaluation (its failure must not lose the training); under a temporary name, then renamed: a
    # full disk leaves no half folder, and is one line (CheckpointSaveError).
    save_folder_atomically(out / "final", lambda tmp: save_model(model, processor, tmp))
    if data.eval:
        try:
            final.update(evaluate_and_log(logger, step, model, processor, data.eval, cfg, reward_funcs, device, log))
        except Exception as e:  # noqa: BLE001 - the model is saved; report and keep it
            log(f"ERROR: the final evaluation failed ({type(e).__name__}: {e}); the trained model is saved in {out / 'final'}")
            final["eval/failed"] = 1.0
    logger.close()
    if cfg.logging.report:  # the same report.png as GRPO runs (loss, eval, memory, step time)
        from vlmrl.run.report import make_report

        make_report(out, title=f"SFT: {out.name} ({cfg.model.name_or_path})")
    if cfg.logging.progress_bar:
        from vlmrl.run.report import summary_table

        shown = {k: v for k, v in final.items() if k in SFT_SUMMARY_KEYS or k.startswith("eval/")}
        summary_table({k: f"{v:.4g}" for k, v in shown.items()}, title=f"SFT finished: {out}")
    return final


SFT_SUMMARY_KEYS = ("loss", "time/step", "mem/host_peak_rss", "mem/gpu_peak_reserved")


def evaluate_and_log(logger, step: int, model, processor, rows, cfg: Config, reward_funcs: dict, device, log=print) -> dict:
    """Greedy evaluation logged to eval.jsonl, with the first logging.log_completions answers (prompt, greedy answer,
    target, rewards, correct) in samples.jsonl, as GRPO logs its completions."""
    from vlmrl.evaluate import evaluate

    samples: list[dict] = []
    metrics = evaluate(model, processor, rows, cfg, reward_funcs, device, log, samples=samples)
    logger.log_eval(step, metrics)
    logger.log_samples(step, [{"kind": "eval", **sample} for sample in samples])
    return metrics
