"""algorithm.turn_advantage=per_turn in `vlmrl train`'s own loop (issue 39 part 5), from outside: a ToolEnvironment
subclass in a file (tools.environment) rewards each turn that calls a tool, one row's environment returns text as its
reward; each row's first turn is scripted (the engine's `force` hook, as in test_tool_runs.py), the rest sampled by the
tiny Qwen2.5-VL. samples.jsonl's per-token advantages are checked against the formula computed here by hand from the
logged rewards, and a stopped and resumed run against a straight one."""

import json

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.algo.advantages import ADV_EPS

pytestmark = pytest.mark.integration

ENVIRONMENT = '''
from vlmrl.tools.environment import ToolEnvironment


class Rewarding(ToolEnvironment):
    """A turn that calls a tool earns len(its text) / 100; a zoom on the [0, 0, 14, 14] box answers with text."""

    def step(self, action_text):
        observation, reward, done = super().step(action_text)
        if done:
            return observation, reward, done
        if "14, 14]" in action_text:
            return observation, "not a number", done
        return observation, len(action_text) / 100, done
'''

FINAL = '''
def last_turn(completions, trajectory, **kwargs):
    """The rollout's reward: the length of its last turn (differs between rows)."""
    return [len(t.turn_texts[-1]) / 100 for t in trajectory]
'''

BOXES = [[0, 0, 28, 28], [0, 0, 7, 7], [0, 0, 14, 14], [0, 0, 28, 9]]
GAMMA = 0.5


def call(box) -> str:
    return "<tool_call>" + json.dumps({"name": "zoom", "arguments": {"bbox_2d": box}}) + "</tool_call>"


def per_turn_run(tmp_path, monkeypatch, tiny, out, steps: int, extra=(), stop_after=None, said=None):
    """GRPO over 2 prompts x G=2 with tools.environment=env.py:Rewarding and per-turn advantages; row i's first turn is
    a zoom on BOXES[i]. Returns the engine's rollouts of this call."""
    import vlmrl.run.tool_rollout as tool_rollout
    from vlmrl.config import load_config
    from vlmrl.data.tasks import make_count_task
    from vlmrl.engine import host_alloc
    from vlmrl.models import multiturn
    from vlmrl.models.multiturn import turn_end
    from vlmrl.models.processing import tokenizer_of, load_processor
    from vlmrl.train import train

    processor = load_processor(tiny)
    end_id, _ = turn_end(processor, [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")])
    scripts = [tokenizer_of(processor)(call(b), add_special_tokens=False).input_ids + [end_id] for b in BOXES]
    real, seen = multiturn.sample_multiturn, []  # the engine's own (tool_rollout's may be an earlier call's wrapper)

    def scripted(*args, **kwargs):
        got = real(*args, **kwargs, force=lambda row, turn, j: scripts[row][j] if turn == 0 and j < len(scripts[row]) else None)
        seen.append(got)
        return got

    monkeypatch.setattr(tool_rollout, "sample_multiturn", scripted)
    monkeypatch.setattr(host_alloc, "pin_mmap_threshold", lambda: True)  # not done to the shared pytest process
    for k in [*host_alloc._USER_SETTINGS, "GLIBC_TUNABLES"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    (tmp_path / "final.py").write_text(FINAL)
    data = make_count_task(tmp_path / "count", n_train=4, n_test=0, seed=0, image_size=56)
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny}",
            f"data.train_path={data['train']}",
            "data.eval_path=",
            f"training.output_dir={out}",
            f"training.max_steps={steps}",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=4",
            "rollout.max_completion_length=8",
            "rollout.engine=continuous",
            "tools.tools=[zoom]",
            "tools.environment=env.py:Rewarding",
            f"tools.max_turn_tokens={max(len(s) for s in scripts) + 4}",
            f"tools.max_total_tokens={max(len(s) for s in scripts) + 100}",
            "algorithm.turn_advantage=per_turn",
            f"algorithm.turn_discount={GAMMA}",
            "algorithm.reward_funcs=[final.py:last_turn]",
            "algorithm.mask_truncated_completions=false",
            "optim.learning_rate=1e-3",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "logging.log_completions=4",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            *extra,
        ],
    )
    train(cfg, stop_after=stop_after, log=(said.append if said is not None else lambda *a: None))
    return seen


