"""vlmrl's advantages, loss and gradient against TRL 1.16's own GRPOTrainer code on the same injected tensors.

TRL's side runs TRL's real code: `GRPOTrainer._compute_loss` (called unbound on a stand-in `self` whose log-prob
function returns the injected per-token log-probs) once per micro-batch, as TRL's training loop calls it, and the
advantage block of `GRPOTrainer._generate_and_score_completions` (its source, cut out at its first and last line
and executed on the injected rewards). vlmrl's side calls its public functions as train.py calls them.

A setting: G completions for several prompts (one group with equal rewards), lengths 1..T with padding, old and
current log-probs far enough apart that about half of the tokens leave the clip range; optimizer steps of
`micro_batches` micro-batches, `steps` optimizer steps per rollout (TRL: steps_per_generation = steps x GA).

    python benchmarks/trl_oracle.py            # writes benchmarks/results/trl_oracle_cpu_<date>.md and .json

Needs TRL 1.16.0 (`pip install -e .[bench]`).
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import pathlib
import sys
import textwrap
import types

import torch

from vlmrl.algo.advantages import ADVANTAGE_ESTIMATORS, SCALE_REWARDS_ESTIMATOR
from vlmrl.algo.losses import LOSS_TYPE_AGGREGATION, aggregate, entropy_quantile_mask, per_token_loss, step_normaliser
from vlmrl.algo.mismatch import ROLLOUT_CORRECTIONS
from vlmrl.config import Config, apply_preset, build_config
from vlmrl.train import policy_weights

ROWS_PER_MICRO_BATCH = 3
G = 4
MAX_LEN = 8


@dataclasses.dataclass(frozen=True)
class Setting:
    """One comparison: TRL's arguments and vlmrl's algorithm config for the same math."""

    name: str
    trl: dict  # GRPOConfig fields TRL's loss reads (loss_type, beta, epsilon, epsilon_high, ...)
    vlmrl: dict  # AlgorithmConfig fields
    micro_batches: int = 1  # per optimizer step (gradient_accumulation_steps)
    steps: int = 1  # optimizer steps per rollout
    inject_old: bool = True  # False: on-policy, neither side gets old log-probs (TRL: old_per_token_logps absent)
    claimed_same: bool = True  # False: a known difference (docs/vs_trl.md), reported, not asserted
    rows: int = ROWS_PER_MICRO_BATCH  # rows per micro-batch
    gspo: bool = False  # one of docs/vs_trl.md's GSPO interactions (tests/test_vs_trl_oracle.py checks the list)


def _trl_base(**kw) -> dict:
    base = {"loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "scale_rewards": "group", "use_bias_correction_kl": False}
    return base | {"top_entropy_quantile": 1.0} | kw


def _gspo(name: str, trl: dict, vlmrl: dict, micro_batches: int = 2, **kw) -> Setting:
    """A GSPO setting: TRL's importance_sampling_level=sequence, vlmrl's policy_loss=gspo, the paper's clip ranges."""
    eps = {"epsilon": 3e-4, "epsilon_high": 4e-4}
    trl = _trl_base(**{"loss_type": "grpo", **eps, **trl, "importance_sampling_level": "sequence"})
    return Setting(f"gspo {name}", trl, {"policy_loss": "gspo", **eps, **vlmrl}, micro_batches, gspo=True, **kw)


def _correction(mode: str, lo: float | None, hi: float | None) -> tuple[dict, dict]:
    """TRL's vLLM importance-sampling arguments and vlmrl's rollout_correction for the same mode and bounds."""
    trl = {"vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": lo, "vllm_importance_sampling_clip_max": hi}
    return trl, {"rollout_correction": mode, "rollout_correction_min": lo, "rollout_correction_max": hi}


