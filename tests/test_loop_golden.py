"""The loop's wiring against golden values: every loss_type x scale_rewards (and mask_truncated_completions)
through train() for two steps. The golden file was recorded from the loop before it was restructured into
phase functions; a change in what gradient the loop computes shows up here as a changed loss, grad norm or weight.

Every case's rollout (generation_batch_size 8, 4 rows per optimizer step) spans two optimizer steps, so the second
step's rows were sampled before the first step changed the policy. The cases that do so with num_iterations=1 were
re-recorded when old log-probs started being scored for them (issue 25, part 1: before, the second step took its
ratio against itself, 1); with that change reverted, the loop reproduces the earlier values of all of them.

Re-record (only when the math is meant to change): VLMRL_RECORD_GOLDEN=1 pytest tests/test_loop_golden.py
"""

import json
import os
import pathlib

import pytest
from safetensors.torch import load_file

from vlmrl.config import load_config
from vlmrl.data.tasks import make_count_task
from vlmrl.train import train

pytestmark = pytest.mark.integration

GOLDEN = pathlib.Path(__file__).parent / "golden" / "loop_golden.json"
LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"
RECORD = os.environ.get("VLMRL_RECORD_GOLDEN") == "1"

CASES = {
    f"{lt}-{sr}": [f"algorithm.loss_type={lt}", f"algorithm.scale_rewards={sr}"]
    for lt in ("grpo", "dapo", "dr_grpo")
    for sr in ("group", "batch", "none")
}
# Long enough that some completions are truncated and some are not: the mask then changes the loss.
CASES["mask_truncated"] = ["algorithm.mask_truncated_completions=true", "rollout.max_completion_length=3"]
CASES["iterations_kl"] = ["algorithm.num_iterations=2", "algorithm.beta=0.1", "training.per_device_train_batch_size=2"]
# Rollouts spanning several optimizer steps with the 2026 pieces: bnpo's per-micro-batch normaliser (2 micro-batches of
# 2 rows per step), TRL's ratio-corrected KL, SAPO's gate and two-sided clipping.
CASES["span_bnpo_k3_ratio"] = [
    "algorithm.loss_type=bnpo",
    "algorithm.beta=0.1",
    "algorithm.use_bias_correction_kl=true",
    "training.per_device_train_batch_size=2",
    "training.gradient_accumulation_steps=2",
]
CASES["span_sapo_iterations"] = ["algorithm.policy_loss=sapo", "algorithm.num_iterations=2"]
CASES["span_delta"] = ["algorithm.delta=1.5", "algorithm.epsilon=0.05"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=0, seed=0, image_size=56)


def run(model, data, out, extra):
    cfg = load_config(
        None,
        [
            f"model.name_or_path={model}",
            f"data.train_path={data['train']}",
            "data.eval_path=",
            f"training.output_dir={out}",
            "training.max_steps=2",
            "rollout.num_generations=4",
            "training.per_device_train_batch_size=4",
            "rollout.generation_batch_size=8",
            "rollout.max_completion_length=5",
            "optim.learning_rate=1e-2",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            f"algorithm.reward_funcs=['{LENGTH_REWARD}']",
            "training.seed=3",
            *extra,
        ],
    )
    train(cfg, log=lambda *_: None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(out / "final" / "model.safetensors")
    return {
        "steps": [{k: r[k] for k in ("reward", "loss", "grad_norm", "kl", "clip_ratio", "completions/truncated_frac")} for r in rows],
        "weight_abs_sum": float(sum(w.double().abs().sum() for w in weights.values())),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_loop_matches_golden(case, tiny_qwen25vl, data, tmp_path):
    got = run(tiny_qwen25vl, data, tmp_path / case, CASES[case])
    if RECORD:
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[case] = got
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    want = json.loads(GOLDEN.read_text())[case]
    assert len(got["steps"]) == len(want["steps"]) == 2
    for g, w in zip(got["steps"], want["steps"]):
        for key in w:
            # 1e-3: a machine with other CPU kernels moved one KL value by 1.5e-4 (AMD EPYC vs the recording machine, same
            # packages); a change in what the loop computes moves these values by far more.
            assert g[key] == pytest.approx(w[key], rel=1e-3, abs=1e-7), (case, key)
    # The weight sum is the coarse check (a lost or doubled update moves it by hundreds; the losses and grad norms above
    # carry the fine ones). Its tolerance is AdamW's, not float32's: an element whose gradient is rounding noise gets a
    # full step of lr (1e-2) in either direction, so another CPU's rounding moves the sum by multiples of 2 * lr per
    # update. Measured on an Intel Xeon against the recording machine, all cases (1 and 2 threads alike): largest 0.042
    # (span_sapo_iterations), next 0.011. 0.25 allows a few such elements over the two steps' updates.
    assert got["weight_abs_sum"] == pytest.approx(want["weight_abs_sum"], rel=0, abs=0.25)


def test_golden_cases_differ():
    """The cases exercise different math: equal updates across them would mean an option is not wired.
    The three loss types coincide when every completion has the maximum length, as with this random model (their
    differences are unit-tested in test_algorithm.py), so the distinct cases are the advantage scalings and options."""
    golden = json.loads(GOLDEN.read_text())
    distinct = [
        "grpo-group",
        "grpo-batch",
        "grpo-none",
        "mask_truncated",
        "iterations_kl",
        "span_bnpo_k3_ratio",
        "span_sapo_iterations",
        "span_delta",
    ]
    sums = {case: round(golden[case]["weight_abs_sum"], 3) for case in distinct}
    assert len(set(sums.values())) == len(sums), sums
    # Every completion of mask_truncated hit the length limit, so nothing is left in the loss: no update at all.
    assert all(s["completions/truncated_frac"] == 1.0 and s["grad_norm"] == 0.0 for s in golden["mask_truncated"]["steps"])
