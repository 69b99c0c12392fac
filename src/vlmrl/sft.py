"""Supervised fine-tuning on the solutions, with LLaVA's two stages (projector only, then the language model), as a
full run on the same skeleton as GRPO (train.py):

    start (engine, planner, output folder, model, data, rewards, logger) -> per step: the global batch drawn, this
    process's share cut into micro-batches (OOM: halved, the effective batch kept), one optimizer step -> log ->
    maybe evaluate -> maybe checkpoint -> the shared ending (ending.py: final model, evaluation, report)

Every engine (one process, DDP, FSDP2, and DeepSpeed through the same engine seam), `training.save_steps`
checkpoints with exact resume (the stage whose optimizer a checkpoint holds is in it), SIGTERM / SIGINT: the step
finishes, a checkpoint is written, one line, exit 0. `sft.batch_size` is the effective batch over every process;
`sft.micro_batch_size` only changes how it is cut (its loss is normalised by the target tokens of the whole batch),
so 8 x 2, 4 x 4 and 2 x 8 on two processes train the same weights (to float rounding).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmrl.config import Config, DataConfig, SFTConfig
from vlmrl.data.sft_targets import sft_target
from vlmrl.evaluate import evaluate_on
from vlmrl.plan.planner import measured_vs_predicted, predict_for_sft
from vlmrl.ending import finish_left
from vlmrl.run.rundir import EndingLeft, guard_run_folder, prepare_run
from vlmrl.run.datasets import encode_rows, load_datasets
from vlmrl.checkpoints.fingerprints import image_fingerprints
from vlmrl.engine.host_alloc import pin_for_run
from vlmrl.models.judge import local_judge_on
from vlmrl.models.policy import load_policy
from vlmrl.rewards.scoring import load_reward_funcs
from vlmrl.engine.device import resolve_device, seed_everything
from vlmrl.checkpoints.files import is_sharded_checkpoint, is_weights_only, read_trainer_state
from vlmrl.checkpoints.state import restore, restore_after_wrap
from vlmrl.data.errors import DataError
from vlmrl.data.sampler import PromptSampler
from vlmrl.data.embedded_images import image_cache_dir
from vlmrl.engine.distributed import Distributed, DistributedError
from vlmrl.engine.oom import maybe_inject_oom, retry_on_oom
from vlmrl.engine.optim import allocate_optimizer_state, make_optimizer
from vlmrl.models.conversations import ConversationError, sft_view, target_tensors
from vlmrl.models.loading import language_model, output_head, projector, vision_tower
from vlmrl.models.prefix import LogprobOptions, completion_logps_for
from vlmrl.models.router import capture_routing, micro_batch_aux_loss, routing_for
from vlmrl.run.tracking import RunLogger, tracker_options
from vlmrl.skeleton import RunBase, run_steps


def target_batch(tokenizer, rows: list[dict], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, T] right-padded target ids, their attention mask and loss mask: a row's target + EOS (loss on all of it),
    or a conversation's turns after its prompt (loss on the assistant turns only: conversations.py)."""

    return target_tensors(tokenizer, rows, sft_target, device)


def sft_row(processor, row: dict, d: DataConfig) -> dict:
    """A conversation row split into prompt turns and assistant targets (conversations.sft_view); others as they are."""

    try:
        return sft_view(processor, row, min(len(row["images"]), d.limit_images), len(row.get("videos") or []), d.system_prompt)
    except ConversationError as e:
        raise DataError(str(e)) from None


def longest_target(tokenizer, rows, sample: int = 512) -> int:
    """Tokens of the longest target (+ EOS) among the first `sample` rows: the planner's completion length."""
    return max((len(tokenizer(sft_target(rows[i]), add_special_tokens=False)["input_ids"]) + 1 for i in range(min(sample, len(rows)))), default=1)


def set_stage_trainable(model, stage: str, train_vision_tower: bool) -> None:
    """stage 'projector': only the projector; 'language': language model + projector (+ vision tower)."""

    model.requires_grad_(False)
    projector(model).requires_grad_(True)
    if stage == "language":
        language_model(model).requires_grad_(True)
        output_head(model).requires_grad_(True)
        if train_vision_tower:
            vision_tower(model).requires_grad_(True)


