"""What the GRPO loop's phases pass along (train.py): the step's samples (`Rollout`), rewards and advantages (`Rewards`),
the log-probs the update compares against (`Scores`), one forward's rows (`MicroBatch`), the update's values
(`UpdateStats`), the piece sizes OOM recovery may shrink (`Sizes`), and dynamic sampling's picked rows (`PickedRows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmrl.config import Config
from vlmrl.rewards.protocol import RewardLog
from vlmrl.models.router import RecordedRoutes
from vlmrl.models.rollout import Completions


@dataclass
class Sizes:
    """Piece sizes that OOM recovery may shrink, each kept for the rest of the run and in checkpoints."""

    generation: int | None  # prompts per generate call (None: all of the step's prompts)
    scoring: int  # rows (or tokens, memory.max_tokens_per_micro_batch) per no-grad scoring micro-batch
    update: int  # rows (or tokens) per forward/backward micro-batch of the update

    @classmethod
    def initial(cls, cfg: Config, saved: dict | None = None) -> "Sizes":
        """The configured sizes; when resuming, the checkpoint's (shrunk by OOMs), except that a generation / scoring size
        configured smaller on resume (both resume-harmless) wins, so a run stopped by an OOM can restart below it."""
        update = cfg.memory.max_tokens_per_micro_batch or cfg.training.per_device_train_batch_size
        configured = cls(cfg.memory.generation_prompts_per_call, cfg.memory.scoring_micro_batch_size or update, update)
        if not saved:
            return configured
        # checkpoints before the scoring / update split stored one shared "train" size
        generation, scoring = saved.get("generation"), saved.get("scoring", saved.get("train"))
        if cfg.memory.generation_prompts_per_call is not None:
            generation = min(generation or configured.generation, configured.generation)
        if cfg.memory.scoring_micro_batch_size is not None:
            scoring = min(scoring, configured.scoring)
        return cls(generation, scoring, saved.get("update", saved.get("train")))


@dataclass
class Rollout:
    """One step's samples on this process: P prompts, G completions each, rows grouped by prompt."""

    rows: list[dict]  # [P] dataset rows
    prompts: dict  # encoded prompts: input_ids / attention_mask [P, L] (+ vision inputs)
    completions: Completions  # ids, mask [P*G, T]; truncated [P*G]
    texts: list[str]  # [P*G] decoded completions
    prompt_texts: list[str]  # [P*G] the problem each row answers
    routes: RecordedRoutes | None = None  # algorithm.routing_replay: the experts the rollout chose (MoE), else None

    @property
    def prompt_of_row(self) -> torch.Tensor:
        """[P*G] which prompt each completion row continues."""
        return torch.arange(len(self.rows)).repeat_interleave(len(self.texts) // max(1, len(self.rows)))


@dataclass
class Rewards:
    """Rewards of the whole step (every process's rows, global order) and this process's advantages."""

    local: list[float]  # [P*G] weighted reward of this process's rows
    rewards: torch.Tensor  # [B*G] float32
    per_reward: dict[str, list]  # name -> [B*G] values (None where the reward does not apply)
    advantages: torch.Tensor  # [P*G] (or [P*G, T] per token), on the device
    lengths: torch.Tensor  # [B*G] completion lengths
    truncated: torch.Tensor  # [B*G] bool
    nonfinite: str | None = None  # what was not finite (the step's update is skipped), or None
    reward_log: RewardLog = field(default_factory=RewardLog)  # what rewards logged via TRL's log_extra / log_metric
    dynamic: dict = field(default_factory=dict)  # algorithm.dynamic_sampling's metrics of the step (dynamic_sampling/*)
    distill: dict = field(default_factory=dict)  # distill/* of this step (algorithm.teacher_path), else empty


@dataclass
class Scores:
    """Log-probs the update compares against, scored once per rollout without gradients."""

    loss_mask: torch.Tensor  # [P*G, T] completion tokens that count in the loss
    old_logps: torch.Tensor | None  # [P*G, T] under the policy that sampled the rollout (only when cfg.scores_old_logps)
    ref_logps: torch.Tensor | None  # [P*G, T] under the reference (only when beta > 0)
    is_weights: torch.Tensor | None = None  # [P*G, T] algorithm.rollout_correction's weights (old vs the sampler's log-probs)
    entropy_mask: torch.Tensor | None = None  # [P*G, T] algorithm.top_entropy_quantile's kept tokens (per optimizer step), or None
    mismatch: dict = field(default_factory=dict)  # mismatch/* of the old log-probs against the sampler's (mismatch.py)


@dataclass
class MicroBatch:
    """Rows of one forward: their unique prompts (each image encoded once) and completions trimmed to the longest."""

    prompts: dict  # [U, L] the unique prompts of these rows
    row_prompt: torch.Tensor  # [n] index into prompts
    ids: torch.Tensor  # [n, t] completion ids
    loss_mask: torch.Tensor  # [n, t] tokens that count in the loss
    completion_mask: torch.Tensor  # [n, t] generated tokens (up to and including EOS): what the model attends to
    tool_vision: list | None = None  # multi-turn rows: each row's tool images (vision tensors), else None


@dataclass
class UpdateStats:
    """Per optimizer step (loss, grad_norm) or micro-batch (kl, clip_ratio) values of one step's update."""

    loss: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    clip_ratio: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    ratio_dev: list[float] = field(default_factory=list)  # max |ratio - 1| per iteration: 0 on-policy, > 0 when reused
    mismatch: dict = field(default_factory=dict)  # mismatch/* (mismatch.py): the sampler's log-probs vs the trainer's
    skipped: list[str] = field(default_factory=list)  # why each skipped optimizer step was skipped
    router_aux: list[float] = field(default_factory=list)  # MoE load-balancing loss per micro-batch (before its coefficient)


@dataclass
class PickedRows:
    """Which local rows of which round each picked group takes (dynamic sampling): group k is rows local_rows[k] of
    round round_of[k]."""

    rounds: list  # [(Rollout, Rewards, dataset rows)] of every generation round, first the step's own
    round_of: list[int]
    local_rows: list[list[int]]

    def values(self, column) -> list:
        """[picked rows] of `column(rollout, rewards)`, a per-local-row list of each round."""
        return [column(*self.rounds[r][:2])[j] for r, rows in zip(self.round_of, self.local_rows) for j in rows]


def picked_reward_log(picked: PickedRows, n: int) -> RewardLog:
    """The rounds' reward logs as one: every round's gathered values, and the per-completion columns of the picked
    rows where every round logged one per local row (`n`: rows picked on this process)."""
    logs = [r.reward_log for _, r, _ in picked.rounds]
    reward_log = RewardLog(values={k: [v for log in logs for v in log.values.get(k, [])] for k in logs[0].values})
    for key in logs[0].columns:
        columns = [log.columns.get(key) for log in logs]
        if all(c is not None and len(c) == n for c in columns):
            reward_log.columns[key] = picked.values(lambda _, r, key=key: r.reward_log.columns[key])
    return reward_log