def gspo_settings() -> list[Setting]:
    """GSPO with everything it can meet (docs/vs_trl.md, "GSPO"): the aggregations, a rollout of several steps, delta,
    the KL corrections, the rollout-correction modes, entropy masking, and all of them together."""
    kl = {"beta": 0.04, "use_bias_correction_kl": True}
    out = [
        _gspo("grpo beta=0.04 (k3)", {"beta": 0.04}, {"beta": 0.04}),
        _gspo("dapo (token_mean)", {"loss_type": "dapo"}, {"loss_aggregation": "token_mean"}),
        _gspo("dr_grpo", {"loss_type": "dr_grpo"}, {"loss_type": "dr_grpo"}),
        _gspo("bnpo", {"loss_type": "bnpo"}, {"loss_type": "bnpo"}),
        _gspo("dapo rollout of 2 steps (token_mean_rollout)", {"loss_type": "dapo"}, {"loss_aggregation": "token_mean_rollout"}, steps=2),
        _gspo("grpo rollout of 2 steps beta=0.04", {"beta": 0.04}, {"beta": 0.04}, steps=2),
        _gspo("delta=1.02", {"delta": 1.02}, {"delta": 1.02}),  # a row with s = 1.04 > delta and A < 0
        _gspo("beta=0.04 use_bias_correction_kl (k3_seq_ratio)", kl, kl),
        _gspo("beta=0.04 use_bias_correction_kl on-policy", kl, kl, inject_old=False),
        _gspo(
            "preset=trl beta=0.04, TRL's defaults (dapo, use_bias_correction_kl)",
            {**kl, "loss_type": "dapo"},
            {"preset": "trl", "beta": 0.04},
            steps=2,
        ),
        _gspo("top_entropy_quantile=0.2", {"top_entropy_quantile": 0.2}, {"top_entropy_quantile": 0.2}, 1, rows=8),
        _gspo(
            "dapo top_entropy_quantile=0.5 beta=0.04",
            {"loss_type": "dapo", "top_entropy_quantile": 0.5, "beta": 0.04},
            {"loss_aggregation": "token_mean", "top_entropy_quantile": 0.5, "beta": 0.04},
            1,
            rows=8,
        ),
    ]
    for mode in ROLLOUT_CORRECTIONS:
        bounds = (0.8, 1.25) if mode.startswith("token") else (0.6, 1.5)  # each mode truncates or masks some tokens or rows
        trl, vlmrl = _correction(mode, *bounds)
        out.append(_gspo(f"rollout_correction={mode}", trl, vlmrl))
    trl, vlmrl = _correction("token_truncate", 0.8, 1.25)
    out += [
        _gspo(
            "all at once: token_truncate, top_entropy_quantile=0.5, use_bias_correction_kl, dapo, delta=1.02",
            {**trl, **kl, "loss_type": "dapo", "top_entropy_quantile": 0.5, "delta": 1.02},
            {**vlmrl, **kl, "loss_aggregation": "token_mean", "top_entropy_quantile": 0.5, "delta": 1.02},
            1,
            rows=8,
        ),
        # vlmrl's own k3_ratio keeps the token ratio under GSPO (DeepSeek-V3.2's per-token estimator); TRL's uses coef_1.
        _gspo(
            "beta=0.04, vlmrl kl_estimator=k3_ratio vs TRL use_bias_correction_kl", kl, {"beta": 0.04, "kl_estimator": "k3_ratio"}, claimed_same=False
        ),
        _gspo(
            "top_entropy_quantile=0.2, 2 micro-batches (TRL: quantile per micro-batch)",
            {"top_entropy_quantile": 0.2},
            {"top_entropy_quantile": 0.2},
            2,
            rows=6,
            claimed_same=False,
        ),
    ]
    return out


