"""rollout.max_staleness = k > 0: a producer process samples ahead while the trainer updates (rollout/pipeline.py).

Oracles: each step's rows were sampled by version max(0, s-1-k) >= s-1-k (never more than k behind, enforced);
the behaviour log-probs the producer reports equal a teacher-forced forward of THAT version's weights (kept by the
test after every step) and not of the trained one's; the update's old log-probs are those behaviour log-probs; a run
stopped with rollouts in flight and resumed trains the same (prompt, sample) pairs as an uninterrupted run.
"""

import copy
import pathlib

import pytest
import torch

from vlmrl import train as loop
from vlmrl.config import ConfigError, load_config
from vlmrl.data.tasks import make_count_task
from vlmrl.models.prefix import completion_logps_for
from vlmrl.models.processing import select_rows
from vlmrl.rollout.pipeline import StalenessError, check_staleness, completions_of, sampling_version, staleness_metrics
from vlmrl.rollout.producer import completions_message
from vlmrl.models.rollout import Completions

LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"


def _config(model, data, out, *extra):
    return load_config(
        None,
        [
            f"model.name_or_path={model}",
            f"data.train_path={data['train']}",
            "data.eval_path=",
            f"training.output_dir={out}",
            "training.max_steps=4",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=4",
            "rollout.max_completion_length=4",
            "optim.learning_rate=5e-2",
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


# ---------------------------------------------------------------- the schedule and its guard (pure)
@pytest.mark.unit
@pytest.mark.parametrize("k, want", [(0, [0, 1, 2, 3, 4]), (1, [0, 0, 1, 2, 3]), (2, [0, 0, 0, 1, 2])])
def test_sampling_version_schedule(k, want):
    assert [sampling_version(s, k) for s in range(1, 6)] == want


@pytest.mark.unit
def test_staleness_guard_and_metrics():
    versions = torch.tensor([3, 3, 2, 2])  # step 5 is trained by version 4: 1 and 2 behind
    assert staleness_metrics(5, versions) == {"staleness/mean": 1.5, "staleness/max": 2.0}
    check_staleness(5, versions, 2)
    with pytest.raises(StalenessError, match="2 versions behind; rollout.max_staleness=1 allows 0..1"):
        check_staleness(5, versions, 1)
    with pytest.raises(StalenessError):  # a version from the future is no sampler of this step either
        check_staleness(2, torch.tensor([2]), 1)


@pytest.mark.unit
def test_completions_survive_the_wire_exactly():
    logps = torch.randn(2, 3, dtype=torch.float32)
    comp = Completions(torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]]), torch.tensor([True, False]), logps)
    back = completions_of(completions_message(comp, 4, 2, 0.5))
    assert torch.equal(back.ids, comp.ids) and torch.equal(back.mask, comp.mask) and torch.equal(back.truncated, comp.truncated)
    assert torch.equal(back.sampling_logps, logps)  # bit for bit


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra, refused",
    [
        (["rollout.max_staleness=-1"], "rollout.max_staleness=-1"),
        (["rollout.max_staleness=1", "algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling=true"),
        (["rollout.max_staleness=1", "memory.shared_prefix=false"], "memory.shared_prefix=false"),
        (["rollout.max_staleness=1", "rollout.backend=vllm"], "rollout.backend=vllm"),
    ],
)
def test_pipeline_refusals_name_the_field(extra, refused, tmp_path):
    with pytest.raises(ConfigError, match=refused.replace(".", r"\.")):
        _config("m", {"train": "x.jsonl"}, tmp_path, *extra)


@pytest.mark.unit
def test_areal_name_sets_max_staleness(tmp_path):
    assert _config("m", {"train": "x.jsonl"}, tmp_path, "rollout.max_head_offpolicyness=2").rollout.max_staleness == 2


# ---------------------------------------------------------------- a real run with a producer process
def _record_run(cfg, monkeypatch, stop_after=None):
    """Train `cfg`; returns ({step: {samples, version, indices, old}}, {version: state dict}) as the trainer saw them."""
    seen, versions = {}, {}
    start, take, score, after = loop.start_pipeline, loop.pipelined_rollout, loop.score, loop.after_update

    def snapshot_start(cfg, dist, model, per_prompt_seed, pad_id, state, log):
        versions[state["step"]] = copy.deepcopy(model.state_dict())
        return start(cfg, dist, model, per_prompt_seed, pad_id, state, log)

    def taken(run, step):
        samples = take(run, step)
        entry = run.pipeline.queue[step]
        seen[step] = {"samples": samples, "version": entry.version, "indices": list(entry.indices)}
        return samples

    def scored(run, samples, rewards):
        scores = score(run, samples, rewards)
        step = max(seen)
        seen[step]["old"] = scores.old_logps.detach().cpu().clone()
        seen[step]["is_weights"] = None if scores.is_weights is None else scores.is_weights.detach().cpu().clone()
        return scores

    def pushed(run, step):
        versions[step] = copy.deepcopy(run.model.state_dict())
        return after(run, step)

    monkeypatch.setattr(loop, "start_pipeline", snapshot_start)
    monkeypatch.setattr(loop, "pipelined_rollout", taken)
    monkeypatch.setattr(loop, "score", scored)
    monkeypatch.setattr(loop, "after_update", pushed)
    loop.train(cfg, lambda *_: None, stop_after=stop_after)
    return seen, versions