@dataclass(frozen=True)
class Stage:
    """One SFT stage: steps `first`..`last` of the run (1-based, inclusive) at learning rate `lr`."""

    name: str  # "projector" (stage 1) or "language" (stage 2)
    first: int
    last: int
    lr: float

    @property
    def steps(self) -> int:
        return self.last - self.first + 1


def stages_of(s: SFTConfig, num_rows: int) -> list[Stage]:
    """The run's stages with at least one step; stage 2 lasts sft.steps, or ceil(sft.epochs x rows / batch_size)."""
    language = s.steps if s.epochs is None else max(1, math.ceil(s.epochs * num_rows / s.batch_size))
    out, first = [], 1
    for name, steps, lr in (("projector", s.projector_steps, s.projector_learning_rate), ("language", language, s.learning_rate)):
        if steps:
            out.append(Stage(name, first, first + steps - 1, lr))
            first += steps
    return out


@dataclass(kw_only=True)
class SFTRun(RunBase):
    """What lives for the whole SFT run (besides `RunBase`'s); built once by `start_sft`. The optimizer and
    scheduler are the current stage's (`enter_stage`)."""

    stages: list[Stage]
    micro: int  # rows per forward/backward on this process (halved on OOM, kept in checkpoints)
    resume_from: Path | None = None  # the checkpoint the first stage entered restores from
    saved_stage: str | None = None  # the stage whose optimizer that checkpoint holds
    stage: Stage | None = None

    @property
    def total(self) -> int:
        return self.stages[-1].last if self.stages else 0

    def stage_at(self, step: int) -> Stage:
        return next(s for s in self.stages if s.first <= step <= s.last)


@guard_run_folder  # one run per output_dir (a lock); the ending writes the completion marker (ending.py)
def sft(cfg: Config, log=print, stop_after: int | None = None) -> dict:
    """Run the configured SFT stages; saves output_dir/final and returns the last metrics. Resumes from the newest
    valid checkpoint unless training.resume says otherwise; SIGTERM / SIGINT finish the step, write a checkpoint and
    return. `stop_after` simulates such a stop after that step (tests). Around the steps: the run skeleton."""

    try:
        run = start_sft(cfg, log)
    except EndingLeft as left:  # training done, its ending stopped or killed: finish that, train nothing
        return finish_left(cfg, log if left.dist.is_main else (lambda *_: None), left, "sft", "SFT", SFT_SUMMARY_KEYS)
    return run_steps(SFTSteps(run), stop_after)


@dataclass
class SFTSteps:
    """SFT's steps for the run skeleton (skeleton.run_steps owns stops, last-good, checkpoints and the ending)."""

    run: SFTRun
    kind: str = "sft"
    title: str = "SFT"
    summary_keys: tuple[str, ...] = ("loss", "time/step", "mem/host_peak_rss", "mem/gpu_peak_reserved")

    def total(self) -> int:
        return self.run.total

    def begin(self) -> None:
        run = self.run
        run.model.train()
        if run.resume_from is not None:  # restored now even when no step is left (killed after the last checkpoint)
            enter_stage(run, run.stage_at(min(run.state["step"] + 1, run.total)))

    def before_step(self, step: int) -> None:
        if self.run.stage is None or not self.run.stage.first <= step <= self.run.stage.last:
            enter_stage(self.run, self.run.stage_at(step))

    def step(self, step: int, phases: dict, final: dict) -> dict:
        return sft_step(self.run, step)

    def where(self, phases: dict) -> str:
        return "the SFT step"

    def evaluate_between(self, step: int) -> dict:
        t = self.run.cfg.training
        if self.run.data.eval and t.eval_steps and step % t.eval_steps == 0:
            evaluate_and_log(self.run, step)
        return {}  # logged to eval.jsonl; SFT's returned metrics are the last step's

    def checkpoint(self, step: int) -> None:
        checkpoint(self.run, step)

    def after_save(self, step: int) -> None:
        pass

    def evaluate_final(self, stop) -> dict:
        return evaluate_and_log(self.run, self.run.state["step"], stop) if self.run.data.eval else {}


