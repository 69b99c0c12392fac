"""Held-out evaluation: greedy decoding, reward means, accuracy / mean IoU."""

from __future__ import annotations

import functools

import torch

from vlmrl.config import Config
from vlmrl.rollout.inprocess import InProcessRollout
from vlmrl.run.datasets import encode_rows
from vlmrl.rewards.scoring import score_rollout
from vlmrl.data.sft_targets import sft_target
from vlmrl.engine.oom import ALONE, maybe_inject_oom, retry_on_oom
from vlmrl.models.prefix import LogprobOptions
from vlmrl.models.processing import decode


class EvaluationFailed(RuntimeError):
    """Raised on the other processes when the main process's evaluation (DDP: the main process evaluates alone) failed."""


class EvaluationStopped(Exception):
    """A stop (SIGTERM / SIGINT) was asked for during an evaluation; it ended between batches, nothing logged."""


def evaluate_on(
    dist,
    model,
    processor,
    rows: list[dict],
    cfg: Config,
    reward_funcs: dict,
    device,
    log=print,
    samples: list | None = None,
    stop=None,
    backend=None,
) -> dict:
    """`evaluate` with every process of the run (`dist`: distributed.Distributed): the main process alone (one process,
    DDP), or every process through the engine when parameters are sharded (they all take part in the all-gathers).
    Every process gets the metrics; a failure on the main process raises on every process. `stop`: a GracefulStop
    whose request ends the evaluation between batches (EvaluationStopped on every process). `backend`: the run's
    rollout backend, which decodes (None: the in-process decoders)."""
    if dist.sharded:  # an OOM here stops every process (oom.Peers.can_redo is false): the others are in the all-gathers
        asked = None if stop is None else (lambda: dist.any(stop.requested))  # every process leaves at the same batch
        mode = cfg.memory.generation_gather
        with dist.gathered_for_generation(mode):
            args = (processor, rows, cfg, reward_funcs, device, log, dist.oom_peers, samples, asked, backend, dist.decode_agreement(mode))
            return dist.call(evaluate, *args)
    error, metrics = None, None
    if dist.is_main:  # alone: its OOM redo involves no other process
        try:
            asked = None if stop is None else (lambda: stop.requested)
            metrics = evaluate(model, processor, rows, cfg, reward_funcs, device, log, samples=samples, stop=asked, backend=backend)
        except Exception as e:  # noqa: BLE001 - the others wait in the broadcast below: tell them, then raise on every process
            error = e
    metrics, failed = dist.broadcast((metrics, None if error is None else f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    if failed is not None:
        if failed.startswith(EvaluationStopped.__name__):
            raise EvaluationStopped(failed)
        raise EvaluationFailed(f"the evaluation on the main process failed: {failed}")
    return metrics


def evaluate(
    model,
    processor,
    rows: list[dict],
    cfg: Config,
    reward_funcs: dict,
    device: torch.device,
    log=print,
    peers=None,
    samples: list | None = None,
    stop=None,
    backend=None,
    decode_agreement=None,
) -> dict[str, float]:
    """Greedy completions for `rows`; returns `eval/<reward>` means (e.g. eval/accuracy, eval/iou) and
    eval/reward (the unweighted mean of all rewards per sample, then over samples). Batches of
    training.eval_batch_size prompts, halved on out-of-memory (greedy decoding gives the same tokens). `peers`: the
    processes that evaluate together (oom.Peers; None: this one alone).
    `samples`, when given, receives the first logging.log_completions rows' greedy answers (`eval_sample`).
    `stop`, when given, is asked before every batch; True ends the evaluation (EvaluationStopped).
    `backend`: the run's rollout backend (rollout/base.py), whose evaluator decodes (rollout.backend=vllm: vLLM with
    the trainer's weights); None: the in-process decoders, with `decode_agreement`: how the processes that evaluate
    together decode in step (Engine.decode_agreement), or None."""

    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    lengths = []
    opts = LogprobOptions.from_config(cfg, device)

    # Through the rollout seam (rollout/base.py), on `model` as this function gets it (sharded: the engine's runner).
    evaluator = (
        InProcessRollout(cfg, None, model, processor, opts, decode_agreement=decode_agreement) if backend is None else backend.evaluator(model, opts)
    )

    def greedy_from(first: int, size: int):
        chunk = rows[first : first + size]
        maybe_inject_oom("eval", len(chunk))
        names = [f"evaluation row {first + i}" for i in range(len(chunk))]
        return evaluator.greedy(chunk, encode_rows(processor, chunk, cfg, device), names)

    bs, start = cfg.training.eval_batch_size, 0
    while start < len(rows):
        if stop is not None and stop():
            model.train(was_training)
            raise EvaluationStopped(f"stopped after {start} of {len(rows)} evaluation rows")
        comp, bs = retry_on_oom(functools.partial(greedy_from, start), bs, "evaluation", log, enabled=cfg.memory.oom_recovery, peers=peers or ALONE)
        chunk = rows[start : start + bs]
        start += bs
        texts = decode(processor, comp.ids)
        _, per_reward = score_rollout(cfg, reward_funcs, {k: 1.0 for k in reward_funcs}, chunk, 1, texts, comp, when="evaluation")
        if samples is not None:
            wanted = max(0, cfg.logging.log_completions - len(samples))
            samples += [eval_sample(chunk[i], texts[i], {k: v[i] for k, v in per_reward.items()}) for i in range(min(wanted, len(chunk)))]
        for name, values in per_reward.items():
            valid = [v for v in values if v is not None]
            sums[name] = sums.get(name, 0.0) + sum(valid)
            counts[name] = counts.get(name, 0) + len(valid)
        lengths += comp.lengths.tolist()
    model.train(was_training)
    out = {f"eval/{k}": sums[k] / counts[k] for k in sums if counts[k]}
    out["eval/mean_length"] = sum(lengths) / max(1, len(lengths))
    out["eval/num_samples"] = float(len(rows))
    return out


def eval_sample(row: dict, completion: str, rewards: dict) -> dict:
    """One samples.jsonl record of an evaluation: the prompt, the model's greedy answer, the target (the row's
    response or <answer>solution</answer>, what SFT trains towards), each reward, and `correct` when an
    accuracy reward scored it (None where it does not apply)."""

    target = sft_target(row) if row.get("response") or row.get("solution") is not None else None
    record = {"prompt": row["problem"], "completion": completion, "target": target, "solution": row.get("solution"), "rewards": rewards}
    if rewards.get("accuracy") is not None:
        record["correct"] = rewards["accuracy"] == 1.0
    return record
