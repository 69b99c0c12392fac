"""On-policy distillation (algorithm.teacher_path, issue 39 part 3): the per-token advantages and loss on hand-computed
tensors, the refusal of a teacher with another tokenizer, and runs with a tiny teacher."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from vlmrl.algo.distill import distill_advantages, distill_metrics, reverse_kl_per_token
from vlmrl.algo.losses import aggregate, per_token_loss, step_normaliser

# Two completions of two tokens; the second row's second token is padding.
STUDENT = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
TEACHER = torch.tensor([[-1.5, -1.0], [-0.5, -4.0]])
MASK = torch.tensor([[1, 1], [1, 0]])
ADV = torch.tensor([1.0, -0.5])  # the rewards' advantage of each row


def test_reverse_kl_by_hand():
    # log pi_s - log pi_t: 0.5, -1.0 | 0.0, (masked)
    assert reverse_kl_per_token(STUDENT, TEACHER, MASK).tolist() == [[0.5, -1.0], [0.0, 0.0]]


def test_advantages_with_rewards_by_hand():
    # A - 0.5 x (s - t): 1 - 0.25, 1 + 0.5 | -0.5 - 0, -0.5 (masked: the reward's advantage, no term)
    got = distill_advantages(ADV, STUDENT, TEACHER, MASK, coef=0.5)
    assert got.tolist() == [[0.75, 1.5], [-0.5, -0.5]]
    assert not got.requires_grad


def test_advantages_of_the_teacher_alone_by_hand():
    got = distill_advantages(ADV, STUDENT, TEACHER, MASK, coef=0.5, with_rewards=False)
    assert got.tolist() == [[-0.25, 0.5], [0.0, 0.0]]


def test_per_token_rewards_advantages_are_kept():
    per_token = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert distill_advantages(per_token, STUDENT, TEACHER, MASK, coef=1.0).tolist() == [[0.5, 3.0], [3.0, 4.0]]


def test_metrics_by_hand():
    m = distill_metrics(STUDENT, TEACHER, MASK)
    assert m["distill/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    assert m["distill/teacher_logp"] == pytest.approx((-1.5 - 1.0 - 0.5) / 3)


def test_policy_gradient_loss_with_the_distillation_advantages_by_hand():
    """On-policy (old = logps) GRPO's ppo_clip with the per-token advantages: d loss / d logp_t = -A_t / |y_i| / N
    (seq_mean_token_mean), so tokens the teacher likes more than the student (s < t) are pushed up."""
    algo = types.SimpleNamespace(policy_loss="ppo_clip", epsilon=0.2, epsilon_high=None, delta=None, beta=0.0)
    logps = STUDENT.clone().requires_grad_(True)
    adv = distill_advantages(ADV, STUDENT, TEACHER, MASK, coef=0.5, with_rewards=False)
    loss, _ = per_token_loss(logps, logps.detach(), adv, algo, mask=MASK)
    total = aggregate(loss, MASK, "seq_mean_token_mean", step_normaliser([MASK], 2))
    total.backward()
    # row 0: 2 tokens, -(-0.25)/2/2, -(0.5)/2/2; row 1: 1 token, -(0)/1/2, padding 0
    assert logps.grad.tolist() == [[0.0625, -0.125], [0.0, 0.0]]
    assert total.item() == pytest.approx((0.25 - 0.5) / 2 / 2)


def test_the_advantages_lower_the_exact_reverse_kl_of_a_categorical_student():
    """Direction: a categorical student per position (logits z [T, V]) sampling from itself, trained by ppo_clip with
    the teacher-only advantages and Adam, ends with a lower exact KL(student || teacher) over the full distributions;
    with the sign of the term flipped it rises."""
    algo = types.SimpleNamespace(policy_loss="ppo_clip", epsilon=0.2, epsilon_high=None, delta=None, beta=0.0)

    def run(coef: float) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(0)
        V, N, T = 50, 64, 4
        teacher = torch.log_softmax(torch.randn(T, V, generator=gen) * 3, -1)
        z = torch.zeros(T, V, requires_grad=True)
        opt = torch.optim.Adam([z], lr=0.05)

        def exact() -> float:
            s = torch.log_softmax(z.detach(), -1)
            return float((s.exp() * (s - teacher)).sum(-1).mean())

        start = exact()
        for _ in range(30):
            ids = torch.multinomial(torch.softmax(z.detach(), -1), N, replacement=True, generator=gen).T  # [N, T]
            logps = torch.log_softmax(z, -1)[torch.arange(T), ids]
            mask = torch.ones(N, T)
            adv = distill_advantages(torch.zeros(N), logps.detach(), teacher[torch.arange(T), ids], mask, coef, with_rewards=False)
            loss, _ = per_token_loss(logps, logps.detach(), adv, algo, mask=mask)
            opt.zero_grad()
            aggregate(loss, mask, "seq_mean_token_mean", step_normaliser([mask], T)).backward()
            opt.step()
        return start, exact()

    start, end = run(1.0)
    assert end < 0.7 * start, (start, end)
    flipped_start, flipped_end = run(-1.0)
    assert flipped_end > flipped_start


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_another_tokenizer_refused_in_one_line_naming_both_folders():
    from vlmrl.models.loading import ModelLoadError
    from vlmrl.models.teacher import check_teacher

    student, teacher = _Tok({"a": 0, "b": 1}), _Tok({"a": 0, "b": 2, "c": 1})
    with pytest.raises(ModelLoadError) as e:
        check_teacher(student, teacher, 8, 8, "/models/student", "/models/teacher")
    msg = str(e.value)
    assert "\n" not in msg and "/models/student" in msg and "/models/teacher" in msg and "tokenizer" in msg
    assert "'b'" in msg and "'c'" in msg
    check_teacher(student, _Tok({"b": 1, "a": 0}), 8, 8, "s", "t")  # same ids: accepted


def test_a_teacher_head_smaller_than_the_students_refused():
    from vlmrl.models.loading import ModelLoadError
    from vlmrl.models.teacher import check_teacher

    with pytest.raises(ModelLoadError, match="fewer than the 10"):
        check_teacher(_Tok({"a": 0}), _Tok({"a": 0}), 10, 8, "s", "t")


def test_config_fields_checked():
    from vlmrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="algorithm.distill_coef=-1.0 must be >= 0"):
        load_config(None, ["algorithm.teacher_path=/x", "algorithm.distill_coef=-1"])
    cfg = load_config(None, ["algorithm.teacher_path=/x"])
    assert cfg.scores_old_logps and not load_config(None, []).scores_old_logps


# ---------------------------------------------------------------- runs with a tiny teacher
@pytest.fixture(scope="module")
def sharp_teacher(tiny_qwen25vl, tmp_path_factory):
    """The session's tiny model with its LM head scaled by 8: the same tokenizer, a much sharper version of the
    policy's next-token distribution (a random tiny model's is near uniform, so any two of them have a reverse KL
    near 0). The policy can reach it exactly (by scaling its own head), so distillation has somewhere to go."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("sharp-teacher") / "teacher"
    shutil.copytree(tiny_qwen25vl, folder)
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8
    save_file(tensors, shard, metadata={"format": "pt"})
    return folder