def prepare_sft(cfg: Config, log, dist: Distributed, total: int) -> Path | None:
    """rundir.prepare_run for an SFT run of `total` steps; an EndingLeft it raises carries `dist`."""
    try:
        return prepare_run(cfg, log, dist, total, "sft")
    except EndingLeft as left:
        left.dist = dist
        raise


def start_sft(cfg: Config, log) -> SFTRun:
    """Engine, output folder (refusals first), model, data, planner, sampler, rewards and logger. The optimizer is
    built per stage (`enter_stage`), where a resumed run's state is restored. Raises rundir.EndingLeft (its `dist`
    set) when training is done and only the ending is left."""

    t, s = cfg.training, cfg.sft
    out = Path(t.output_dir)
    dist = Distributed.from_env(cpu=resolve_device(t.device).type == "cpu")
    log = log if dist.is_main else (lambda *_: None)
    pin_for_run([dist.pins_host_allocator], log)  # ZeRO-3's gathers (engine/host_alloc.py)
    W = dist.world_size
    refuse_sft_layout(s, dist)
    total = None if s.epochs is not None else s.projector_steps + s.steps
    resume_from = prepare_sft(cfg, log, dist, total) if total is not None else None
    if W > 1:
        log(f"{dist.describe()}: {s.batch_size // W} of {s.batch_size} rows per step on each process")
    dist.check_supported(save_steps=t.save_steps, save_final_model=t.save_final_model)
    dist.check_config(cfg)  # a DeepSpeed config that contradicts this one: one line before anything loads
    device = dist.device(resolve_device(t.device))
    seed_everything(t.seed)
    model, processor = load_policy(cfg, device)
    routing = routing_for(model, cfg.algorithm.router_aux_loss_coef)  # MoE: the load-balancing loss, logged (and added)
    with dist.main_first():  # the built-in task's files are written once
        data = load_datasets(cfg, processor=processor)
    for line in data.reports:
        log(line)
    stages = stages_of(cfg.sft, len(data.train))
    if total is None:  # sft.epochs: the length is known once the data is
        resume_from = prepare_sft(cfg, log, dist, stages[-1].last)
    # logged; compared each step
    plan = predict_for_sft(cfg, log, longest_target(processor.tokenizer, data.train), dist.world_size, dist.planner_sharding, dist.planner_deepspeed)
    sampler = PromptSampler(len(data.train), seed=t.seed, shuffle=cfg.data.shuffle)
    reward_funcs, _ = load_reward_funcs(cfg, local_judge_on(device))
    # the rows' image files, stored with each checkpoint: a resume refuses when one was replaced
    state = {"step": 0, "best_metric": None, "best_step": None, "images": image_fingerprints([*data.train, *data.eval], image_cache_dir())}
    saved = read_trainer_state(resume_from) if resume_from is not None and not is_weights_only(resume_from) else {}
    if saved:
        state["step"] = int(saved["global_step"])
    micro = micro_batch_of(s, W, saved)
    logger = RunLogger(
        out,
        total_steps=stages[-1].last if stages else 0,
        initial_step=state["step"],
        logging_steps=cfg.logging.logging_steps,
        **tracker_options(cfg),
        progress=cfg.logging.progress_bar,
        desc="SFT",
        is_main_process=dist.is_main,
    )
    # GRPO's log-prob settings; one target per prompt leaves nothing to share, so one forward of prompt + target.
    opts = dataclasses.replace(LogprobOptions.from_config(cfg, device), shared_prefix=False)
    return SFTRun(
        cfg=cfg,
        out=out,
        dist=dist,
        device=device,
        model=model,
        processor=processor,
        data=data,
        reward_funcs=reward_funcs,
        sampler=sampler,
        logger=logger,
        log=log,
        opts=opts,
        plan=plan,
        routing=routing,
        stages=stages,
        state=state,
        micro=micro,
        resume_from=resume_from,
        saved_stage=saved.get("stage"),
    )