def _teacher_forced(model, samples, opts):
    comp = samples.completions
    out = torch.zeros(comp.ids.shape)
    with torch.no_grad():
        for i in range(comp.ids.shape[0]):
            n = int(comp.lengths[i])
            prompt = select_rows(samples.prompts, [int(samples.prompt_of_row[i])])
            out[i, :n] = completion_logps_for(model, prompt, torch.tensor([0]), comp.ids[i : i + 1, :n], comp.mask[i : i + 1, :n], opts)[0]
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_rows_come_from_a_version_at_most_k_behind_with_its_log_probs(k, tiny_qwen25vl, tmp_path, monkeypatch):
    from vlmrl.models.loading import load_model
    from vlmrl.models.prefix import LogprobOptions

    data = make_count_task(tmp_path / "count", n_train=8, n_test=0, seed=0, image_size=56)
    cfg = _config(tiny_qwen25vl, data, tmp_path / "run", f"rollout.max_staleness={k}")
    seen, versions = _record_run(cfg, monkeypatch)
    assert sorted(seen) == [1, 2, 3, 4]
    policy = load_model(cfg.model).eval()
    opts = LogprobOptions.from_config(cfg, torch.device("cpu"))
    for step, got in seen.items():
        assert got["version"] == sampling_version(step, k) and step - 1 - got["version"] <= k
        samples = got["samples"]
        mask = samples.completions.mask.bool()
        behaviour = samples.completions.sampling_logps.cpu()
        policy.load_state_dict(versions[got["version"]])
        torch.testing.assert_close(behaviour[mask], _teacher_forced(policy, samples, opts)[mask], rtol=0, atol=1e-4)
        # the update's old log-probs are the sampler's (pi_theta / pi_behaviour), not the trained policy's
        assert torch.equal(got["old"], behaviour)
        if got["version"] != step - 1:  # stale: the trained version's log-probs differ, so the check above can fail
            policy.load_state_dict(versions[step - 1])
            assert float((_teacher_forced(policy, samples, opts)[mask] - behaviour[mask]).abs().max()) > 1e-3
    assert any(got["version"] < step - 1 for step, got in seen.items())  # the run did train stale rows
    lines = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"staleness/max"' in line]
    assert len(lines) == 4


# ---------------------------------------------------------------- stop / kill with rollouts in flight, then resume
def _trained_pairs(out: pathlib.Path) -> dict[int, list]:
    """{step: [(prompt, completion), ...]} of every row the run trained (samples.jsonl; a step re-run after a kill is
    logged twice and must agree with itself)."""
    import json

    by_step: dict[int, list] = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], []).append((row["prompt"], row["completion"]))
    return by_step


def _same_final_weights(a: pathlib.Path, b: pathlib.Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)


