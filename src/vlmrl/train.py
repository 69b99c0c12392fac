"""The GRPO training loop: one function, read top to bottom.

rollout -> rewards -> advantages -> (old / reference log-probs) -> num_iterations x updates -> log -> eval.
"""

from __future__ import annotations

import copy
import contextlib
import math
import time
from pathlib import Path

import torch

from .advantages import group_advantages, group_std
from .batching import pack_by_tokens, split_by_rows
from .config import Config
from .logprobs import group_rows
from .losses import aggregate, masked_mean, per_token_loss
from .planner import apply_auto_fit, predict_for_run, prediction_vs_measured
from .prefix import completion_logps_for
from .rewards import compute_rewards, reward_stats
from .rollout import Completions, generate
from .rundir import guard_run_folder, prepare_run
from .runtime import encode_rows, load_datasets, load_policy, load_reward_funcs, resolve_device, reward_columns, seed_everything


@guard_run_folder  # one run per output_dir (lock), completion marker (rundir.py)
def train(cfg: Config, log=print, stop_after: int | None = None) -> dict:
    """Train with GRPO as `cfg` says; returns the final metrics (last step + last evaluation).

    Resumes from the newest valid checkpoint in output_dir unless training.resume says otherwise.
    SIGTERM / SIGINT finish the current step, write a checkpoint and return. `stop_after` simulates such
    a preemption after that step (tests and benchmarks use it).
    """
    from .checkpoint import GracefulStop
    from .data import PromptSampler
    from .distributed import Distributed, cat_completions, prompt_seed
    from .evaluate import evaluate
    from .memory import memory_stats, phase_memory, reset_peaks
    from .oom import maybe_inject_oom, retry_on_oom
    from .models import save_model
    from .processing import decode, select_rows
    from .rollout import eos_token_ids
    from .tracking import RunLogger

    out = Path(cfg.training.output_dir)
    # Several processes (accelerate launch / torchrun): the process group, this rank's share of every step,
    # collectives. One process: nothing changes (distributed.py).
    dist = Distributed.from_env(cpu=resolve_device(cfg.training.device).type == "cpu")
    log = log if dist.is_main else (lambda *_: None)
    if cfg.training.auto_fit:  # the planner's fastest config that fits, every change logged (planner.py)
        cfg = apply_auto_fit(cfg, log, world_size=dist.world_size, sharding=dist.planner_sharding)
    plan = predict_for_run(cfg, log, world_size=dist.world_size, sharding=dist.planner_sharding)  # logged next to the measured peak
    device = dist.device(resolve_device(cfg.training.device))
    seed_everything(cfg.training.seed)
    resume_from = prepare_run(cfg, log, dist)  # refusals first, then config.yaml and the logs cut back (rundir.py)
    G, a, r = cfg.rollout.num_generations, cfg.algorithm, cfg.rollout
    shard = dist.shard(cfg.prompts_per_step, G, cfg.training.per_device_train_batch_size * cfg.training.gradient_accumulation_steps)
    per_prompt_seed = r.sampling_seed == "prompt" or (r.sampling_seed == "auto" and dist.world_size > 1)
    if dist.world_size > 1:
        log(f"{dist.describe()}: {len(shard.prompts)} of {cfg.prompts_per_step} prompts per step on each process")
    if dist.engine == "deepspeed" and (cfg.training.save_steps or cfg.training.save_final_model):
        raise dist.unsupported("writing checkpoints and the final model from DeepSpeed states (set training.save_steps=0 and "
                               "training.save_final_model=false, or use FSDP2 / DDP)")
    model, processor = load_policy(cfg, device)
    tokenizer = processor.tokenizer
    reference = make_reference(model, cfg, device, fresh=resume_from is not None)
    with dist.main_first():  # the built-in task's files are written once
        data = load_datasets(cfg)
    for line in data.reports:
        log(line)
    reward_funcs, reward_weights = load_reward_funcs(cfg)
    optimizer, scheduler = make_optimizer(model, cfg, total_optimizer_steps(cfg))
    sampler = PromptSampler(len(data.train), seed=cfg.training.seed, shuffle=cfg.data.shuffle)
    state = {"step": 0, "best_metric": None, "best_step": None}
    if resume_from is not None:
        state = restore(resume_from, cfg, model, optimizer, scheduler, sampler, log, dist)
    optimizer = dist.prepare(model, optimizer, cfg.training.per_device_train_batch_size)  # DDP / FSDP2 / DeepSpeed wrap; one process: unchanged
    if dist.engine == "fsdp2":
        how = "fully_shard applied by vlmrl (accelerate enables FSDP on GPUs only)" if dist.fsdp2_by_hand else "accelerate"
        log(f"FSDP2 via {how}: this process holds {100 * dist.local_parameter_fraction():.1f}% of the parameters")
    if resume_from is not None:
        restore_after_wrap(resume_from, optimizer, dist)
    autocast = _autocast(cfg, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids(model, tokenizer)[0]

    logger = RunLogger(out, total_steps=cfg.training.max_steps, initial_step=state["step"], logging_steps=cfg.logging.logging_steps,
                       tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress_bar, desc="GRPO",
                       is_main_process=dist.is_main)

    def run_eval() -> dict:
        """Greedy evaluation: the main process alone (one process, DDP), or every process through the engine
        when parameters are sharded (they all take part in the all-gathers). Every process gets the metrics."""
        if dist.sharded:
            with dist.gathered_for_generation(cfg.memory.generation_gather):
                return dist.call(evaluate, processor, data.eval, cfg, reward_funcs, device)
        return dist.broadcast(evaluate(model, processor, data.eval, cfg, reward_funcs, device) if dist.is_main else None)

    final: dict = {}
    if cfg.training.val_before_train and data.eval and state["step"] == 0:
        final.update(run_eval())
        logger.log_eval(0, final)

    def checkpoint(step: int) -> None:
        save(cfg, out, step, model, optimizer, scheduler, sampler, state, logger.info, dist)

    # SIGTERM / SIGINT set stop.requested; the step in progress finishes, then a checkpoint is written.
    with GracefulStop() as stop, logger:
        # Piece sizes that OOM recovery may shrink; kept for the rest of the run and in checkpoints.
        sizes = state.setdefault("sizes", {"train": cfg.memory.max_tokens_per_micro_batch or cfg.training.per_device_train_batch_size,
                                            "generation": cfg.memory.generation_prompts_per_call})
        chunk = cfg.memory.logprob_chunk_tokens
        for step in range(state["step"] + 1, cfg.training.max_steps + 1):
            t_start = time.perf_counter()
            reset_peaks()
            phases: dict[str, float] = {}

            # 1. Rollout: G completions for each prompt (OOM -> fewer prompts per generate call, same samples).
            # Every process draws the whole step's prompts (same sampler state everywhere) and keeps its shard.
            batch_indices = sampler.next_batch(cfg.prompts_per_step)
            rows = [data.train[batch_indices[p]] for p in shard.prompts]
            prompts = encode_rows(processor, rows, cfg, device)
            model.eval()

            def rollout(prompts_per_call: int) -> Completions:
                maybe_inject_oom("rollout", prompts_per_call)

                def sample(batch: dict, per_call: int) -> Completions:
                    return dist.call(generate, tokenizer, batch, num_generations=G, max_new_tokens=r.max_completion_length,
                                     temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, prompts_per_call=per_call,
                                     min_new_tokens=r.min_completion_length, shared_prefix=cfg.memory.shared_prefix)

                with autocast, dist.gathered_for_generation(cfg.memory.generation_gather):
                    if not per_prompt_seed:
                        # A redo after an OOM samples the same way; each process its own stream (one process: rank 0, W 1).
                        torch.manual_seed((cfg.training.seed * 1_000_003 + step) * dist.world_size + dist.rank)
                        return sample(prompts, prompts_per_call)
                    # rollout.sampling_seed=prompt: each prompt from its own stream, whichever process samples it.
                    pieces = []
                    for i, position in enumerate(shard.prompts):
                        torch.manual_seed(prompt_seed(cfg.training.seed, step, position))
                        pieces.append(sample(select_rows(prompts, [i]), 1))
                    return cat_completions(pieces, pad_id)

            with phase_memory("rollout", phases):
                comp, sizes["generation"] = retry_on_oom(rollout, sizes["generation"] or len(rows), "rollout", logger.info,
                                                         enabled=cfg.memory.oom_recovery)
            t_rollout = time.perf_counter()

            # 2. Rewards, 3. advantages.
            texts = decode(processor, comp.ids)
            prompt_texts = [row["problem"] for row in rows for _ in range(G)]
            total, per_reward = compute_rewards(reward_funcs, reward_weights, prompt_texts, texts, reward_columns(rows, G))
            # The whole step's rewards (every process's rows, global order): advantages over whole groups and batch.
            all_total, all_per_reward, all_lengths, all_truncated = dist.gather_rollout(shard, total, per_reward, comp)
            rewards = torch.tensor(all_total, dtype=torch.float32)
            advantages = dist.local(shard, group_advantages(rewards, G, a.scale_rewards)).to(device)
            loss_mask = comp.mask.clone()
            if a.mask_truncated_completions:
                loss_mask[comp.truncated] = 0
            prompt_of_row = torch.arange(len(rows)).repeat_interleave(G)

            def micro_inputs(idx: list[int]) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
                """The micro-batch's unique prompts (each image encoded once), which prompt each row continues,
                and the completions trimmed to the longest one."""
                width = max(1, int(comp.lengths[idx].max()))
                ids, mask = comp.ids[idx, :width].to(device), loss_mask[idx, :width].to(device)
                unique, row_prompt = group_rows(prompt_of_row[idx])
                return select_rows(prompts, unique.tolist()), row_prompt.to(device), ids, mask, comp.mask[idx, :width].to(device)

            def split(rows: list[int], size: int) -> list[list[int]]:
                """Micro-batches of `size` rows, or of at most `size` tokens (memory.max_tokens_per_micro_batch)."""
                if cfg.memory.max_tokens_per_micro_batch is None:
                    return split_by_rows(rows, size)
                return pack_by_tokens(rows, comp.lengths[rows].tolist(), size, prompts["input_ids"].shape[1])

            def scored(scoring_model) -> torch.Tensor:
                all_rows = list(range(comp.ids.shape[0]))
                # The policy (and LoRA's adapter-disabled reference) goes through the engine; a frozen copy directly.
                run = dist.call if scoring_model is model else (lambda fn, *args: fn(scoring_model, *args))
                logps, sizes["train"] = retry_on_oom(
                    lambda size: run(score, micro_inputs, split(all_rows, size), comp.ids.shape, r.temperature, autocast, chunk,
                                     cfg.memory.shared_prefix, cfg.memory.group_vision),
                    sizes["train"], "scoring", logger.info, enabled=cfg.memory.oom_recovery)
                return logps

            # Old log-probs are needed only when a rollout is reused; reference log-probs only when beta > 0.
            with phase_memory("scoring", phases):
                old_logps = scored(model) if a.num_iterations > 1 else None
                ref_logps = None
                if reference is not None:
                    with reference as ref_model:
                        ref_logps = scored(ref_model)
            t_scored = time.perf_counter()

            # 4. num_iterations x updates over the rollout; each optimizer step sees per_device_train_batch_size x
            # gradient_accumulation_steps rows, cut into micro-batches of sizes["train"] rows or tokens (smaller after an OOM).
            # With several processes each one runs its 1/W share of every optimizer step (shard.rows_per_opt_step).
            model.train()
            rows_per_opt_step = shard.rows_per_opt_step
            stats: dict[str, list[float]] = {"loss": [], "kl": [], "clip_ratio": [], "grad_norm": []}
            ratio_dev = [0.0] * a.num_iterations  # max |ratio - 1| per pass: 0 on-policy, > 0 once the rollout is reused

            def accumulate(step_rows: list[int], mb: int, iteration: int) -> dict[str, list[float]]:
                """Forward/backward of one optimizer step's rows in micro-batches of mb; returns its stats."""
                micro = split(step_rows, mb)
                # Counts of the optimizer step over every process, so the gradient is the one of the global batch.
                norm = dist.step_normaliser([loss_mask[m] for m in micro], r.max_completion_length)
                out: dict[str, list[float]] = {"loss": [0.0], "kl": [], "clip_ratio": [], "ratio_dev": [0.0]}
                for k, idx in enumerate(micro):
                    maybe_inject_oom("update", len(idx))
                    batch, row_prompt, ids, mask, gen_mask = micro_inputs(idx)
                    with dist.no_sync(last=k == len(micro) - 1):  # gradients are synced once, after the last micro-batch
                        with autocast:
                            logps = dist.call(completion_logps_for, batch, row_prompt, ids, gen_mask, r.temperature, chunk,
                                              cfg.memory.shared_prefix, cfg.memory.group_vision, grad=True)
                        width = ids.shape[1]
                        old = old_logps[idx, :width] if old_logps is not None else logps.detach()
                        ref = ref_logps[idx, :width] if ref_logps is not None else None
                        tok_loss, parts = per_token_loss(logps, old, advantages[idx], a.epsilon, cfg.epsilon_high, ref, a.beta)
                        loss = aggregate(tok_loss, mask, a.loss_type, norm)
                        dist.backward(loss)
                    out["loss"][0] += loss.item()
                    out["clip_ratio"].append(masked_mean(parts["is_clipped"].float(), mask).item())
                    out["ratio_dev"][0] = max(out["ratio_dev"][0], float(((parts["ratio"] - 1).abs() * mask).max()))
                    if "kl" in parts:
                        out["kl"].append(masked_mean(parts["kl"], mask).item())
                return out

            with phase_memory("update", phases):
                for iteration in range(a.num_iterations):
                    for start in range(0, comp.ids.shape[0], rows_per_opt_step):
                        step_rows = list(range(start, start + rows_per_opt_step))
                        step_stats, sizes["train"] = retry_on_oom(
                            lambda mb: accumulate(step_rows, mb, iteration), sizes["train"], "update", logger.info,
                            on_oom=lambda: optimizer.zero_grad(set_to_none=True), enabled=cfg.memory.oom_recovery)
                        stats["grad_norm"].append(clip_and_step(model, optimizer, scheduler, cfg.optim.max_grad_norm, dist))
                        for key in ("loss", "kl", "clip_ratio"):
                            stats[key] += step_stats[key]
                        ratio_dev[iteration] = max(ratio_dev[iteration], step_stats["ratio_dev"][0])
            t_end = time.perf_counter()

            # 5. Log.
            metrics = {
                "reward": rewards.mean().item(),
                "reward_std": rewards.std().item(),
                "frac_reward_zero_std": (group_std(rewards, G) == 0).float().mean().item(),
                **reward_stats(all_per_reward),
                "loss": _mean(stats["loss"]),
                "kl": _mean(stats["kl"]) if stats["kl"] else 0.0,
                "clip_ratio": _mean(stats["clip_ratio"]),
                **{f"ratio_dev/iter{i + 1}": d for i, d in enumerate(ratio_dev)},
                "grad_norm": _mean(stats["grad_norm"]),
                "lr": scheduler.get_last_lr()[0],
                "completions/mean_length": all_lengths.float().mean().item(),
                "completions/truncated_frac": all_truncated.float().mean().item(),
                "time/rollout": t_rollout - t_start,
                "time/scoring": t_scored - t_rollout,
                "time/update": t_end - t_scored,
                "time/step": t_end - t_start,
                "epoch": sampler.epoch,
                ("micro_batch_size" if cfg.memory.max_tokens_per_micro_batch is None else "micro_batch_tokens"): sizes["train"],
                **phases,
                **memory_stats(),
            }
            # Several processes: loss summed (each holds its share), ratio deviation / memory / times max, rest mean.
            metrics = dist.reduce_metrics(metrics, sum_keys=("loss",), max_keys=tuple(k for k in metrics if k.startswith("ratio_dev/")))
            metrics.update(prediction_vs_measured(plan, metrics, logger.info))
            warn_if_near_capacity(metrics, cfg.memory.warn_fraction, logger.info)
            logger.log(step, metrics)
            if cfg.logging.log_completions:
                logger.log_samples(step, [
                    {"prompt": prompt_texts[i], "completion": texts[i], "reward": total[i], "advantage": advantages[i].item(),
                     "solution": rows[i // G].get("solution")}
                    for i in range(min(cfg.logging.log_completions, len(texts)))
                ])
            final = {**final, **metrics}

            # 6. Evaluate, 7. maybe save.
            last = step == cfg.training.max_steps
            state["step"] = step
            if data.eval and (last or (cfg.training.eval_steps and step % cfg.training.eval_steps == 0)):
                eval_metrics = run_eval()
                logger.log_eval(step, eval_metrics)
                final.update(eval_metrics)
                value = eval_metrics.get(cfg.training.metric_for_best)
                if value is not None and (state["best_metric"] is None or value > state["best_metric"]):
                    state["best_metric"], state["best_step"] = value, step
            # A signal that reached some processes only stops them all at the same step.
            preempted = dist.any(stop.requested or (stop_after is not None and step >= stop_after))
            if (cfg.training.save_steps and (step % cfg.training.save_steps == 0 or last)) or (preempted and not last):
                checkpoint(step)
            if preempted and not last:
                why = stop.signal_name or f"stop_after={stop_after}"
                logger.info(f"stopped by {why} after step {step}; run the same command again to resume (training.resume=auto)")
                break

    if state["step"] == cfg.training.max_steps:
        if cfg.training.save_final_model:
            save_final(model, processor, out / "final", dist, save_model, cfg, log)
        if not dist.is_main:
            return final
        if cfg.logging.report:
            from .report import make_report

            make_report(out, title=f"GRPO: {out.name} ({cfg.model.name_or_path})")
        if cfg.logging.progress_bar:
            from .report import summary_table

            shown = {k: v for k, v in final.items() if k in SUMMARY_KEYS or k.startswith("eval/")}
            summary_table({k: f"{v:.4g}" for k, v in shown.items()}, title=f"GRPO finished: {out}")
    return final


SUMMARY_KEYS = ("reward", "loss", "kl", "completions/mean_length", "time/step", "mem/host_peak_rss", "mem/gpu_peak_reserved")


def restore(path: Path, cfg: Config, model, optimizer, scheduler, sampler, log, dist=None) -> dict:
    """Load weights, optimizer, scheduler, sampler and RNG from a checkpoint; returns the loop state.
    Every process loads the same full state (output_dir on a file system they all see); each its own RNG."""
    from safetensors.torch import load_file

    from .checkpoint import CheckpointError, is_sharded_checkpoint, is_weights_only, load_training_state, read_trainer_state, restore_rng

    # The config compatibility check ran in rundir.prepare_run, before anything was written.
    saved_world = int(read_trainer_state(path).get("world_size", 1))
    if dist is not None and saved_world != dist.world_size:
        # Checkpoints hold full (consolidated) states and the sampler is global, so a new world size continues the
        # same run; batch sizes are global, so the math does not change either.
        log(f"resuming {path} (saved by {saved_world} process(es)) on {dist.world_size}: model, optimizer, scheduler "
            f"and sampler are full copies; RNG streams of processes the checkpoint has no file for start fresh")
    sharded = is_sharded_checkpoint(path)  # weights and optimizer load after the engine wraps the model (restore_after_wrap)
    if not sharded:
        load_trainable_weights(model, path / "model", load_file)
    if is_weights_only(path):
        if not cfg.training.resume_weights_only:
            raise CheckpointError(f"{path} holds weights only (save_only_model); it cannot resume a run exactly. "
                                  "Set training.resume_weights_only=true to start a NEW schedule from its weights.")
        log(f"WARNING: starting a new schedule (step 0, fresh optimizer) from the weights of {path}")
        return {"step": 0, "best_metric": None, "best_step": None}
    # FSDP2 loads the optimizer after sharding (restore_after_wrap): its state must follow the sharded parameters.
    ts = load_training_state(path, None if sharded or (dist is not None and dist.engine == "fsdp2") else optimizer, scheduler)
    sampler.load_state_dict(ts["sampler_state"])
    if dist is None or dist.world_size == 1:
        restore_rng(path, warn=log)
    else:
        dist.restore_rng(path, saved_world, cfg.training.seed, log)
    log(f"resumed from {path} at step {ts['global_step']} (epoch {ts['epoch']}, {ts['samples_consumed']} prompts consumed)")
    out = {"step": ts["global_step"], "best_metric": ts.get("best_metric"), "best_step": ts.get("best_step")}
    if ts.get("sizes"):
        out["sizes"] = ts["sizes"]  # micro-batch sizes that OOM recovery settled on
    return out


def restore_after_wrap(path: Path, optimizer, dist) -> None:
    """What loads after the engine has wrapped the model: a SHARDED checkpoint's torch.distributed.checkpoint files
    (weights and optimizer, re-sharded for any world size), or under FSDP2 the full optimizer state (read by the
    main process) scattered into the shards. Nothing otherwise (restore loaded it all)."""
    from .checkpoint import OPTIMIZER_FILE, SHARDED_DIR, is_sharded_checkpoint, is_weights_only, safe_torch_load
    from .distributed import load_sharded_state

    if is_sharded_checkpoint(path):
        load_sharded_state(dist.model, path / SHARDED_DIR, None if is_weights_only(path) else optimizer)
    elif dist.engine == "fsdp2" and not is_weights_only(path):
        dist.load_full_optimizer_state(optimizer, safe_torch_load(path / OPTIMIZER_FILE) if dist.is_main else None)


def save(cfg: Config, out: Path, step: int, model, optimizer, scheduler, sampler, state: dict, log, dist=None) -> None:
    """One atomic checkpoint written by the main process: full model and optimizer (all processes hold the same
    ones under DDP; FSDP2 gathers them to the main process first, so the checkpoint has the single-process layout
    and resumes on any world size), the global sampler, and every process's RNG stream (rng_state_<rank>.pt)."""
    import shutil

    from .checkpoint import CheckpointSaveError, is_storage_error, save_checkpoint
    from .config import to_dict

    t = cfg.training
    trainer_state = {"epoch": sampler.epoch, "samples_consumed": step * cfg.prompts_per_step, "sampler_state": sampler.state_dict(),
                     "best_metric": state["best_metric"], "best_step": state["best_step"], "sizes": state.get("sizes")}
    many = dist is not None and dist.world_size > 1
    save_weights = lambda p: save_trainable_weights(model, p)  # noqa: E731
    if many:
        if dist.engine == "deepspeed":
            raise dist.unsupported("checkpoints of DeepSpeed engines")
        trainer_state.update(world_size=dist.world_size, engine=dist.engine)
        if dist.sharded_checkpoints:  # every process writes its shards, then they move into the checkpoint
            staging = out / f".tmp-sharded-{step}"
            try:
                dist.save_sharded_state(staging, None if t.save_only_model else optimizer)
            except BaseException as e:  # DCP raises the same CheckpointException (a BaseException) on every process
                if not is_storage_error(e):
                    raise
                if dist.is_main:
                    shutil.rmtree(staging, ignore_errors=True)
                return on_save_error(CheckpointSaveError(f"could not write the sharded state of checkpoint {step} to {staging}: "
                                                         f"{str(e).splitlines()[0]}; earlier checkpoints in {out} are intact"), t, log)
            save_weights = lambda p: move_sharded_state(staging, p, model)  # noqa: E731
            optimizer = None
            trainer_state["state_format"] = "sharded"
        elif dist.engine == "fsdp2":  # every process takes part in the gathers
            model_state, optim_state = dist.full_state_dicts(None if t.save_only_model else optimizer)
            save_weights = lambda p: save_trainable_weights(model, p, model_state)  # noqa: E731
            optimizer = FullState(optim_state)
    rng_states = dist.gather_rng_states() if many else None  # every process takes part
    error = None
    if not many or dist.is_main:
        try:
            save_checkpoint(out, step, save_model=save_weights, optimizer=optimizer, scheduler=scheduler,
                            trainer_state=trainer_state, config=to_dict(cfg), weights_only=t.save_only_model,
                            save_total_limit=t.save_total_limit, warn=log, rng_states=rng_states)
        except CheckpointSaveError as e:
            error = e
    if many:
        message = dist.broadcast(str(error) if error else None)  # every process stops, or none does
        error = error or (CheckpointSaveError(message) if message else None)
    if error is not None:
        on_save_error(error, t, log)


def on_save_error(error, training, log, what: str = "the previous checkpoint stays the newest") -> None:
    """training.on_save_error: stop -> raise the CheckpointSaveError (the CLI prints it, exit 2); continue -> warn."""
    if training.on_save_error == "stop":
        raise error
    log(f"WARNING: {error}; going on (training.on_save_error=continue), {what}")


def move_sharded_state(staging: Path, model_dir: Path, model) -> None:
    """Into a checkpoint being written: the processes' shards as <checkpoint>/sharded, the model config in model/."""
    from .checkpoint import SHARDED_DIR
    from .models import unwrap

    staging.rename(model_dir.parent / SHARDED_DIR)
    unwrap(model).config.save_pretrained(model_dir)


class FullState:
    """A gathered optimizer state (FSDP2) where save_checkpoint expects an optimizer: state_dict() returns it."""

    def __init__(self, state: dict | None):
        self.state = state

    def state_dict(self) -> dict | None:
        return self.state


def save_final(model, processor, folder: Path, dist, save_model, cfg: Config | None = None, log=print) -> None:
    """output_dir/final as a plain HF folder, written by the main process. FSDP2: the weights are gathered to the
    main process, which loads them into an unsharded CPU copy of the policy (LoRA merged from there). Written
    under a temporary name and swapped in (a failure leaves no half folder); a storage error follows
    training.on_save_error on every process (stop: CheckpointSaveError; continue: a warning, no final model)."""
    from .checkpoint import CheckpointSaveError, save_folder_atomically

    if dist.engine == "deepspeed":
        raise dist.unsupported("saving the final model of DeepSpeed engines")
    error = None
    try:
        if dist.engine == "fsdp2":
            state, _ = dist.full_state_dicts(None)
            if dist.is_main:
                plain, _ = load_policy(cfg, torch.device("cpu"))
                plain.load_state_dict(state)
                save_folder_atomically(folder, lambda tmp: save_model(plain, processor, tmp))
        elif dist.is_main:
            save_folder_atomically(folder, lambda tmp: save_model(model, processor, tmp))
    except CheckpointSaveError as e:
        error = e
    if dist.world_size > 1:
        message = dist.broadcast(str(error) if error else None)  # every process stops, or none does
        error = error or (CheckpointSaveError(message) if message else None)
    dist.barrier()
    if error is not None:
        if cfg is None:
            raise error
        on_save_error(error, cfg.training, log if dist.is_main else (lambda *_: None),
                      "the run has no final model (the last checkpoint, if any, is intact)")


def save_trainable_weights(model, folder: Path, state_dict: dict | None = None) -> None:
    """HF format: the full model for full fine-tuning, only the adapter for LoRA (peft's save_pretrained).
    `state_dict`: the model's full state gathered from sharded parameters (FSDP2) instead of its own."""
    model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)  # None: the model's own


def load_trainable_weights(model, folder: Path, load_file) -> None:
    """Inverse of save_trainable_weights, into the already-built model (so freezing / LoRA stay as configured)."""
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        return
    from .checkpoint import CheckpointError

    # safetensors only (no pickled .bin), from this folder only; the concrete class never runs code the folder ships.
    try:
        loaded = type(model).from_pretrained(folder, dtype=next(model.parameters()).dtype, use_safetensors=True, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the weights in {folder} (vlmrl reads model.safetensors only): {e}") from e
    with torch.no_grad():
        for (name, p), (name2, q) in zip(model.state_dict(keep_vars=True).items(), loaded.state_dict(keep_vars=True).items()):
            if name != name2:
                raise RuntimeError(f"checkpoint parameter {name2} does not match the model's {name}")
            p.copy_(q)


def score(model, micro_inputs, micro_batches: list[list[int]], shape, temperature: float, autocast, chunk_tokens: int = 1024,
          shared_prefix: bool = True, group_vision: bool = True) -> torch.Tensor:
    """Per-token log-probs [B*G, T] of the rollout under `model`, in micro-batches, without grad."""
    from .oom import maybe_inject_oom

    out = torch.zeros(tuple(shape), dtype=torch.float32, device=next(model.parameters()).device)
    with torch.no_grad():
        for idx in micro_batches:
            maybe_inject_oom("scoring", len(idx))
            batch, row_prompt, ids, _, gen_mask = micro_inputs(idx)
            with autocast:
                logps = completion_logps_for(model, batch, row_prompt, ids, gen_mask, temperature, chunk_tokens, shared_prefix, group_vision)
            out[idx, : ids.shape[1]] = logps.to(out.device)
    return out


def warn_if_near_capacity(metrics: dict, fraction: float, warn) -> None:
    peak, capacity = metrics.get("mem/gpu_peak_reserved"), metrics.get("mem/gpu_capacity")
    if peak is not None and capacity and peak > fraction * capacity:
        warn(f"WARNING: GPU peak {peak:.1f} GiB is above {fraction:.0%} of {capacity:.1f} GiB (memory.warn_fraction); "
             "an OOM is close: consider gradient checkpointing, bf16, or a smaller micro-batch")


class _Reference:
    """Context manager yielding the reference policy: the adapter-disabled model (LoRA) or a frozen copy.
    A copy placed on the CPU (memory.ref_placement=cpu) is moved to the device only while it scores."""

    def __init__(self, model, frozen_copy=None, device=None, offload: bool = False):
        self.model, self._copy, self._ctx = model, frozen_copy, None
        self.device, self.offload = device, offload
        if self._copy is not None and offload:
            self._copy.to("cpu")

    def __enter__(self):
        if self._copy is not None:
            return self._copy.to(self.device) if self.offload else self._copy
        from .models import reference_disabled_adapter

        self._ctx = reference_disabled_adapter(self.model)
        self._ctx.__enter__()
        return self.model

    def __exit__(self, *exc):
        if self._copy is not None and self.offload:
            self._copy.to("cpu")
            from .oom import free_memory

            free_memory()
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None


def make_reference(model, cfg: Config, device, fresh: bool = False):
    """None when beta == 0 (no reference is loaded at all). With LoRA the reference is the same model with
    its adapter disabled. Otherwise a frozen copy of the initial policy: a deep copy at the start, or a
    fresh load from model.name_or_path when resuming (the policy then holds trained weights)."""
    if cfg.algorithm.beta == 0:
        return None
    if cfg.model.use_lora:
        return _Reference(model)
    initial = load_policy(cfg, device)[0] if fresh else copy.deepcopy(model)
    return _Reference(model, initial.eval().requires_grad_(False), device, offload=cfg.memory.ref_placement == "cpu")


def total_optimizer_steps(cfg: Config) -> int:
    per_rollout = cfg.generation_batch_size // (cfg.training.per_device_train_batch_size * cfg.training.gradient_accumulation_steps)
    return cfg.training.max_steps * cfg.algorithm.num_iterations * per_rollout


def make_optimizer(model, cfg: Config, num_steps: int, learning_rate: float | None = None):
    from transformers import get_scheduler

    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: check model.freeze_vision_tower / train_projector_only / use_lora")
    optimizer = torch.optim.AdamW(params, lr=o.learning_rate if learning_rate is None else learning_rate,
                                  betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon, weight_decay=o.weight_decay)
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[o.lr_scheduler_type]
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=math.ceil(o.warmup_ratio * num_steps), num_training_steps=num_steps)
    return optimizer, scheduler


def clip_and_step(model, optimizer, scheduler, max_grad_norm: float, dist=None) -> float:
    if dist is not None and dist.runner is not None:
        return dist.clip_and_step(optimizer, scheduler, max_grad_norm)  # gradients already synced across processes
    params = [p for p in model.parameters() if p.requires_grad]
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    else:
        norm = torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _autocast(cfg: Config, device: torch.device):
    if not cfg.training.bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