def refuse_sft_layout(s, dist) -> None:
    """DistributedError when sft.* cannot be split over the run's processes (`s`: the sft config section)."""
    W = dist.world_size
    if s.batch_size % W:
        raise DistributedError(f"sft.batch_size={s.batch_size} must be a multiple of the {W} processes (each takes an equal share of every step)")
    if W > 1 and not dist.engine.can_redo_oom and s.projector_steps and (s.steps or s.epochs):
        raise DistributedError(
            f"vlmrl sft with both stages in one run is not supported under {dist.engine.name} (the engine wraps the trainable "
            "parameters once); run stage 1 (sft.steps=0) and then stage 2 from its final/ (sft.projector_steps=0) as two commands"
        )


def micro_batch_of(s, world_size: int, saved: dict) -> int:
    """Rows per forward/backward on this process: sft.micro_batch_size (default: the whole share), or what OOM
    recovery settled on in the checkpoint (`saved`: its trainer state) unless configured smaller now."""
    share = s.batch_size // world_size
    micro = min(s.micro_batch_size or share, share)
    if (saved.get("sizes") or {}).get("update"):
        micro = min(micro, int(saved["sizes"]["update"]))
    return micro


def enter_stage(run: SFTRun, stage: Stage) -> None:
    """The stage's trainable parameters, optimizer and schedule, wrapped by the engine; the first stage a resumed
    run enters restores the checkpoint (weights, sampler, RNG, and the optimizer when it is this stage's)."""

    cfg, dist = run.cfg, run.dist
    if not cfg.model.use_lora:
        set_stage_trainable(run.model, stage.name, cfg.sft.train_vision_tower)
    optimizer, scheduler = make_optimizer(run.model, cfg.optim, stage.steps, learning_rate=stage.lr)
    path, same = run.resume_from, run.saved_stage == stage.name
    if path is not None:  # a checkpoint at the end of stage 1 holds stage 1's optimizer: stage 2 starts its own
        restored = restore(path, cfg.training, run.model, optimizer if same else None, scheduler if same else None, run.sampler, run.log, dist)
        run.state.update(best_metric=restored["best_metric"], best_step=restored["best_step"])
    run.optimizer = dist.prepare(run.model, optimizer, run.micro, oom_recovery=cfg.memory.oom_recovery)
    run.scheduler = scheduler
    for line in dist.prepared_report():
        run.log(line)
    if path is not None and (same or is_sharded_checkpoint(path)):
        restore_after_wrap(path, run.optimizer if same else None, dist)
    allocate_optimizer_state(run.optimizer)  # an OOM for AdamW's moments happens now, not inside optimizer.step
    run.stage, run.resume_from = stage, None


@dataclass
class StepLoss:
    """What one optimizer step's accumulation leaves besides the gradients."""

    loss: float = 0.0
    router_aux: list[float] = field(default_factory=list)


def sft_step(run: SFTRun, step: int) -> dict:
    """One optimizer step over sft.batch_size rows (every process draws the same batch and takes its share), in
    micro-batches of run.micro rows (halved on OOM: the step redone, partial gradients dropped)."""

    cfg, dist = run.cfg, run.dist
    t0 = time.perf_counter()
    share = cfg.sft.batch_size // dist.world_size
    batch = run.sampler.next_batch(cfg.sft.batch_size)
    rows = [sft_row(run.processor, run.data.train[i], cfg.data) for i in batch[dist.rank * share : (dist.rank + 1) * share]]
    targets = target_batch(run.processor.tokenizer, rows, run.device)  # ids, attention, loss mask: [share, T]
    # The loss is a mean over the trained target tokens of the whole batch (every process's rows), whatever the micro-batches.
    tokens = int(targets[2].sum())
    tokens = int(dist.all_sum([float(tokens)])[0]) if dist.world_size > 1 else tokens
    result_loss, run.micro = retry_on_oom(
        lambda size: accumulate(run, rows, targets, max(1, tokens), size),
        run.micro,
        "sft",
        run.logger.info,
        on_oom=lambda: run.optimizer.zero_grad(set_to_none=True),
        enabled=cfg.memory.oom_recovery,
        peers=dist.oom_peers,
    )
    dist.sync_gradients()  # DDP with OOM recovery: only now, once every process has its gradients
    result = dist.optimizer_step(run.optimizer, run.scheduler, cfg.optim.max_grad_norm)
    if result.skipped:
        run.logger.info(
            f"WARNING: SFT step {step}: loss {result_loss.loss} / gradient norm {result.grad_norm} not finite; step skipped, nothing changed"
        )
    metrics = {
        "loss": result_loss.loss,
        "grad_norm": result.grad_norm,
        "nonfinite/skipped_steps": float(result.skipped),
        "lr": run.scheduler.get_last_lr()[0],
        "time/step": time.perf_counter() - t0,
        "stage": 1.0 if run.stage.name == "projector" else 2.0,
        **({"router/aux_loss": sum(result_loss.router_aux) / len(result_loss.router_aux)} if result_loss.router_aux else {}),
        **measured_vs_predicted(run.plan, run.log),
    }
    if run.micro < share:  # accumulating (or OOM recovery cut the micro-batch): worth seeing in the log
        metrics["micro_batch_size"] = run.micro
    metrics = dist.reduce_metrics(metrics, sum_keys=("loss",))  # each process holds its share of the batch's loss
    run.logger.log(step, metrics)
    return metrics


