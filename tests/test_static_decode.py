"""The continuous decoder's static decode step (rollout.decode_step=static): fixed batch buckets over every cache
column give the dynamic step's tokens; graph capture (cuda_graph) is CUDA-only and measured by benchmarks/gpu_suite.py."""

import pytest
import torch
from test_continuous import FAMILIES, _engine, biased  # noqa: F401 (biased: the module fixture)

from vlmrl.config import ConfigError, load_config
from vlmrl.models.static_decode import bucket_for, buckets

pytestmark = pytest.mark.integration


@pytest.mark.unit
def test_buckets_are_powers_of_two_then_the_slot_count():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert [bucket_for(n, 12) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]


def _spy_shapes(monkeypatch):
    """Record (rows of the forward, active rows, key columns, cache columns, padding rows see one column and every
    row's logits are finite) of every decode step."""
    import vlmrl.models.continuous as cont

    seen = []
    forward = cont.ContinuousDecoder.forward

    def spy(self, tokens, mask, positions):
        full = mask["full_attention"] if isinstance(mask, dict) else mask
        visible = full if full.dtype == torch.bool else full == 0
        logits = forward(self, tokens, mask, positions)
        pad_ok = bool((visible[self.cache.n :].sum(-1) == 1).all()) and bool(torch.isfinite(logits).all())
        seen.append((tokens.shape[0], self.cache.n, full.shape[-1], self.cache.columns, pad_ok))
        return logits

    monkeypatch.setattr(cont.ContinuousDecoder, "forward", spy)
    return seen


@pytest.mark.parametrize("name", list(FAMILIES))
def test_static_step_gives_the_dynamic_steps_tokens(biased, name, monkeypatch):  # noqa: F811
    """Sampled rows ending at different steps, 5 rows in flight (9 too for Qwen2.5-VL): the bucketed, full-width step
    (padding rows in free slots) samples the same tokens row for row as today's step, and really runs at the bucket sizes."""
    model, processor, prompts = biased[name]
    seeds = [101, 202, 303]
    padded = []
    for batch in (5, 9) if name == "tiny_qwen25vl" else (5,):
        dynamic = _engine(model, processor, prompts, decode_batch_size=batch, prompt_seeds=seeds)
        seen = _spy_shapes(monkeypatch)
        static = _engine(model, processor, prompts, decode_batch_size=batch, prompt_seeds=seeds, decode_step="static")
        monkeypatch.undo()
        assert torch.equal(static, dynamic), (name, batch)
        assert all(rows == bucket_for(n, min(batch, 9)) and width == columns and pad_ok for rows, n, width, columns, pad_ok in seen)
        padded += [rows > n for rows, n, *_ in seen]
    assert any(padded)  # padding rows were really there


def test_static_step_greedy_equals_dynamic_on_one_slot_and_under_bf16(biased):  # noqa: F811
    model, processor, prompts = biased["tiny_qwen25vl"]
    for kw in (dict(do_sample=False, decode_batch_size=1), dict(do_sample=False, decode_batch_size=4)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dynamic = _engine(model, processor, prompts, **kw)
            static = _engine(model, processor, prompts, decode_step="static", **kw)
        assert torch.equal(static, dynamic), kw


def test_cuda_graph_step_is_refused_off_cuda(biased):  # noqa: F811
    model, processor, prompts = biased["tiny_qwen25vl"]
    with pytest.raises(ValueError, match="decode_step=cuda_graph needs the model on a CUDA device"):
        _engine(model, processor, prompts, decode_batch_size=3, prompt_seeds=[1, 2, 3], decode_step="cuda_graph")


@pytest.mark.unit
def test_decode_step_config_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match="rollout.decode_step=static is a step of the continuous decoder: set rollout.engine=continuous"):
        load_config(None, ["rollout.decode_step=static"])
    with pytest.raises(ConfigError, match="rollout.decode_step=cuda_graph needs a CUDA device"):
        load_config(None, ["rollout.engine=continuous", "rollout.decode_step=cuda_graph", "training.device=cpu"])
    cfg = load_config(None, ["rollout.engine=continuous", "rollout.decode_step=static"])
    assert cfg.rollout.decode_step == "static" and load_config(None, []).rollout.decode_step == "dynamic"


def test_train_step_runs_the_static_step_with_the_same_completions(tiny_qwen25vl, tmp_path, monkeypatch):
    """rollout.decode_step=static reaches the engine through `vlmrl train` (every decode forward runs over every
    cache column) and gives the same step as the dynamic one."""
    from test_integration import grpo_cfg, read_metrics

    from vlmrl.data.tasks import make_count_task
    from vlmrl.train import train

    data = make_count_task(tmp_path / "count", n_train=16, n_test=4, seed=0, image_size=56)
    rows, widths = [], []
    for step in ("dynamic", "static"):
        seen = _spy_shapes(monkeypatch)
        out = tmp_path / step
        train(grpo_cfg(tiny_qwen25vl, data, out, "training.max_steps=1", "rollout.engine=continuous", f"rollout.decode_step={step}"))
        monkeypatch.undo()
        rows.append(read_metrics(out)[0])
        widths.append({width == columns for _, _, width, columns, _ in seen})
    keys = ("loss", "reward", "completions/mean_length")
    assert [rows[0][k] for k in keys] == [rows[1][k] for k in keys]
    assert False in widths[0] and widths[1] == {True}  # dynamic: growing widths; static: always every column