def _metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


@pytest.mark.integration
def test_a_teacher_that_is_the_policy_has_zero_reverse_kl(tiny_qwen25vl, tmp_path):
    """The student's own folder as teacher: the teacher's log-probs of the sampled tokens equal the sampling policy's
    at step 1 (same weights, the same processor re-encodes the prompts), so the reverse KL is 0."""
    from test_integration import grpo_cfg
    from vlmrl.data.tasks import make_count_task
    from vlmrl.train import train

    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    out = tmp_path / "self"
    train(grpo_cfg(tiny_qwen25vl, data, out, f"algorithm.teacher_path={tiny_qwen25vl}", "training.max_steps=1"))
    (m,) = _metrics(out)
    assert abs(m["distill/reverse_kl"]) < 1e-5 and m["distill/teacher_logp"] < 0


@pytest.mark.integration
def test_the_teacher_alone_trains_the_policy(tiny_qwen25vl, sharp_teacher, tmp_path):
    """distill_with_rewards=false and a reward that is 0 for every completion (no reward advantage at all): without
    the teacher's term every advantage is 0 and nothing would change; with it the policy's weights move."""
    from test_integration import grpo_cfg, weights
    from vlmrl.data.tasks import make_count_task
    from vlmrl.train import train

    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    out = tmp_path / "alone"
    cfg = grpo_cfg(
        tiny_qwen25vl,
        data,
        out,
        f"algorithm.teacher_path={sharp_teacher}",
        "algorithm.distill_with_rewards=false",
        "algorithm.reward_funcs=[accuracy]",  # the random tiny model never answers: 0 everywhere
    )
    train(cfg)
    ms = _metrics(out)
    assert all(m["reward_std"] == 0 for m in ms)  # no reward signal: any change is the teacher's
    assert all(m["distill/reverse_kl"] > 0.5 for m in ms)  # the sharp teacher is far from the near-uniform policy
    before, after = weights(tiny_qwen25vl), weights(out / "final")
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert "lm_head.weight" in moved and len(moved) > len(before) // 2, (len(moved), len(before))