def settings() -> list[Setting]:
    out = []
    for lt in ("grpo", "dapo", "dr_grpo", "bnpo"):
        for sr in ("group", "batch", "none"):
            for beta in (0.0, 0.04):
                agg = "token_mean" if lt == "dapo" else LOSS_TYPE_AGGREGATION[lt]
                out.append(
                    Setting(
                        f"{lt} scale_rewards={sr} beta={beta}",
                        _trl_base(loss_type=lt, scale_rewards=sr, beta=beta),
                        {"loss_aggregation": agg, "advantage_estimator": SCALE_REWARDS_ESTIMATOR[sr], "beta": beta},
                        micro_batches=2,
                    )
                )
    kl = {"beta": 0.04, "use_bias_correction_kl": True}
    out += [
        Setting(
            "dapo beta=0.04 use_bias_correction_kl", _trl_base(**kl), {"loss_aggregation": "token_mean", "beta": 0.04, "kl_estimator": "k3_ratio"}, 2
        ),
        Setting(
            "grpo beta=0.04 use_bias_correction_kl on-policy",
            _trl_base(loss_type="grpo", **kl),
            {"beta": 0.04, "kl_estimator": "k3_ratio"},
            2,
            inject_old=False,
        ),
        Setting("dapo epsilon_high=0.28", _trl_base(epsilon_high=0.28), {"loss_aggregation": "token_mean", "epsilon_high": 0.28}, 2),
        Setting("dapo delta=1.5", _trl_base(delta=1.5), {"loss_aggregation": "token_mean", "delta": 1.5}, 2),
        Setting(
            "gspo (importance_sampling_level=sequence, grpo)",
            _trl_base(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
            {"policy_loss": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4},
            2,
        ),
        Setting(
            "cispo (TRL epsilon_high 1.3 = vlmrl 0.3)",
            _trl_base(loss_type="cispo", epsilon_high=1.3),
            {"policy_loss": "cispo", "epsilon_high": 0.3},
            2,
        ),
        Setting("sapo", _trl_base(loss_type="sapo"), {"policy_loss": "sapo"}, 2),
        Setting("dapo 4 micro-batches", _trl_base(), {"loss_aggregation": "token_mean"}, micro_batches=4),
        # A rollout feeding two optimizer steps (the second step's current log-probs differ from the sampling ones).
        Setting("grpo rollout of 2 steps beta=0.04", _trl_base(loss_type="grpo", beta=0.04), {"beta": 0.04}, 2, steps=2),
        Setting("bnpo rollout of 2 steps", _trl_base(loss_type="bnpo"), {"loss_type": "bnpo"}, 2, steps=2),
        Setting("dr_grpo rollout of 2 steps", _trl_base(loss_type="dr_grpo"), {"loss_type": "dr_grpo"}, 2, steps=2),
        Setting(
            "dapo rollout of 2 steps, TRL's normaliser (token_mean_rollout)",
            _trl_base(),
            {"loss_aggregation": "token_mean_rollout"},
            2,
            steps=2,
        ),
        Setting(
            "dapo rollout of 2 steps, per-step normaliser (token_mean)",
            _trl_base(),
            {"loss_aggregation": "token_mean"},
            2,
            steps=2,
            claimed_same=False,
        ),
        Setting(
            "cispo rollout of 2 steps (token_mean_rollout)",
            _trl_base(loss_type="cispo", epsilon_high=1.3),  # a cap the ratios pass (TRL's recommended 5.0 is rarely reached)
            {"policy_loss": "cispo", "epsilon_high": 0.3, "loss_aggregation": "token_mean_rollout"},
            2,
            steps=2,
        ),
        # Entropy-quantile masking: the same injected entropies on both sides. TRL takes the quantile per micro-batch,
        # vlmrl per optimizer step (micro-batch independent): the same with one micro-batch per step.
        Setting("grpo top_entropy_quantile=0.2", _trl_base(loss_type="grpo", top_entropy_quantile=0.2), {"top_entropy_quantile": 0.2}, 1, rows=8),
        Setting(
            "dapo top_entropy_quantile=0.5 beta=0.04",
            _trl_base(top_entropy_quantile=0.5, beta=0.04),
            {"loss_aggregation": "token_mean", "top_entropy_quantile": 0.5, "beta": 0.04},
            1,
            rows=8,
        ),
        Setting(
            "bnpo top_entropy_quantile=0.2 rollout of 2 steps",
            _trl_base(loss_type="bnpo", top_entropy_quantile=0.2),
            {"loss_type": "bnpo", "top_entropy_quantile": 0.2},
            1,
            steps=2,
            rows=8,
        ),
        Setting(
            "grpo top_entropy_quantile=0.2, 2 micro-batches (TRL: quantile per micro-batch)",
            _trl_base(loss_type="grpo", top_entropy_quantile=0.2),
            {"top_entropy_quantile": 0.2},
            2,
            claimed_same=False,
            rows=6,
        ),
        Setting(
            "grpo beta=0.04, vlmrl k3 vs TRL default use_bias_correction_kl",
            _trl_base(loss_type="grpo", **kl),
            {"beta": 0.04},
            2,
            claimed_same=False,
        ),
    ]
    return out + gspo_settings()


# ---------------------------------------------------------------- injected tensors
@dataclasses.dataclass
class Batch:
    rewards: torch.Tensor  # [R]
    mask: torch.Tensor  # [R, T]
    old: torch.Tensor  # [R, T] sampling policy
    ref: torch.Tensor  # [R, T]
    current: list[torch.Tensor]  # per optimizer step: [R, T] current log-probs (leaf values; only its rows are used)
    entropies: torch.Tensor  # [R, T] per-token policy entropies (top_entropy_quantile)
    sampling: torch.Tensor  # [R, T] the sampler's log-probs (rollout correction: old vs these)


def make_batch(rows: int, steps: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (rows,), generator=g).double()
    rewards[:G] = 1.0  # one group with equal rewards: zero advantages
    lengths = torch.randint(1, MAX_LEN + 1, (rows,), generator=g)
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).double()
    old = -torch.rand(rows, MAX_LEN, generator=g, dtype=torch.float64) * 3
    ref = old + 0.3 * torch.randn(rows, MAX_LEN, generator=g, dtype=torch.float64)
    current = [old + 0.4 * torch.randn(rows, MAX_LEN, generator=g, dtype=torch.float64) for _ in range(steps)]
    entropies = torch.rand(rows, MAX_LEN, generator=g, dtype=torch.float64) * torch.rand(rows, 1, generator=g, dtype=torch.float64) * 8  # rows differ
    sampling = old + 0.15 * torch.randn(rows, MAX_LEN, generator=g, dtype=torch.float64)  # drawn last: the rest unchanged
    return Batch(rewards, mask, old, ref, current, entropies, sampling)