def accumulate(run: SFTRun, rows: list[dict], targets: tuple, tokens: int, size: int) -> StepLoss:
    """Forward/backward of this process's rows in micro-batches of `size`; gradients accumulate in the model.
    `targets`: the rows' (ids, attention mask, loss mask), [rows, T]; `tokens`: trained target tokens of the whole step
    over every process (the loss's normaliser)."""

    cfg, dist = run.cfg, run.dist
    out = StepLoss()
    starts = list(range(0, len(rows), size))
    for k, start in enumerate(starts):
        maybe_inject_oom("sft", min(size, len(rows) - start))
        chunk = rows[start : start + size]
        width = int(targets[1][start : start + size].sum(dim=1).max())  # the chunk's longest target
        ids, mask, loss_mask = (t[start : start + size, :width] for t in targets)
        prompts = encode_rows(run.processor, chunk, cfg, run.device)
        row_prompt = torch.arange(len(chunk), device=run.device)
        with dist.no_sync(last=k == len(starts) - 1):  # gradients synced once per optimizer step
            with capture_routing(run.routing) as routed:
                logps = dist.call(completion_logps_for, prompts, row_prompt, ids, mask, run.opts, grad=True)
            # The batch's token mean (one micro-batch on one process: exactly losses.masked_mean of the batch).
            weights = loss_mask.to(logps.dtype)
            loss = -((logps * weights).sum() / torch.tensor(float(tokens), dtype=logps.dtype, device=logps.device))
            if run.routing is not None:
                aux = micro_batch_aux_loss(routed, prompts, row_prompt, ids.shape[1])
                out.router_aux.append(aux.item())
                loss = loss + cfg.algorithm.router_aux_loss_coef * aux * (len(chunk) / cfg.sft.batch_size)
            dist.backward(loss)
        out.loss += loss.item()
    return out


def evaluate_and_log(run: SFTRun, step: int, stop=None) -> dict:
    """Greedy evaluation logged to eval.jsonl, with the first logging.log_completions answers (prompt, greedy answer,
    target, rewards, correct) in samples.jsonl, as GRPO logs its completions."""
    samples: list[dict] = []
    metrics = evaluate_on(run.dist, run.model, run.processor, run.data.eval, run.cfg, run.reward_funcs, run.device, run.logger.info, samples, stop)
    run.logger.log_eval(step, metrics)
    run.logger.log_samples(step, [{"kind": "eval", **sample} for sample in samples])
    return metrics


def checkpoint(run: SFTRun, step: int) -> None:
    from vlmrl.checkpoints.state import save

    run.state.update(sizes={"update": run.micro}, stage=run.stage.name)
    save(
        run.cfg,
        run.out,
        step,
        run.model,
        run.optimizer,
        run.scheduler,
        run.sampler,
        run.state,
        run.logger.info,
        run.dist,
        rows_per_step=run.cfg.sft.batch_size,
    )
    run.saved_at = time.monotonic()


SFT_SUMMARY_KEYS = SFTSteps.summary_keys  # the summary table's metrics (finish_left reads them too)