@pytest.mark.integration
def test_a_teacher_with_another_tokenizer_is_refused_before_training(tiny_qwen25vl, tmp_path):
    """The teacher folder's tokenizer gains a token: the run stops before step 1 with one line naming both folders."""
    from transformers import AutoTokenizer

    from test_integration import grpo_cfg
    from vlmrl.data.tasks import make_count_task
    from vlmrl.models.loading import ModelLoadError
    from vlmrl.train import train

    teacher = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_qwen25vl, teacher)
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.add_tokens(["<not_in_the_student>"])
    tok.save_pretrained(teacher)
    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    out = tmp_path / "refused"
    with pytest.raises(ModelLoadError) as e:
        train(grpo_cfg(tiny_qwen25vl, data, out, f"algorithm.teacher_path={teacher}"))
    msg = str(e.value)
    assert "\n" not in msg and str(teacher) in msg and str(tiny_qwen25vl) in msg and "<not_in_the_student>" in msg
    assert not (out / "metrics.jsonl").exists() or not _metrics(out)


# ---------------------------------------------------------------- the planner
def test_the_planner_holds_the_teacher_like_a_reference_copy():
    """A teacher of 3x the policy's parameters: on the device it is persistent (weights of its own size in the
    policy's dtype); with memory.ref_placement=cpu it waits in host RAM and is moved in for scoring only. No teacher:
    both terms 0 and the plan unchanged."""
    import dataclasses

    from test_planner import FP32, SPEC

    from vlmrl.plan.estimate import plan

    T = 3 * SPEC.total_params
    base, on_device = plan(SPEC, FP32), plan(SPEC, dataclasses.replace(FP32, teacher_params=T))
    assert base.terms["teacher_model"] == 0 and base.terms["teacher_moved_in_for_scoring"] == 0
    assert on_device.terms["teacher_model"] == T * 4  # float32
    # persistent through every phase: each phase's peak grows by the teacher (and the scoring pass it adds)
    assert on_device.phases["rollout"] - base.phases["rollout"] >= T * 4
    cpu = plan(SPEC, dataclasses.replace(FP32, teacher_params=T, ref_placement="cpu"))
    assert cpu.terms["teacher_model"] == 0 and cpu.terms["teacher_moved_in_for_scoring"] == T * 4
    assert cpu.host["reference_on_cpu"] == T * 4
    assert cpu.phases["scoring"] >= base.phases["rollout"] + T * 4