# ---------------------------------------------------------------- TRL's side
def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """The advantage block of TRL's _generate_and_score_completions (multi_objective_aggregation=sum_then_normalize),
    executed on `rewards` (one reward function of weight 1)."""
    from trl.trainer import grpo_trainer

    source = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    start = source.index('        if self.multi_objective_aggregation == "sum_then_normalize":')
    end = source.index("        advantages = torch.nan_to_num(advantages, nan=0.0)")
    block = textwrap.dedent(source[start:end]) + "advantages = torch.nan_to_num(advantages, nan=0.0)\n"
    stand_in = types.SimpleNamespace(multi_objective_aggregation="sum_then_normalize", scale_rewards=scale_rewards, reward_weights=torch.ones(1))
    scope = {
        **vars(grpo_trainer),
        "self": stand_in,
        "rewards_per_func": rewards.unsqueeze(1),
        "num_generations": num_generations,
        "device": rewards.device,
        "unscorable_mask": torch.zeros(len(rewards), dtype=torch.bool),
    }
    exec(compile(block, "trl:GRPOTrainer._generate_and_score_completions", "exec"), scope)  # noqa: S102 - TRL's installed source
    return scope["advantages"]


def trl_is_ratio(setting: Setting, batch: Batch) -> torch.Tensor | None:
    """The vLLM importance-sampling block of TRL's _generate_and_score_completions, executed on the injected old and
    sampling log-probs of the whole generation batch: [R, T] (token modes) or [R, 1] (sequence modes); None if off."""
    mode = setting.trl.get("vllm_importance_sampling_mode")
    if mode is None:
        return None
    from trl.trainer import grpo_trainer

    source = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    start = source.index("            # Compute the importance sampling ratio when using vLLM")
    end = source.index("            # Compute the per-token log probabilities for the reference model")
    stand_in = types.SimpleNamespace(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=setting.trl["vllm_importance_sampling_clip_min"],
        vllm_importance_sampling_clip_max=setting.trl["vllm_importance_sampling_clip_max"],
    )
    scope = {
        **vars(grpo_trainer),
        "self": stand_in,
        "completion_mask": batch.mask,
        "tool_mask": None,
        "old_per_token_logps": batch.old,
        "sampling_per_token_logps": batch.sampling,
    }
    exec(compile(textwrap.dedent(source[start:end]), "trl:GRPOTrainer._generate_and_score_completions", "exec"), scope)  # noqa: S102
    return scope["vllm_importance_sampling_ratio"]