PAIRS = ["training.max_steps=5", "training.save_steps=1", "logging.log_completions=8", "training.seed=5"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_stop_with_rollouts_in_flight_then_resume_trains_the_same_pairs(tiny_qwen25vl, tmp_path):
    data = make_count_task(tmp_path / "count", n_train=12, n_test=0, seed=0, image_size=56)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    loop.train(_config(tiny_qwen25vl, data, straight, "rollout.max_staleness=1", *PAIRS), lambda *_: None)
    loop.train(_config(tiny_qwen25vl, data, stopped, "rollout.max_staleness=1", *PAIRS), lambda *_: None, stop_after=2)
    import json

    queue = json.loads((stopped / "checkpoint-2" / "trainer_state.json").read_text())["rollout_queue"]
    # after step 2: step 3 sampled by version 1 (saved whole), step 4 submitted to version 2 (saved as its prompts)
    assert [(e["step"], e["version"], "ids" in e) for e in queue] == [(3, 1, True), (4, 2, False)]
    loop.train(_config(tiny_qwen25vl, data, stopped, "rollout.max_staleness=1", *PAIRS), lambda *_: None)
    want, got = _trained_pairs(straight), _trained_pairs(stopped)
    assert sorted(got) == [1, 2, 3, 4, 5] and all(len(v) == 4 for v in want.values())  # every row of every step
    assert got == want
    assert _same_final_weights(straight, stopped)


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigkill_with_rollouts_in_flight_then_resume_trains_the_same_pairs(tiny_qwen25vl, tmp_path):
    """SIGKILL at the end of step 3 (its rollout trained, steps 4 and 5 queued or in flight, checkpoint-2 the newest),
    the producer left behind; the same command again: the pairs trained and the final weights are the uninterrupted run's."""
    import os
    import subprocess
    import sys

    from test_resume import overrides

    data = make_count_task(tmp_path / "count", n_train=12, n_test=0, seed=0, image_size=56)
    extra = ["rollout.num_generations=2", "rollout.max_completion_length=4", "rollout.max_staleness=2", *PAIRS]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    loop.train(load_config(None, overrides(tiny_qwen25vl, data, straight, *extra)), lambda *_: None)
    cmd = [sys.executable, "-m", "vlmrl", "train", *overrides(tiny_qwen25vl, data, killed, *extra)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.run(cmd, env={**env, "VLMRL_SIGNAL_AT": "step@3:SIGKILL"}, capture_output=True, text=True, timeout=600)
    assert first.returncode == -9, first.stderr[-3000:]
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    want = _trained_pairs(straight)  # the killed run's log was cut back to checkpoint-2 on resume (rundir.py)
    assert sorted(want) == [1, 2, 3, 4, 5] and all(len(v) == 8 for v in want.values())
    assert _trained_pairs(killed) == want
    assert _same_final_weights(straight, killed)


@pytest.mark.multiproc
def test_a_dead_producer_stops_the_run_in_one_line(tiny_qwen25vl, tmp_path, monkeypatch):
    """The producer SIGKILLed during step 2 (its rollout of step 3 in flight): the run stops with one line naming it."""
    import os
    import signal

    from vlmrl.rollout.pipeline import RolloutProducerError

    data = make_count_task(tmp_path / "count", n_train=8, n_test=0, seed=0, image_size=56)
    cfg = _config(tiny_qwen25vl, data, tmp_path / "run", "rollout.max_staleness=1", "training.max_steps=3")
    take = loop.pipelined_rollout

    def killing(run, step):
        if step == 2:
            os.kill(run.pipeline.process.pid, signal.SIGKILL)
            run.pipeline.process.join()
        return take(run, step)

    monkeypatch.setattr(loop, "pipelined_rollout", killing)
    lines = []
    with pytest.raises(RolloutProducerError) as caught:
        loop.train(cfg, lines.append)
    message = str(caught.value)
    assert "\n" not in message and "the rollout producer (pid" in message and "is gone (exit code -9" in message
    assert "resumes from the newest checkpoint" in message


@pytest.mark.slow
@pytest.mark.multiproc
def test_rollout_correction_weighs_stale_rows_by_proximal_over_behaviour(tiny_qwen25vl, tmp_path, monkeypatch):
    """k=1 with algorithm.rollout_correction=token_truncate: the old log-probs are the trained version's (scored), and
    the loss weights are min(exp(old - behaviour), 3) with behaviour the sampling version's (decoupled PPO)."""
    from vlmrl.models.loading import load_model
    from vlmrl.models.prefix import LogprobOptions

    data = make_count_task(tmp_path / "count", n_train=8, n_test=0, seed=0, image_size=56)
    cfg = _config(
        tiny_qwen25vl, data, tmp_path / "run", "rollout.max_staleness=1", "algorithm.rollout_correction=token_truncate", "training.max_steps=3"
    )
    seen, versions = _record_run(cfg, monkeypatch)
    policy = load_model(cfg.model).eval()
    opts = LogprobOptions.from_config(cfg, torch.device("cpu"))
    stale = [s for s, got in seen.items() if got["version"] < s - 1]
    assert stale == [2, 3]
    for step in stale:
        got = seen[step]
        samples, mask = got["samples"], got["samples"].completions.mask.bool()
        policy.load_state_dict(versions[step - 1])  # the proximal policy: the weights this step trains from
        proximal = _teacher_forced(policy, samples, opts)
        torch.testing.assert_close(got["old"][mask], proximal[mask], rtol=0, atol=1e-4)
        behaviour = samples.completions.sampling_logps.cpu()
        want = torch.exp(proximal - behaviour).clamp(max=3.0)
        torch.testing.assert_close(got["is_weights"][mask], want[mask], rtol=1e-3, atol=1e-4)
        assert float((got["is_weights"][mask] - 1).abs().max()) > 1e-3  # stale: the weights are not 1
