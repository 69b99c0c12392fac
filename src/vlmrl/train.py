"""The GRPO training loop: a short loop over named phases, read top to bottom.

    rollout -> rewards (+ advantages) -> [refill: algorithm.dynamic_sampling] -> score (old / reference log-probs) ->
    update (num_iterations x optimizer steps) -> log -> maybe evaluate -> maybe save

Each phase is a module-level function over small dataclasses (`Rollout`, `Rewards`, `Scores`, `UpdateStats`, in
run/step_records.py); what lives for the whole run (model, engine, data, optimizer, logger, sizes) is one `Run`. The
math is in pure modules: advantages.py (ADVANTAGE_ESTIMATORS), losses.py (POLICY_LOSSES, AGGREGATIONS), optim.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlmrl.algo.advantages import ADVANTAGE_ESTIMATORS, group_std
from vlmrl.algo.batching import pack_by_tokens, split_by_rows
from vlmrl.algo.distill import distill_advantages, distill_metrics
from vlmrl.algo.dynamic_sampling import Picks, group_keep_mask, pick_groups, shares_full, source_rows
from vlmrl.algo.losses import aggregate, entropy_quantile_mask, masked_mean, per_token_loss
from vlmrl.algo.mismatch import ROLLOUT_CORRECTIONS, log_ratios, mismatch_metrics
from vlmrl.algo.turn_advantages import TURN_SCALES, token_advantages, turn_advantages, turn_index, turn_reward_matrix
from vlmrl.checkpoints.fingerprints import image_fingerprints
from vlmrl.checkpoints.state import resolve_sampling_seed, restore, restore_after_wrap, save
from vlmrl.config import AlgorithmConfig, Config
from vlmrl.data.embedded_images import image_cache_dir
from vlmrl.data.sampler import PromptSampler
from vlmrl.ending import finish_left
from vlmrl.engine.collectives import Shard
from vlmrl.engine.device import resolve_device, seed_everything
from vlmrl.engine.distributed import Distributed
from vlmrl.engine.frozen import FrozenPolicy, make_reference, make_teacher
from vlmrl.engine.host_alloc import pin_for_run
from vlmrl.engine.memory import memory_stats, reset_peaks, timed_phase, warn_if_near_capacity
from vlmrl.engine.offload import OptimizerParking, parking_enabled
from vlmrl.engine.oom import maybe_inject_oom, retry_on_oom
from vlmrl.engine.optim import allocate_optimizer_state, make_optimizer, total_optimizer_steps
from vlmrl.evaluate import EvaluationFailed, evaluate_on  # noqa: F401 - EvaluationFailed re-exported (tests, callers)
from vlmrl.models.judge import local_judge_on
from vlmrl.models.logprobs import entropies_collected, group_rows
from vlmrl.models.multiturn import logps_for_rows
from vlmrl.models.policy import load_policy
from vlmrl.models.prefix import LogprobOptions
from vlmrl.models.processing import decode, select_rows
from vlmrl.models.rollout import Completions, cat_completions, eos_token_ids
from vlmrl.models.router import capture_routing, micro_batch_aux_loss, record_routing, replay_routing, routing_for
from vlmrl.plan.planner import apply_auto_fit, data_shape_of, describe_data_shape, predict_for_run, prediction_vs_measured
from vlmrl.rewards.combine import reward_stats
from vlmrl.rewards.protocol import RewardLog
from vlmrl.rewards.scoring import load_reward_funcs, score_rollout
from vlmrl.rollout.backends import make_backend
from vlmrl.run.datasets import encode_rows, epochs_as_steps, load_datasets
from vlmrl.run.pipelined import after_update, behaviour_logps, pipelined_rollout, start_pipeline
from vlmrl.run.requests import sample_request
from vlmrl.run.rundir import EndingLeft, guard_run_folder, prepare_run
from vlmrl.run.signals import warn_if_no_learning_signal
from vlmrl.run.step_records import MicroBatch, PickedRows, Rewards, Rollout, Scores, Sizes, UpdateStats, picked_reward_log
from vlmrl.run.tool_rollout import load_run_tools, multiturn_metrics, rollout_record
from vlmrl.run.tracking import RunLogger, tracker_options
from vlmrl.skeleton import RunBase, run_steps

if TYPE_CHECKING:
    from vlmrl.rollout.base import RolloutBackend
    from vlmrl.rollout.pipeline import RolloutPipeline
    from vlmrl.tools.registry import Tool


class NonFiniteStop(RuntimeError):
    """training.max_nonfinite_steps optimizer steps in a row were skipped as non-finite; a checkpoint holds the last good state."""


@dataclass(kw_only=True)
class Run(RunBase):
    """What lives for the whole GRPO run (besides `RunBase`'s); built once by `start_run`."""

    shard: Shard  # this process's prompts and rows of every step
    reference: FrozenPolicy | None  # the frozen reference policy; None when algorithm.beta == 0
    reward_weights: dict[str, float]  # name -> weight of each reward in the total
    sizes: Sizes
    pad_id: int
    per_prompt_seed: bool  # rollout.sampling_seed resolved: one sampling stream per prompt
    parking: OptimizerParking  # memory.offload_optimizer_during_rollout (disabled: a no-op)
    nonfinite_streak: int = 0  # optimizer steps skipped in a row as non-finite
    tools: dict[str, Tool] = field(default_factory=dict)  # tools.tools loaded (multi-turn rollouts), empty for single-turn
    current_rows: list[int] = field(default_factory=list)  # dataset indices of this step's prompts on this process
    backend: RolloutBackend  # rollout.backend: what samples the rollouts (rollout/base.py), chosen once at start
    teacher: FrozenPolicy | None = None  # algorithm.teacher_path's frozen teacher (on-policy distillation), else None
    pipeline: RolloutPipeline | None = None  # rollout.max_staleness > 0: the producer sampling ahead (rollout/pipeline.py)


# ---------------------------------------------------------------- the loop
@guard_run_folder  # one run per output_dir (a lock), and the completion marker (rundir.py)
def train(cfg: Config, log=print, stop_after: int | None = None) -> dict:
    """Train with GRPO as `cfg` says; returns the final metrics (last step + last evaluation).

    Resumes from the newest valid checkpoint in output_dir unless training.resume says otherwise.
    SIGTERM / SIGINT finish the current step, write a checkpoint and return. `stop_after` simulates such
    a preemption after that step (tests and benchmarks use it). Around the steps: the run skeleton (skeleton.py).
    """

    cfg = epochs_as_steps(cfg, log)  # training.num_train_epochs decides max_steps (from the rows' count)
    try:
        run = start_run(cfg, log)
    except EndingLeft as left:  # training done, its ending stopped or killed: finish that, train nothing
        return finish_left(cfg, log if left.dist.is_main else (lambda *_: None), left, "train", "GRPO", SUMMARY_KEYS)
    final: dict = {}
    if cfg.training.val_before_train and run.data.eval and run.state["step"] == 0:
        final.update(evaluate_run(run))
        run.logger.log_eval(0, final)
    try:
        return run_steps(GRPOSteps(run), stop_after, final)
    finally:
        if run.pipeline is not None:
            run.pipeline.close()


def grpo_step(run: Run, step: int, phases: dict) -> dict:
    """One GRPO step, phase by phase (each timed into `phases`); returns the step's logged metrics."""
    with run.parking.parked_states():  # memory.offload_optimizer_during_rollout: moments wait in host memory
        with timed_phase("rollout", phases):
            samples = rollout(run, step)
        with timed_phase("rewards", phases):
            rewards = reward_and_advantages(run, samples, step)
        if run.cfg.algorithm.dynamic_sampling:
            with timed_phase("refill", phases):
                samples, rewards = dynamic_sample(run, step, samples, rewards)
        with timed_phase("scoring", phases):
            scores = score(run, samples, rewards)
            distill(run, samples, rewards, scores)  # algorithm.teacher_path: per-token advantages
    with timed_phase("update", phases):
        stats = update(run, samples, rewards, scores)
        if run.pipeline is not None:  # the new weights to the producer, the next step submitted
            after_update(run, step)
    return log_step(run, step, samples, rewards, stats, phases)


@dataclass
class GRPOSteps:
    """GRPO's steps for the run skeleton (skeleton.run_steps owns stops, last-good, checkpoints and the ending)."""

    run: Run
    kind: str = "train"
    title: str = "GRPO"
    summary_keys: tuple[str, ...] = ("reward", "loss", "kl", "completions/mean_length", "time/step", "mem/host_peak_rss", "mem/gpu_peak_reserved")

    def total(self) -> int:
        return self.run.cfg.training.max_steps

    def begin(self) -> None:
        pass

    def before_step(self, step: int) -> None:
        reset_peaks()

    def step(self, step: int, phases: dict, final: dict) -> dict:
        return {**final, **grpo_step(self.run, step, phases)}

    def where(self, phases: dict) -> str:
        return phase_of(phases, () if self.run.cfg.algorithm.dynamic_sampling else ("refill",))

    def evaluate_between(self, step: int) -> dict:
        return maybe_evaluate(self.run, step)

    def checkpoint(self, step: int) -> None:
        checkpoint(self.run, step)

    def after_save(self, step: int) -> None:
        stop_if_nonfinite(self.run, step)

    def evaluate_final(self, stop) -> dict:
        return maybe_evaluate(self.run, self.run.state["step"], stop)


PHASES = ("rollout", "rewards", "refill", "scoring", "update")


def phase_of(phases: dict, skipped: tuple[str, ...] = ()) -> str:
    """The phase a step was in: the first without a time in `phases`, of those the run has (all timed: logging)."""
    return next((f"phase {p}" for p in PHASES if f"time/{p}" not in phases and p not in skipped), "logging")


# ---------------------------------------------------------------- set-up and end
def start_run(cfg: Config, log) -> Run:
    """Engine, planner, model, reference, data, rewards, optimizer and, when resuming, their saved state. Raises
    rundir.EndingLeft (its `dist` set) when training is done and only the ending is left."""

    out = Path(cfg.training.output_dir)
    # Several processes (accelerate launch / torchrun): the process group, this rank's share of every step,
    # collectives. One process: nothing changes (distributed.py).
    dist = Distributed.from_env(cpu=resolve_device(cfg.training.device).type == "cpu")
    dist.use_sequence_parallel(cfg.training.sequence_parallel_size)  # Ulysses: the processes split each row (engine/ulysses.py)
    log = log if dist.is_main else (lambda *_: None)
    # multi-turn rollouts and ZeRO-3's gathers grew the host heap step after step (engine/host_alloc.py: gain and cost)
    pin_for_run(["multi-turn rollouts" if cfg.multiturn else None, dist.pins_host_allocator], log)
    if cfg.training.auto_fit:  # the planner's fastest config that fits, every change logged (planner.py)
        cfg = apply_auto_fit(cfg, log, world_size=dist.world_size, sharding=dist.planner_sharding, deepspeed=dist.planner_deepspeed)
    plan = predict_for_run(cfg, log, world_size=dist.world_size, sharding=dist.planner_sharding, deepspeed=dist.planner_deepspeed)
    device = dist.device(resolve_device(cfg.training.device))
    seed_everything(cfg.training.seed)
    try:  # refusals first, then config.yaml and the logs cut back (rundir.py)
        resume_from = prepare_run(cfg, log, dist)
    except EndingLeft as left:
        left.dist = dist
        raise
    t = cfg.training
    shard = dist.shard(cfg.prompts_per_step, cfg.rollout.num_generations, t.per_device_train_batch_size * t.gradient_accumulation_steps)
    if dist.world_size > 1:
        log(f"{dist.describe()}: {len(shard.prompts)} of {cfg.prompts_per_step} prompts per step on each process")
    dist.check_supported(save_steps=t.save_steps, save_final_model=t.save_final_model)
    dist.check_config(cfg)
    model, processor = load_policy(cfg, device)
    tools = load_run_tools(cfg, model)  # a bad spec fails before anything else is loaded
    reference = make_reference(model, cfg, device, fresh=resume_from is not None, engine=dist.engine)
    teacher = make_teacher(model, processor, cfg, device, engine=dist.engine)
    with dist.main_first():  # the built-in task's files are written once
        data = load_datasets(cfg, processor=processor)
    for line in data.reports:
        log(line)
    shape = data_shape_of(data.train, cfg.data.limit_images, cfg.data.max_frames, data.prompts.longest_text if data.prompts else None)
    if shape:  # the data is not the planner's default of one image per prompt: predict again from it
        what = f"from the data ({describe_data_shape(shape)}): "
        plan = predict_for_run(cfg, log, dist.world_size, dist.planner_sharding, what, dist.planner_deepspeed, **shape) or plan
    reward_funcs, reward_weights = load_reward_funcs(cfg, local_judge_on(device))
    optimizer, scheduler = make_optimizer(model, cfg.optim, total_optimizer_steps(cfg))
    sampler = PromptSampler(len(data.train), seed=t.seed, shuffle=cfg.data.shuffle)
    state = {"step": 0, "best_metric": None, "best_step": None}
    if resume_from is not None:
        state = restore(resume_from, cfg.training, model, optimizer, scheduler, sampler, log, dist)
    state["images"] = image_fingerprints([*data.train, *data.eval], image_cache_dir())  # stored with each checkpoint
    # DDP / FSDP2 / DeepSpeed wrap; one process: unchanged. With OOM recovery DDP syncs gradients after the processes agree.
    optimizer = dist.prepare(model, optimizer, t.per_device_train_batch_size, oom_recovery=cfg.memory.oom_recovery)
    for line in dist.prepared_report():
        log(line)
    if resume_from is not None:
        restore_after_wrap(resume_from, optimizer, dist)
    allocate_optimizer_state(optimizer)  # an OOM for AdamW's moments happens now, not inside optimizer.step
    tokenizer = processor.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids(model, tokenizer)[0]
    opts = LogprobOptions.from_config(cfg, device)
    per_prompt_seed = resolve_sampling_seed(cfg.rollout.sampling_seed, dist.world_size, state, log)  # world-size invariant on resume
    backend = make_backend(cfg, dist, model, processor, opts, per_prompt_seed, tools, pad_id, log)  # rollout.backend, chosen once
    pipeline = start_pipeline(cfg, dist, model, per_prompt_seed, pad_id, state, log)  # rollout.max_staleness > 0
    logger = RunLogger(
        out,
        total_steps=t.max_steps,
        initial_step=state["step"],
        logging_steps=cfg.logging.logging_steps,
        **tracker_options(cfg),
        progress=cfg.logging.progress_bar,
        desc="GRPO",
        is_main_process=dist.is_main,
    )
    return Run(
        cfg=cfg,
        out=out,
        dist=dist,
        shard=shard,
        device=device,
        model=model,
        processor=processor,
        reference=reference,
        data=data,
        reward_funcs=reward_funcs,
        reward_weights=reward_weights,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        logger=logger,
        log=log,
        opts=opts,
        sizes=Sizes.initial(cfg, state.pop("sizes", None)),
        state=state,
        plan=plan,
        pad_id=pad_id,
        per_prompt_seed=per_prompt_seed,
        parking=OptimizerParking(optimizer, parking_enabled(cfg.memory, dist, log)),
        routing=routing_for(model, cfg.algorithm.router_aux_loss_coef, cfg.algorithm.routing_replay),
        tools=tools,
        backend=backend,
        teacher=teacher,
        pipeline=pipeline,
    )


SUMMARY_KEYS = GRPOSteps.summary_keys  # the summary table's metrics (finish_left reads them too)


# ---------------------------------------------------------------- 1. rollout
def rollout(run: Run, step: int) -> Rollout:
    """G completions for each of this process's prompts. Every process draws the whole step's prompts (same
    sampler state everywhere) and keeps its shard. OOM -> fewer prompts per generate call, the same samples."""

    if run.pipeline is not None:  # rollout.max_staleness > 0: sampled ahead by the producer
        return pipelined_rollout(run, step)
    cfg = run.cfg
    batch_indices = run.sampler.next_batch(cfg.prompts_per_step)
    rows = [run.data.train[batch_indices[p]] for p in run.shard.prompts]
    run.current_rows = [batch_indices[p] for p in run.shard.prompts]
    prompts = encode_rows(run.processor, rows, cfg, run.device)
    run.model.eval()
    replay = cfg.algorithm.routing_replay
    recorded: dict = {}

    def sample_recorded(per_call: int) -> Completions:
        with record_routing(run.routing if replay != "off" else None, keep_weights=replay == "experts_and_weights") as recorder:
            out = sample(run, step, prompts, per_call)
        recorded["routes"] = recorder.routes(cfg.rollout.num_generations) if replay != "off" else None
        return out

    completions, run.sizes.generation = retry_on_oom(
        sample_recorded,
        run.sizes.generation or len(rows),
        "rollout",
        run.logger.info,
        enabled=cfg.memory.oom_recovery,
        peers=run.dist.oom_peers,  # every process halves together (or, FSDP2 / DeepSpeed, all stop)
    )
    G = cfg.rollout.num_generations
    return Rollout(
        rows=rows,
        prompts=prompts,
        completions=completions,
        texts=decode(run.processor, completions.ids),
        prompt_texts=[row["problem"] for row in rows for _ in range(G)],
        routes=recorded["routes"],
    )


def sample(run: Run, step: int, prompts: dict, prompts_per_call: int) -> Completions:
    """[P*G, T] completions of `prompts` from the run's rollout backend (rollout/base.py), seeded so that a redo
    (after an OOM, or after a resume) samples the same."""

    maybe_inject_oom("rollout", prompts_per_call)
    request = sample_request(run, step, run.current_rows, prompts, prompts_per_call)
    return run.backend.sample(request)


# ---------------------------------------------------------------- 2. rewards and advantages
def reward_and_advantages(run: Run, samples: Rollout, step: int) -> Rewards:
    """Rewards of this process's rows, gathered over processes so that advantages see whole groups and the whole
    batch (algorithm.advantage_estimator), then this process's rows of the advantages."""
    cfg, dist = run.cfg, run.dist
    G = cfg.rollout.num_generations
    reward_log = RewardLog()
    local, per_reward = score_rollout(
        cfg,
        run.reward_funcs,
        run.reward_weights,
        samples.rows,
        G,
        samples.texts,
        samples.completions,
        step,
        len(run.data.train),
        when=f"step {step}",
        reward_log=reward_log,
        trajectories=samples.completions.trajectories,
    )
    all_total, all_per_reward, lengths, truncated = dist.gather_rollout(run.shard, local, per_reward, samples.completions)
    rewards = rewards_of(run, local, all_total, all_per_reward, lengths, truncated, reward_log)
    bad = [r for t in samples.completions.trajectories or [] for r in t.bad_turn_rewards]
    if bad:
        run.logger.info(
            f"step {step}: {len(bad)} turn reward(s) the environment's step returned were not finite numbers (first: {bad[0]}); "
            "each counted as 0.0 (tools/bad_turn_rewards)"
        )
    if cfg.algorithm.turn_advantage == "per_turn" and rewards.nonfinite is None:
        rewards.advantages = per_turn_advantages(run, samples.completions, rewards.rewards).to(run.device)
    return rewards


def per_turn_advantages(run: Run, comp, rewards: torch.Tensor) -> torch.Tensor:
    """algorithm.turn_advantage=per_turn: [P*G, T] each model token's advantage, its turn's (algo/turn_advantages.py)
    from every process's per-turn rewards (gathered, so groups and the batch are whole) and the step's rewards [B*G]."""
    cfg, G = run.cfg, run.cfg.rollout.num_generations
    (steps,) = run.dist.gather_rows(run.shard, [list(t.turn_rewards) for t in comp.trajectories])
    turn_rewards, mask = turn_reward_matrix(steps, rewards)
    turn_adv = run.dist.local(run.shard, turn_advantages(turn_rewards, mask, G, cfg.algorithm.turn_discount, TURN_SCALES[cfg.advantage_estimator]))
    return token_advantages(turn_adv, run.dist.local(run.shard, mask), turn_index(comp.loss_mask.cpu()))


def rewards_of(run: Run, local: list, all_total: list, all_per_reward: dict, lengths, truncated, reward_log: RewardLog) -> Rewards:
    """The step's Rewards from its gathered rewards (global row order): advantages over whole groups and the whole batch,
    this process's rows of them, and what was not finite."""
    cfg, dist, G = run.cfg, run.dist, run.cfg.rollout.num_generations
    rewards = torch.tensor(all_total, dtype=torch.float32)
    advantages = ADVANTAGE_ESTIMATORS[cfg.advantage_estimator](rewards, G, cfg.algorithm)
    nonfinite = None
    if not torch.isfinite(rewards).all():
        bad = int((~torch.isfinite(rewards)).nonzero()[0])
        nonfinite = f"reward of row {bad} is {all_total[bad]!r} (not finite in float32); per reward: " + ", ".join(
            f"{name}={values[bad]!r}" for name, values in all_per_reward.items()
        )
    elif not torch.isfinite(advantages).all():
        nonfinite = f"advantages are not finite (rewards from {float(rewards.min()):.3g} to {float(rewards.max()):.3g} overflow float32)"
    return Rewards(
        local=local,
        rewards=rewards,
        per_reward=all_per_reward,
        advantages=dist.local(run.shard, advantages).to(run.device),
        lengths=lengths,
        truncated=truncated,
        nonfinite=nonfinite,
        reward_log=reward_log,
    )


# ---------------------------------------------------------------- 2b. dynamic sampling (DAPO)
ROUND_STRIDE = 2**32  # an extra generation batch samples under step + round x this: its own streams, never a real step's


def dynamic_sample(run: Run, step: int, samples: Rollout, rewards: Rewards) -> tuple[Rollout, Rewards]:
    """algorithm.dynamic_sampling (DAPO): groups whose dynamic_sampling_metric is equal across the group are dropped,
    and further batches of prompts are drawn (from the sampler, whose checkpointed state holds the draws, so a resume
    draws the same), rolled out and scored until every process's share of the batch holds kept groups, or
    dynamic_sampling_max_batches ran out: then the shares are topped up with filtered groups and a line says so.
    Kept or not is decided from the gathered rewards, the same on every process (algo/dynamic_sampling.py)."""
    a, G, P = run.cfg.algorithm, run.cfg.rollout.num_generations, run.cfg.prompts_per_step
    shards = [[rows[i] // G for i in range(0, len(rows), G)] for rows in run.shard.rows_per_rank]
    rounds = [(samples, rewards, list(run.current_rows))]
    keeps = [group_keep_mask(metric_values(rewards, a.dynamic_sampling_metric), G)]
    while not shares_full(keeps, shards) and len(rounds) < a.dynamic_sampling_max_batches:
        more = rollout(run, step + len(rounds) * ROUND_STRIDE)
        more_rewards = reward_and_advantages(run, more, step)
        rounds.append((more, more_rewards, list(run.current_rows)))
        keeps.append(group_keep_mask(metric_values(more_rewards, a.dynamic_sampling_metric), G))
    picks = pick_groups(keeps, shards)
    kept = sum(int(k.sum()) for k in keeps)
    metrics = {
        "dynamic_sampling/filtered_groups": float(len(keeps) * P - kept),
        "dynamic_sampling/extra_batches": float(len(rounds) - 1),
        "dynamic_sampling/extra_rollouts": float((len(rounds) - 1) * P * G),
        "dynamic_sampling/filled_groups": float(picks.filled),
        "dynamic_sampling/first_batch_kept": keeps[0].float().mean().item(),
        "dynamic_sampling/sampled_reward": torch.cat([r.rewards for _, r, _ in rounds]).double().mean().item(),
    }
    if picks.filled:
        run.logger.info(
            f"step {step}: dynamic sampling kept {P - picks.filled} of the {P} groups the batch needs after {len(rounds)} "
            f"generation batches (algorithm.dynamic_sampling_max_batches); {picks.filled} filtered groups fill the rest "
            "(no gradient from them under a group baseline)"
        )
    if not picks.identity:
        samples, rewards = picked_batch(run, rounds, picks)
    rewards.dynamic = metrics
    return samples, rewards


def metric_values(rewards: Rewards, name: str) -> torch.Tensor:
    """[B*G] algorithm.dynamic_sampling_metric of every row: the weighted reward, or one reward's values (None: NaN)."""
    if name == "reward":
        return rewards.rewards
    return torch.tensor([float("nan") if v is None else float(v) for v in rewards.per_reward[name]], dtype=torch.float64)


def picked_batch(run: Run, rounds: list[tuple[Rollout, Rewards, list]], picks: Picks) -> tuple[Rollout, Rewards]:
    """The Rollout and Rewards of the picked groups: each process takes its share from its own rows of the rounds
    (pick_groups keeps every share within its process), prompts encoded again, rewards and advantages of the whole
    picked batch recomputed from the rounds' gathered values."""
    G, P = run.cfg.rollout.num_generations, run.cfg.prompts_per_step
    where = [(r, run.shard.prompts.index(p)) for r, p in (picks.sources[k] for k in run.shard.prompts)]  # (round, local prompt)
    local_rows = [[i * G + g for g in range(G)] for _, i in where]
    picked = PickedRows(rounds, [r for r, _ in where], local_rows)
    rows = [rounds[r][0].rows[i] for r, i in where]
    run.current_rows = [rounds[r][2][i] for r, i in where]
    samples = Rollout(
        rows=rows,
        prompts=encode_rows(run.processor, rows, run.cfg, run.device),
        completions=cat_completions([rounds[r][0].completions.take_rows(rs) for r, rs in zip(picked.round_of, local_rows)], run.pad_id),
        texts=picked.values(lambda rollout, _: rollout.texts),
        prompt_texts=picked.values(lambda rollout, _: rollout.prompt_texts),
    )
    every = source_rows(picks, P, G)
    per_reward = {name: [v for _, r, _ in rounds for v in r.per_reward[name]] for name in rounds[0][1].per_reward}
    gathered = [r for _, r, _ in rounds]
    rewards = rewards_of(
        run,
        picked.values(lambda _, r: r.local),
        torch.cat([r.rewards for r in gathered])[every].tolist(),
        {name: [values[i] for i in every] for name, values in per_reward.items()},
        torch.cat([r.lengths for r in gathered])[every],
        torch.cat([r.truncated for r in gathered])[every],
        picked_reward_log(picked, len(samples.texts)),
    )
    return samples, rewards


# ---------------------------------------------------------------- 3. scoring
def loss_mask_of(completion_mask: torch.Tensor, truncated: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """[N, T] tokens that count in the loss: the generated ones (up to and including EOS), minus every token of a
    truncated row ([N] bool: no EOS within max_completion_length) when algorithm.mask_truncated_completions."""
    loss_mask = completion_mask.clone()
    if mask_truncated:
        loss_mask[truncated] = 0
    return loss_mask


def score(run: Run, samples: Rollout, rewards: Rewards) -> Scores:
    """Old log-probs and reference log-probs (only when beta > 0), without gradients, in micro-batches of
    sizes.scoring (halved on OOM). Old log-probs are scored once per rollout, before any optimizer step, whenever
    some optimizer step uses rows sampled before the policy last changed (cfg.reuses_rollout: the rollout spans
    several optimizer steps, or num_iterations > 1); otherwise every row is used once, by the policy that sampled
    it, and the update's own detached log-probs are the old ones (ratio 1)."""
    a = run.cfg.algorithm
    comp = samples.completions
    loss_mask = loss_mask_of(comp.mask if comp.loss_mask is None else comp.loss_mask, comp.truncated, a.mask_truncated_completions)
    entropies = None
    old = None
    if run.cfg.scores_old_logps and rewards.nonfinite is None:
        old, entropies = logps_without_grad(run, run.model, samples, loss_mask, entropies=a.top_entropy_quantile < 1.0, replay=True)
    ref = None
    if run.reference is not None and rewards.nonfinite is None:
        with run.reference as ref_model:
            ref, _ = logps_without_grad(run, ref_model, samples, loss_mask)
    scores = Scores(loss_mask=loss_mask, old_logps=old, ref_logps=ref)
    if entropies is not None:
        scores.entropy_mask = step_entropy_masks(run, entropies, loss_mask.to(entropies.device))
    sampling = samples.completions.sampling_logps
    if old is not None and sampling is not None:
        sampling = sampling.to(old.device)
        own = comp.mask if comp.loss_mask is None else comp.loss_mask  # the sampler's log-probs exist for the model's tokens only
        scores.mismatch = mismatch_metrics(log_ratios(sampling, old, own.to(old.device)))
        if a.rollout_correction != "none":
            correct = ROLLOUT_CORRECTIONS[a.rollout_correction]
            scores.is_weights = correct(old, sampling, loss_mask.to(old.device), a.rollout_correction_min, a.rollout_correction_max)
    elif old is not None and a.rollout_correction != "none":
        raise ValueError(
            f"algorithm.rollout_correction={a.rollout_correction} needs the sampler's log-probs, which this decode path "
            "(HF generate: memory.shared_prefix=false, or a model without the shared-prefix path) does not report; "
            "set memory.shared_prefix=true or algorithm.rollout_correction=none"
        )
    if run.pipeline is not None and a.rollout_correction == "none" and rewards.nonfinite is None:
        scores.old_logps = behaviour_logps(samples, old, run.device)  # stale rows: the ratio against their sampler
    return scores


def distill(run: Run, samples: Rollout, rewards: Rewards, scores: Scores) -> None:
    """algorithm.teacher_path (on-policy distillation): the frozen teacher scores the student's sampled tokens (its
    own processor encodes the prompts; the completion ids are the student's), and the advantages become per token,
    algo/distill.distill_advantages of the sampling policy's log-probs (scores.old_logps) and the teacher's. A
    teacher log-prob that is not finite skips the step's update like a non-finite reward. No teacher: nothing."""
    if run.teacher is None or rewards.nonfinite is not None:
        return
    a = run.cfg.algorithm
    as_teacher_reads = dataclasses.replace(samples, prompts=encode_rows(run.teacher.processor, samples.rows, run.cfg, run.device))
    with run.teacher as teacher_model:
        teacher, _ = logps_without_grad(run, teacher_model, as_teacher_reads, scores.loss_mask, frozen=run.teacher)
    student, mask = scores.old_logps.to(teacher.device), scores.loss_mask.to(teacher.device)
    if not torch.isfinite(teacher[mask.bool()]).all():
        rewards.nonfinite = "the teacher's log-probs of the sampled tokens are not finite (algorithm.teacher_path)"
        return
    rewards.advantages = distill_advantages(rewards.advantages, student, teacher, mask, a.distill_coef, a.distill_with_rewards).to(run.device)
    rewards.distill = distill_metrics(student, teacher, mask)


def step_entropy_masks(run: Run, entropies: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[P*G, T] algorithm.top_entropy_quantile's tokens: for each optimizer step's rows, the loss tokens whose entropy
    (under the policy that sampled them) is in the top quantile of the step's loss tokens on every process; one
    threshold per step, so the kept tokens do not depend on how the step is cut into micro-batches."""
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    per_step, q = run.shard.rows_per_opt_step, run.cfg.algorithm.top_entropy_quantile
    for start in range(0, loss_mask.shape[0], per_step):
        rows = slice(start, start + per_step)
        pooled = run.dist.all_values(entropies[rows][loss_mask[rows].bool()])
        out[rows] = entropy_quantile_mask(entropies[rows], loss_mask[rows], q, pooled=pooled)
    return out


def logps_without_grad(
    run: Run, scoring_model, samples: Rollout, loss_mask: torch.Tensor, entropies: bool = False, replay: bool = False, frozen=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([P*G, T] per-token log-probs of the rollout under `scoring_model` (the policy through the engine, or a
    frozen copy directly), and with `entropies` their [P*G, T] entropies from the same LM-head chunks).
    replay: the policy's own forward, which replays the rollout's expert choices when algorithm.routing_replay is on.
    frozen: the FrozenPolicy holding `scoring_model` (default the reference; the teacher for distillation)."""

    comp = samples.completions
    frozen = run.reference if frozen is None else frozen
    if scoring_model is run.model:
        call = run.dist.call
    elif getattr(frozen, "runner", None) is not None:
        call = frozen.runner  # the frozen copy inside the engine (ZeRO-3: its hooks gather each module)
    else:
        call = lambda fn, *args: fn(scoring_model, *args)  # noqa: E731

    def attempt(size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.zeros(tuple(comp.ids.shape), dtype=torch.float32, device=run.device)
        ent = torch.zeros_like(out) if entropies else None
        with torch.no_grad():
            for idx in micro_batches(run, samples, list(range(comp.ids.shape[0])), size):
                maybe_inject_oom("scoring", len(idx))
                mb = micro_batch(run, samples, loss_mask, idx)
                collecting = entropies_collected() if entropies else contextlib.nullcontext([])  # entropies cost a second pass over the head
                with collecting as collected, replayed_routing(run, samples, idx, mb, replay), run.dist.sequence_split(scoring_model):
                    logps = call(logps_for_rows, mb.prompts, mb.row_prompt, mb.ids, mb.completion_mask, run.opts, mb.tool_vision)
                out[idx, : mb.ids.shape[1]] = logps.to(out.device)
                if ent is not None:
                    ent[idx, : mb.ids.shape[1]] = collected[-1].to(out.device)
        return out, ent

    (logps, ent), run.sizes.scoring = retry_on_oom(
        attempt, run.sizes.scoring, "scoring", run.logger.info, enabled=run.cfg.memory.oom_recovery, peers=run.dist.oom_peers
    )
    return logps, ent


def replayed_routing(run: Run, samples: Rollout, idx: list[int], mb: MicroBatch, on: bool = True):
    """algorithm.routing_replay's context for the policy's forward over rows `idx` (router.replay_routing), or a no-op."""
    if not on or samples.routes is None:
        return contextlib.nullcontext()
    unique, _ = group_rows(samples.prompt_of_row[idx])
    routes = samples.routes.for_rows(unique.tolist(), idx, mb.ids.shape[1])
    return replay_routing(run.routing, routes, mb.row_prompt, run.cfg.algorithm.routing_replay)


def model_tokens(completion_mask: torch.Tensor, comp: Completions, idx: list[int], width: int) -> torch.Tensor:
    """[n, width] the micro-batch's tokens the model sampled: the completion mask, or a multi-turn rollout's loss mask."""
    return completion_mask if comp.loss_mask is None else comp.loss_mask[idx, :width].to(completion_mask.device)


def micro_batches(run: Run, samples: Rollout, rows: list[int], size: int) -> list[list[int]]:
    """`rows` cut into micro-batches of `size` rows, or of at most `size` tokens (memory.max_tokens_per_micro_batch)."""
    if run.cfg.memory.max_tokens_per_micro_batch is None:
        return split_by_rows(rows, size)
    return pack_by_tokens(rows, samples.completions.lengths[rows].tolist(), size, samples.prompts["input_ids"].shape[1])


def micro_batch(run: Run, samples: Rollout, loss_mask: torch.Tensor, idx: list[int]) -> MicroBatch:

    comp = samples.completions
    width = max(1, int(comp.lengths[idx].max()))
    unique, row_prompt = group_rows(samples.prompt_of_row[idx])
    return MicroBatch(
        prompts=select_rows(samples.prompts, unique.tolist()),
        row_prompt=row_prompt.to(run.device),
        ids=comp.ids[idx, :width].to(run.device),
        loss_mask=loss_mask[idx, :width].to(run.device),
        completion_mask=comp.mask[idx, :width].to(run.device),
        tool_vision=[comp.tool_vision[i] for i in idx] if comp.tool_vision is not None else None,
    )


# ---------------------------------------------------------------- 4. update
def update(run: Run, samples: Rollout, rewards: Rewards, scores: Scores) -> UpdateStats:
    """num_iterations passes over the rollout; each optimizer step sees per_device_train_batch_size x
    gradient_accumulation_steps rows (with several processes, each its 1/W share: shard.rows_per_opt_step), cut
    into micro-batches of sizes.update rows or tokens (halved on OOM: the same step redone, partial gradients
    dropped). A step whose gradient norm is not finite changes nothing (optim.clip_and_step)."""

    cfg = run.cfg
    stats = UpdateStats(ratio_dev=[0.0] * cfg.algorithm.num_iterations, mismatch=dict(scores.mismatch))
    if rewards.nonfinite is not None:
        stats.skipped.append(rewards.nonfinite)
        run.nonfinite_streak += 1
        return stats
    run.model.train()
    n_rows, per_step = samples.completions.ids.shape[0], run.shard.rows_per_opt_step
    rollout_tokens_per_step = 0.0
    if cfg.loss_aggregation == "token_mean_rollout":  # TRL's dapo normaliser: the rollout's tokens, spread over its steps
        rollout_tokens_per_step = max(1.0, run.dist.all_sum([float(scores.loss_mask.sum())])[0] / cfg.optimizer_steps_per_rollout)
    for iteration in range(cfg.algorithm.num_iterations):
        for start in range(0, n_rows, per_step):
            step_rows = list(range(start, start + per_step))
            # Counts of the optimizer step over every process (a collective: outside the attempts an OOM may redo).
            norm = run.dist.step_normaliser(
                [scores.loss_mask[step_rows]], cfg.rollout.max_completion_length, chunk_rows=cfg.training.per_device_train_batch_size
            )
            norm = dataclasses.replace(norm, rollout_tokens_per_step=rollout_tokens_per_step)
            # Without scored old log-probs, the first step's own forward is the trainer's side of the mismatch.
            measure = not stats.mismatch and iteration == 0 and start == 0 and samples.completions.sampling_logps is not None
            step_stats, run.sizes.update = retry_on_oom(
                functools.partial(accumulate, run, samples, rewards, scores, step_rows, norm, measure_mismatch=measure),
                run.sizes.update,
                "update",
                run.logger.info,
                on_oom=functools.partial(run.optimizer.zero_grad, set_to_none=True),
                enabled=cfg.memory.oom_recovery,
                peers=run.dist.oom_peers,
            )
            run.dist.sync_gradients()  # DDP with OOM recovery: only now, once every process has its gradients
            result = run.dist.optimizer_step(run.optimizer, run.scheduler, cfg.optim.max_grad_norm)
            stats.grad_norm.append(result.grad_norm)
            run.nonfinite_streak = run.nonfinite_streak + 1 if result.skipped else 0
            if result.skipped:
                stats.skipped.append(
                    f"gradient norm {result.grad_norm} (iteration {iteration + 1}, rows {start}-{start + per_step - 1}); "
                    + (step_stats.nonfinite_where or "every micro-batch loss was finite")
                )
                continue
            stats.loss.append(step_stats.loss)
            stats.router_aux += step_stats.router_aux
            stats.kl += step_stats.kl
            stats.clip_ratio += step_stats.clip_ratio
            stats.ratio_dev[iteration] = max(stats.ratio_dev[iteration], step_stats.ratio_dev)
            if step_stats.log_ratios:
                stats.mismatch = mismatch_metrics(torch.cat(step_stats.log_ratios))
    return stats


@dataclass
class StepGradients:
    """What one optimizer step's accumulation leaves besides the gradients."""

    loss: float = 0.0
    kl: list[float] = field(default_factory=list)
    clip_ratio: list[float] = field(default_factory=list)
    ratio_dev: float = 0.0
    router_aux: list[float] = field(default_factory=list)
    nonfinite_where: str | None = None  # the first micro-batch whose loss or log-probs were not finite
    log_ratios: list[torch.Tensor] = field(default_factory=list)  # measure_mismatch: trainer vs sampler, per micro-batch


def accumulate(
    run: Run, samples: Rollout, rewards: Rewards, scores: Scores, step_rows: list[int], norm, size: int, measure_mismatch: bool = False
) -> StepGradients:
    """Forward/backward of one optimizer step's rows in micro-batches of `size`; gradients accumulate in the model.
    `norm`: the step's loss normaliser over every process (losses.Normaliser), so the gradient is the global batch's."""

    cfg, dist = run.cfg, run.dist
    a = cfg.algorithm
    micro = micro_batches(run, samples, step_rows, size)
    out = StepGradients()
    for k, idx in enumerate(micro):
        maybe_inject_oom("update", len(idx))
        mb = micro_batch(run, samples, scores.loss_mask, idx)
        width = mb.ids.shape[1]
        # Gradients synced once: in the last backward, or by sync_gradients. Ulysses spans backward (recomputed layers).
        with dist.no_sync(last=k == len(micro) - 1), dist.sequence_split(run.model):
            # Routing replay spans backward too: checkpointed layers run their routers again there.
            with replayed_routing(run, samples, idx, mb):
                with capture_routing(run.routing) as routed:  # MoE routers' logits (dense models: nothing recorded)
                    logps = dist.call(logps_for_rows, mb.prompts, mb.row_prompt, mb.ids, mb.completion_mask, run.opts, mb.tool_vision, grad=True)
                old = scores.old_logps[idx, :width] if scores.old_logps is not None else logps.detach()
                ref = scores.ref_logps[idx, :width] if scores.ref_logps is not None else None
                adv = rewards.advantages[idx]
                adv = adv[:, :width] if adv.dim() == 2 else adv  # per-token advantages (distillation): this micro-batch's width
                tok_loss, parts = per_token_loss(logps, old, adv, a, ref, mask=mb.loss_mask, is_weights=policy_weights(scores, idx, width))
                loss = aggregate(tok_loss, mb.loss_mask, cfg.loss_aggregation, norm.for_rows([i - step_rows[0] for i in idx]))
                if run.routing is not None:
                    aux = micro_batch_aux_loss(routed, mb.prompts, mb.row_prompt, width)
                    out.router_aux.append(aux.item())
                    # This micro-batch's share of the step's mean over rows (every process's rows).
                    loss = loss + a.router_aux_loss_coef * aux * (len(idx) / norm.num_sequences)
                dist.backward(loss)
        value = loss.item()
        if out.nonfinite_where is None and not (torch.isfinite(loss) and torch.isfinite(logps[mb.loss_mask.bool()]).all()):
            out.nonfinite_where = f"micro-batch {k + 1} of {len(micro)} (rows {idx[0]}-{idx[-1]}): loss {value}"
        out.loss += value
        out.clip_ratio.append(masked_mean(parts["is_clipped"].float(), mb.loss_mask).item())
        out.ratio_dev = max(out.ratio_dev, float(((parts["ratio"] - 1).abs() * mb.loss_mask).max()))
        if "kl" in parts:
            out.kl.append(masked_mean(parts["kl"], mb.loss_mask).item())
        if measure_mismatch:
            sampling = samples.completions.sampling_logps[idx, :width].to(logps.device)
            out.log_ratios.append(log_ratios(sampling, logps.detach(), model_tokens(mb.completion_mask, samples.completions, idx, width)).cpu())
    return out


def policy_weights(scores: Scores, idx: list[int], width: int) -> torch.Tensor | None:
    """[n, width] per-token factors of the policy loss (not the KL): the rollout correction's weights times the
    entropy-quantile mask, or None when neither is on."""
    weights = scores.is_weights[idx, :width] if scores.is_weights is not None else None
    if scores.entropy_mask is not None:
        keep = scores.entropy_mask[idx, :width].float()
        weights = keep if weights is None else weights * keep
    return weights


def stop_if_nonfinite(run: Run, step: int) -> None:
    """After training.max_nonfinite_steps skipped steps in a row: a checkpoint of the last good state (skipped steps
    changed nothing), then stop with what was not finite."""
    limit = run.cfg.training.max_nonfinite_steps
    if not limit or run.nonfinite_streak < limit:
        return
    checkpoint(run, step)
    raise NonFiniteStop(
        f"{run.nonfinite_streak} optimizer steps in a row were skipped because a reward, advantage, loss or gradient "
        f"was not finite (last at step {step}; metrics.jsonl: nonfinite/*). The checkpoint of step {step} holds the "
        "last good weights. Check the reward functions' ranges, lower optim.learning_rate, or raise training.max_nonfinite_steps."
    )


# ---------------------------------------------------------------- 5. log, 6. evaluate, 7. save
def log_step(run: Run, step: int, samples: Rollout, rewards: Rewards, stats: UpdateStats, phases: dict) -> dict:
    """One metrics line (reduced over processes), the planner's prediction next to the measured peak, samples."""

    cfg, G = run.cfg, run.cfg.rollout.num_generations
    for why in stats.skipped:
        run.logger.info(f"WARNING: step {step}: skipped a non-finite optimizer step, nothing changed: {why}")
    wide = rewards.rewards.double()  # float32 rewards near its limit overflow a float32 mean
    metrics = {
        **rewards.reward_log.metrics(),  # first: a name vlmrl logs itself keeps vlmrl's value
        **rewards.dynamic,
        "reward": wide.mean().item(),
        "reward_std": wide.std().item(),
        "frac_reward_zero_std": (group_std(rewards.rewards, G) == 0).float().mean().item(),
        **reward_stats(rewards.per_reward),
        **rewards.distill,
        "loss": _mean(stats.loss),
        "kl": _mean(stats.kl),
        "clip_ratio": _mean(stats.clip_ratio),
        **{f"ratio_dev/iter{i + 1}": d for i, d in enumerate(stats.ratio_dev)},
        "grad_norm": _mean([g for g in stats.grad_norm if g == g and abs(g) != float("inf")]),
        "nonfinite/skipped_steps": float(len(stats.skipped)),
        **({"router/aux_loss": _mean(stats.router_aux)} if run.routing is not None else {}),
        **stats.mismatch,
        **run.backend.metrics,  # vllm/sync_seconds, vllm/probe_max_abs_logp_diff
        **(run.pipeline.metrics if run.pipeline is not None else {}),  # staleness/*, pipeline/*
        "lr": run.scheduler.get_last_lr()[0],
        "completions/mean_length": rewards.lengths.float().mean().item(),
        "completions/truncated_frac": rewards.truncated.float().mean().item(),
        "time/step": sum(v for k, v in phases.items() if k.startswith("time/")),
        "epoch": run.sampler.epoch,
        ("micro_batch_size" if cfg.memory.max_tokens_per_micro_batch is None else "micro_batch_tokens"): run.sizes.update,
        **multiturn_metrics(samples.completions),  # multi-turn: completions/mean_length as the model's tokens only
        **phases,
        **memory_stats(),
        **run.dist.sequence_metrics(),  # sequence_parallel/tokens(_per_process): the rows were split
    }
    # Several processes: loss summed (each holds its share), ratio deviation / memory / times max, rest mean.
    maxed = tuple(k for k in metrics if k.startswith("ratio_dev/") or k in ("mismatch/max_ratio", "mismatch/max_abs_logp_diff"))
    metrics = run.dist.reduce_metrics(metrics, sum_keys=("loss", "tools/bad_turn_rewards"), max_keys=maxed)
    metrics.update(prediction_vs_measured(run.plan, metrics, run.logger.info))
    warn_if_near_capacity(metrics, cfg.memory.warn_fraction, run.logger.info)
    warn_if_no_learning_signal(metrics, cfg, run.state, run.logger.info)
    run.logger.log(step, metrics)
    if cfg.logging.log_completions:
        run.logger.log_samples(
            step,
            [
                {
                    **rewards.reward_log.sample_columns(i, len(samples.texts)),  # first: vlmrl's own fields win
                    "prompt": samples.prompt_texts[i],
                    "completion": samples.texts[i],
                    "reward": rewards.local[i],
                    "advantage": rewards.advantages[i].mean().item(),
                    "solution": samples.rows[i // G].get("solution"),
                    **rollout_record(samples.completions, samples.prompts, i, G),
                    **turn_record(cfg.algorithm, samples.completions, rewards.advantages, i),
                }
                for i in range(min(cfg.logging.log_completions, len(samples.texts)))
            ],
        )
    return metrics


def turn_record(algorithm: AlgorithmConfig, comp, advantages: torch.Tensor, i: int) -> dict:
    """samples.jsonl's per-turn fields of row i under algorithm.turn_advantage=per_turn ({} otherwise): the reward the
    environment gave each turn and every token's advantage (0.0 off the loss mask), to check the estimator from outside."""
    if algorithm.turn_advantage != "per_turn" or comp.trajectories is None:
        return {}
    n = int(comp.lengths[i])
    return {"turn_rewards": list(comp.trajectories[i].turn_rewards), "token_advantages": advantages[i, :n].float().tolist()}


def maybe_evaluate(run: Run, step: int, stop=None) -> dict:
    """Evaluate at every training.eval_steps and after the last step; keeps the best metric for rotation. `stop`: a
    GracefulStop that may end the (final) evaluation between batches (evaluate.EvaluationStopped)."""
    t = run.cfg.training
    if not run.data.eval or not (step == t.max_steps or (t.eval_steps and step % t.eval_steps == 0)):
        return {}
    metrics = evaluate_run(run, stop)
    run.logger.log_eval(step, metrics)
    value = metrics.get(t.metric_for_best)
    if value is not None and (run.state["best_metric"] is None or value > run.state["best_metric"]):
        run.state["best_metric"], run.state["best_step"] = value, step
    return metrics


def evaluate_run(run: Run, stop=None) -> dict:
    """Greedy evaluation of the held-out rows by every process of the run (the protocol: evaluate.evaluate_on)."""
    d = run.data
    return evaluate_on(
        run.dist, run.model, run.processor, d.eval, run.cfg, run.reward_funcs, run.device, run.logger.info, stop=stop, backend=run.backend
    )


def checkpoint(run: Run, step: int) -> None:
    run.state["sizes"] = asdict(run.sizes)
    if run.pipeline is not None:  # the rollouts of the steps after this one (rollout/pipeline.py)
        run.state["rollout_queue"] = run.pipeline.saved(step)
    save(run.cfg, run.out, step, run.model, run.optimizer, run.scheduler, run.sampler, run.state, run.logger.info, run.dist)
    run.saved_at = time.monotonic()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