class _OneProcess:
    """accelerate.Accelerator's collectives for one process."""

    num_processes, process_index = 1, 0

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_step(setting: Setting, batch: Batch, advantages: torch.Tensor, step: int) -> tuple[float, torch.Tensor]:
    """TRL's loss of one optimizer step (the sum of its micro-batches' _compute_loss) and the gradient w.r.t. the
    current log-probs of the step's rows."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    a = setting.trl
    ga = setting.micro_batches
    current = batch.current[step].clone().requires_grad_(True)
    is_ratio = trl_is_ratio(setting, batch)
    rows_per_step = setting.rows * ga
    rows_in_generation = rows_per_step * setting.steps
    stand_in = types.SimpleNamespace(
        top_entropy_quantile=a["top_entropy_quantile"],
        off_policy_mask_threshold=None,
        importance_sampling_level=a.get("importance_sampling_level", "token"),
        beta=a["beta"],
        loss_type=a["loss_type"],
        epsilon_low=a["epsilon"],
        epsilon_high=a["epsilon_high"] if a["epsilon_high"] is not None else a["epsilon"],
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=ga,
        accelerator=_OneProcess(),
        max_completion_length=MAX_LEN,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": _Sink()},
        args=types.SimpleNamespace(
            use_bias_correction_kl=a["use_bias_correction_kl"],
            delta=a.get("delta"),
            sapo_temperature_pos=a.get("sapo_temperature_pos", 1.0),
            sapo_temperature_neg=a.get("sapo_temperature_neg", 1.05),
            steps_per_generation=ga * setting.steps,
        ),
    )
    stand_in.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, stand_in)
    total = 0.0
    num_items = batch.mask[:rows_in_generation].sum()  # TRL: the generation batch's tokens
    for k in range(ga):
        rows = slice(step * rows_per_step + k * setting.rows, step * rows_per_step + (k + 1) * setting.rows)
        stand_in._get_per_token_logps_and_entropies = lambda *args, _r=rows, **kw: (current[_r], batch.entropies[_r], None)
        inputs = {
            "prompt_ids": torch.zeros(setting.rows, 1, dtype=torch.long),
            "prompt_mask": torch.ones(setting.rows, 1, dtype=torch.long),
            "completion_ids": torch.zeros(setting.rows, MAX_LEN, dtype=torch.long),
            "completion_mask": batch.mask[rows],
            "advantages": advantages[rows],
            "ref_per_token_logps": batch.ref[rows],
            "num_items_in_batch": num_items,
        }
        if setting.inject_old:
            inputs["old_per_token_logps"] = batch.old[rows]
        if is_ratio is not None:
            inputs["importance_sampling_ratio"] = is_ratio[rows]
        total = total + GRPOTrainer._compute_loss(stand_in, None, inputs)
    total.backward()
    return float(total), current.grad[step * rows_per_step : (step + 1) * rows_per_step]


class _Sink(dict):
    """TRL's metrics dict: every key accepts appends."""

    def __missing__(self, key):
        self[key] = []
        return self[key]


# ---------------------------------------------------------------- vlmrl's side
def vlmrl_step(setting: Setting, batch: Batch, advantages: torch.Tensor, step: int) -> tuple[float, torch.Tensor]:
    """vlmrl's loss of one optimizer step as train.accumulate computes it, and its gradient (same rows as trl_step)."""
    cfg = vlmrl_config(setting)
    algo = cfg.algorithm
    rows_per_step = setting.rows * setting.micro_batches
    step_rows = list(range(step * rows_per_step, (step + 1) * rows_per_step))
    current = batch.current[step].clone().requires_grad_(True)
    norm = step_normaliser([batch.mask[step_rows]], MAX_LEN, chunk_rows=setting.rows)
    rollout_tokens = float(batch.mask[: rows_per_step * setting.steps].sum())
    norm = dataclasses.replace(norm, rollout_tokens_per_step=max(1.0, rollout_tokens / setting.steps))
    scores = types.SimpleNamespace(is_weights=None, entropy_mask=None)  # train.Scores' two per-token factors
    if algo.top_entropy_quantile < 1.0:  # train.step_entropy_masks: one quantile over the optimizer step's tokens
        scores.entropy_mask = torch.zeros_like(batch.mask, dtype=torch.bool)
        scores.entropy_mask[step_rows] = entropy_quantile_mask(batch.entropies[step_rows], batch.mask[step_rows], algo.top_entropy_quantile)
    if algo.rollout_correction != "none":  # train.score: the rollout's old log-probs against the sampler's
        correct = ROLLOUT_CORRECTIONS[algo.rollout_correction]
        scores.is_weights = correct(batch.old, batch.sampling, batch.mask, algo.rollout_correction_min, algo.rollout_correction_max)
    total = 0.0
    for k in range(setting.micro_batches):
        idx = step_rows[k * setting.rows : (k + 1) * setting.rows]
        logps = current[idx]
        old = batch.old[idx] if setting.inject_old else logps.detach()
        weights = policy_weights(scores, idx, MAX_LEN)
        tok, _ = per_token_loss(logps, old, advantages[idx], algo, batch.ref[idx], mask=batch.mask[idx], is_weights=weights)
        total = total + aggregate(tok, batch.mask[idx], cfg.loss_aggregation, norm.for_rows([i - step_rows[0] for i in idx]))
    total.backward()
    return float(total), current.grad[step_rows]


