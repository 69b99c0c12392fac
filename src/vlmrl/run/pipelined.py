"""The GRPO loop's side of rollout.max_staleness > 0 (rollout/pipeline.py holds the schedule and the producer):
start the pipeline, keep it filled from the prompt sampler, take a step's rollout from it, push the weights after
the update, and the behaviour log-probs the update compares against. `run`: the GRPO run (train.Run)."""

from __future__ import annotations

import torch

from vlmrl.models.processing import decode
from vlmrl.rollout.pipeline import RolloutPipeline
from vlmrl.run.datasets import encode_rows
from vlmrl.run.requests import sample_request
from vlmrl.run.step_records import Rollout


def start_pipeline(cfg, dist, model, per_prompt_seed: bool, pad_id: int, state: dict, log) -> RolloutPipeline | None:
    """The run's pipeline (None at rollout.max_staleness=0): the producer started, the weights of this step pushed
    as its version, a resumed run's queue put back (entries of this version sampled again)."""
    if cfg.rollout.max_staleness == 0:
        return None
    if dist.world_size > 1:
        from vlmrl.config import ConfigError

        raise ConfigError(f"rollout.max_staleness={cfg.rollout.max_staleness} runs in one training process (yet); launch one process or set it to 0")
    pipeline = RolloutPipeline(cfg, per_prompt_seed, pad_id, log=log)
    pipeline.push(model, state["step"])
    pipeline.restore(state.pop("rollout_queue", None) or [])
    log(
        f"rollout pipeline: a producer process (pid {pipeline.process.pid}) samples up to {cfg.rollout.max_staleness} "
        "policy versions behind the update (rollout.max_staleness)"
    )
    return pipeline


def fill(run, done: int) -> None:
    """Submit the steps after `done` the pipeline must hold: a queued step of a resume keeps its prompts, a new one
    draws them from the sampler now (so the sampler's checkpointed state covers every queued step)."""
    pipeline = run.pipeline
    for entry in sorted((e for e in pipeline.queue.values() if e.reply is None and e.step not in pipeline.inflight), key=lambda e: e.step):
        submit(run, entry.step, entry.indices)  # a resume's entry of the checkpoint's version: sampled again
    for step in pipeline.due(done):
        submit(run, step, run.sampler.next_batch(run.cfg.prompts_per_step))


def submit(run, step: int, indices: list[int]) -> None:
    rows = [run.data.train[indices[p]] for p in run.shard.prompts]
    prompts = encode_rows(run.processor, rows, run.cfg, run.device)
    positions = [indices[p] for p in run.shard.prompts]
    request = sample_request(run, step, positions, prompts, run.sizes.generation or len(rows))
    run.pipeline.submit(request, indices)


def pipelined_rollout(run, step: int) -> Rollout:
    """Step `step`'s rollout from the pipeline (sampled by a version at most rollout.max_staleness behind)."""
    fill(run, step - 1)
    run.model.eval()  # scoring sees the policy as the synchronous loop's does (after its rollout)
    entry, comp = run.pipeline.take(step)
    rows = [run.data.train[entry.indices[p]] for p in run.shard.prompts]
    run.current_rows = [entry.indices[p] for p in run.shard.prompts]
    G = run.cfg.rollout.num_generations
    comp.ids, comp.mask = comp.ids.to(run.device), comp.mask.to(run.device)
    comp.truncated = comp.truncated.to(run.device)
    if comp.sampling_logps is None:
        raise RuntimeError(
            "rollout.max_staleness > 0 needs the sampler's log-probs (the behaviour policy's), which this decode path does "
            "not report (HF generate); use a model with the shared-prefix path, or rollout.max_staleness=0"
        )
    comp.sampling_logps = comp.sampling_logps.to(run.device)
    return Rollout(
        rows=rows,
        prompts=encode_rows(run.processor, rows, run.cfg, run.device),
        completions=comp,
        texts=decode(run.processor, comp.ids),
        prompt_texts=[row["problem"] for row in rows for _ in range(G)],
    )


def after_update(run, step: int) -> None:
    """The weights after step `step` go to the producer as version `step`; the step after the queue is submitted."""
    run.pipeline.metrics["pipeline/push_seconds"] = run.pipeline.push(run.model, step)
    fill(run, step)


def behaviour_logps(samples: Rollout, old: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """[P*G, T] the old log-probs of the PPO ratio under rollout.max_staleness > 0 without a rollout correction: the
    sampler's (the version that sampled the rows), so the ratio is pi_theta / pi_behaviour, clipped. `old`: the
    scored ones (their device is kept), or None."""
    return samples.completions.sampling_logps.to(old.device if old is not None else device)