def test_workload_from_a_config_with_a_teacher_counts_its_parameters(tiny_qwen25vl):
    from vlmrl.config import load_config
    from vlmrl.plan.config import workload_from_config
    from vlmrl.plan.hf import spec_from_hf_config

    cfg = load_config(None, [f"model.name_or_path={tiny_qwen25vl}", f"algorithm.teacher_path={tiny_qwen25vl}"])
    assert workload_from_config(cfg).teacher_params == spec_from_hf_config(str(tiny_qwen25vl)).total_params > 0
    assert workload_from_config(load_config(None, [f"model.name_or_path={tiny_qwen25vl}"])).teacher_params == 0


# ---------------------------------------------------------------- offloading the teacher
class _Moves(torch.nn.Module):
    """A stand-in teacher that records where it is moved (a CPU-only machine cannot watch a real device move)."""

    def __init__(self):
        super().__init__()
        self.moves = []

    def to(self, where):
        self.moves.append(str(where))
        return self


@pytest.mark.parametrize("placement", ["cpu", "device"])
def test_a_teacher_waits_on_the_host_with_ref_placement_cpu(monkeypatch, placement):
    """memory.ref_placement=cpu: the teacher is put in host RAM when made, moved to the device only inside its scoring
    context and back to the host after it; ref_placement=device: it is never moved."""
    import vlmrl.models.teacher
    from vlmrl.config import load_config
    from vlmrl.train import make_teacher

    stand_in = _Moves()
    monkeypatch.setattr(vlmrl.models.teacher, "load_teacher", lambda *a: (stand_in, "its processor"))
    cfg = load_config(None, ["algorithm.teacher_path=/teacher", f"memory.ref_placement={placement}"])
    teacher = make_teacher(None, None, cfg, torch.device("cuda", 0))
    assert teacher.processor == "its processor"
    made = list(stand_in.moves)
    with teacher as model:
        assert model is stand_in
        inside = list(stand_in.moves)
    if placement == "cpu":
        assert made == ["cpu"] and inside == ["cpu", "cuda:0"] and stand_in.moves == ["cpu", "cuda:0", "cpu"]
    else:
        assert stand_in.moves == []


# ---------------------------------------------------------------- the measurement, short
@pytest.mark.slow
def test_a_distilled_student_ends_closer_to_the_teacher_than_grpo_alone(tmp_path):
    """A shorter benchmarks/distill.py, one training seed: the demo's teacher (SFT + 150 GRPO steps, above chance) and,
    from the teacher's SFT start, 50 steps of GRPO alone and of GRPO + reverse KL to the teacher (distill_coef=1). On
    the held-out test split the distilled student's final accuracy is nearer the teacher's than GRPO alone's, and its
    per-token reverse KL on its own samples fell. With the distillation term zeroed in algo/distill.py it fails (both
    students 25%)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    cmd = [sys.executable, str(root / "benchmarks" / "distill.py"), "--out-dir", str(tmp_path / "bench"), "--results", str(tmp_path / "r")]
    cmd += "--teacher-steps 150 --eval-set test --seeds 1 --coefs 1 --steps 50 --eval-steps 50 --only grpo,mixed".split()
    subprocess.run(cmd, check=True, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    r = json.loads((tmp_path / "r.json").read_text())
    teacher = r["teacher"]["on_eval_set"]
    grpo, mixed = (r["runs"][name]["1"] for name in ("grpo", "mixed 1"))
    start = grpo["accuracy"]["0"]
    assert teacher > start, f"the teacher ({teacher}) is no better than the students' start ({start}): nothing to distil"
    final = {name: run["accuracy"]["50"] for name, run in (("grpo", grpo), ("mixed", mixed))}
    assert abs(teacher - final["mixed"]) < abs(teacher - final["grpo"]), (teacher, final)
    kl = mixed["reverse_kl"]
    assert sum(kl[str(s)] for s in range(46, 51)) < sum(kl[str(s)] for s in range(1, 6))