def vlmrl_config(setting: Setting) -> Config:
    """vlmrl's validated config for the setting's algorithm fields, algorithm.preset applied as load_config does."""
    tree = {"algorithm": dict(setting.vlmrl)}
    apply_preset(tree)
    return build_config(tree)


def vlmrl_advantages(setting: Setting, rewards: torch.Tensor) -> torch.Tensor:
    cfg = vlmrl_config(setting)
    return ADVANTAGE_ESTIMATORS[cfg.advantage_estimator](rewards, G, cfg.algorithm)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-12)."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def batch_for(setting: Setting, seed: int = 0) -> Batch:
    """The injected tensors of a setting: its rows in whole groups."""
    rows = setting.rows * setting.micro_batches * setting.steps
    return make_batch(rows + (-rows) % G, setting.steps, seed)


def compare(setting: Setting, seed: int = 0) -> dict:
    """Max relative differences of advantages, loss (per optimizer step) and gradient between TRL and vlmrl."""
    batch = batch_for(setting, seed)
    adv_trl = trl_advantages(batch.rewards, G, setting.trl["scale_rewards"])
    adv_vlmrl = vlmrl_advantages(setting, batch.rewards)
    out = {"setting": setting.name, "claimed_same": setting.claimed_same, "advantages": _rel(adv_vlmrl, adv_trl), "loss": 0.0, "grad": 0.0}
    for step in range(setting.steps):
        loss_t, grad_t = trl_step(setting, batch, adv_trl, step)
        loss_v, grad_v = vlmrl_step(setting, batch, adv_trl, step)  # the same advantages: the loss compared alone
        out["loss"] = max(out["loss"], abs(loss_v - loss_t) / max(abs(loss_t), 1e-12))
        out["grad"] = max(out["grad"], _rel(grad_v, grad_t))
    out["clipped_tokens"] = float(((torch.exp(batch.current[0] - batch.old) - 1).abs() > 0.2)[batch.mask.bool()].double().mean())
    return out


def main() -> None:
    import trl

    results = [compare(s) for s in settings()]
    day = datetime.date.today().isoformat()
    out = pathlib.Path(__file__).parent / "results" / f"trl_oracle_cpu_{day}"
    meta = {"trl": trl.__version__, "torch": torch.__version__, "dtype": "float64", "command": "python benchmarks/trl_oracle.py"}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    lines = [
        f"# vlmrl vs TRL {trl.__version__}: advantages, loss and gradient on injected tensors ({day})",
        "",
        f"`{meta['command']}` (torch {torch.__version__}, float64, CPU). Max relative difference (max |vlmrl - TRL| / max |TRL|);",
        "the loss and gradient columns use TRL's advantages on both sides, so each column is compared alone.",
        "Rows marked 'known difference' are listed in docs/vs_trl.md.",
        "",
        "| setting | advantages | loss | grad | |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        note = "" if r["claimed_same"] else "known difference"
        lines.append(f"| {r['setting']} | {r['advantages']:.1e} | {r['loss']:.1e} | {r['grad']:.1e} | {note} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [r["setting"] for r in results if r["claimed_same"] and max(r["advantages"], r["loss"], r["grad"]) > 1e-6]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