def expected_token_advantages(samples: list[dict], G: int) -> list[list[float]]:
    """The estimator by hand: per row, r_t = the environment's turn reward, the rollout's reward added on the last turn;
    G_t = r_t + gamma G_{t+1}; (G_t - mean) / (std + eps) over all turns of the group; each masked token its turn's."""
    returns = []
    for s in samples:
        r = list(s["turn_rewards"])
        r[-1] += s["reward"]
        g, acc = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            acc = r[t] + GAMMA * acc
            g[t] = acc
        returns.append(g)
    out = []
    for start in range(0, len(samples), G):
        pooled = torch.tensor([x for g in returns[start : start + G] for x in g], dtype=torch.float64)
        mean, std = pooled.mean().item(), pooled.std().item()
        for s, g in zip(samples[start : start + G], returns[start : start + G]):
            turn, prev, tokens = -1, 0, []
            for m in s["loss_mask"]:
                turn += 1 if m and not prev else 0
                tokens.append((g[turn] - mean) / (std + ADV_EPS) if m else 0.0)
                prev = m
            out.append(tokens)
    return out


@pytest.mark.slow  # two GRPO steps of multi-turn rollouts: 25-40 s here
def test_each_turn_gets_its_discounted_group_normalised_advantage(tiny_qwen25vl, tmp_path, monkeypatch, capsys):
    import vlmrl.train as train_module

    real_loss, used = train_module.per_token_loss, []

    def recording_loss(logps, old, adv, *args, mask, **kwargs):
        used.extend(tuple(round(float(a), 5) for a, m in zip(row, mrow) if m) for row, mrow in zip(adv, mask))
        return real_loss(logps, old, adv, *args, mask=mask, **kwargs)

    monkeypatch.setattr(train_module, "per_token_loss", recording_loss)
    out = tmp_path / "run"
    seen = per_turn_run(tmp_path, monkeypatch, tiny_qwen25vl, out, steps=2)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and len(samples) == 8 and len(seen) == 2
    for step, rollout in enumerate(seen):
        rows = samples[4 * step : 4 * step + 4]
        for i, (s, t) in enumerate(zip(rows, rollout.trajectories)):
            assert t.num_turns == 2 and len(s["turn_rewards"]) == 2, (t.turn_texts, s["turn_rewards"])
            # the environment's reward of the first turn (the hostile one's text counted as 0), 0.0 on the last
            assert s["turn_rewards"] == [0.0 if i == 2 else len(t.turn_texts[0]) / 100, 0.0]
            assert s["reward"] == pytest.approx(len(t.turn_texts[-1]) / 100)
        want = expected_token_advantages(rows, 2)
        for s, w in zip(rows, want):
            assert s["token_advantages"] == pytest.approx(w, abs=1e-5)
            turns = _per_turn_values(s)
            assert len(turns) == 2 and turns[0] != turns[1], "the two turns of a rollout get different advantages"
        assert metrics[step]["tools/bad_turn_rewards"] == 1.0 and metrics[step]["loss"] != 0 and metrics[step]["grad_norm"] > 0
    # the update trained on exactly these advantages (one forward per row; micro-batches may order rows differently)
    logged = sorted(tuple(round(a, 5) for a, m in zip(s["token_advantages"], s["loss_mask"]) if m) for s in samples)
    assert sorted(used) == logged
    # one line per step names the bad reward (the run's logger prints it)
    bad = [line for line in capsys.readouterr().out.splitlines() if "were not finite numbers" in line]
    assert len(bad) == 2 and "1 turn reward(s)" in bad[0] and "'not a number'" in bad[0] and "counted as 0.0" in bad[0], bad


def _per_turn_values(sample: dict) -> list[float]:
    """The advantage of each turn of a logged row (all tokens of one turn share it)."""
    values, prev = [], 0
    for a, m in zip(sample["token_advantages"], sample["loss_mask"]):
        if m and not prev:
            values.append(a)
        elif m:
            assert a == values[-1], "one advantage per turn"
        prev = m
    return values


@pytest.mark.slow  # three runs
def test_resume_is_bit_exact_with_per_turn_advantages(tiny_qwen25vl, tmp_path, monkeypatch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    per_turn_run(tmp_path, monkeypatch, tiny_qwen25vl, straight, steps=2)
    per_turn_run(tmp_path, monkeypatch, tiny_qwen25vl, resumed, steps=2, stop_after=1)
    assert not (resumed / "final").exists()
    said = []
    per_turn_run(tmp_path, monkeypatch, tiny_qwen25vl, resumed, steps=2, said=said)
    assert any("resumed from" in str(line) and "checkpoint-1" in str(line) for line in said), said

    def losses(out):
        return {r["step"]: (r["loss"], r["reward"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    assert losses(resumed) == losses(straight) and len(losses(straight)) == 2
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
