"""The memory paths train to the same bits as the plain ones: the fused LM-head log-probs (`_FusedHeadLogps`) against
the checkpointed chunks and `InPlaceAdamW` against torch's default AdamW, through a short SFT and a short GRPO run of
the demo's tiny Qwen2.5-VL with the demo's settings scaled down (SFT's two stages, GRPO with two micro-batches per
optimizer step, sampling at temperature 1). A path that rounds differently (torch's fused AdamW, the first fused head)
changes the last bits here and the demo's 200-step trajectory with them (benchmarks/results/
demo_trajectory_attribution_2026-11-27.md)."""

import json
import math
import pathlib

import pytest
import torch
from safetensors.torch import load_file

import vlmrl.models.logprobs as logprobs
import vlmrl.sft as sft_module
import vlmrl.train as train_module
from vlmrl.config import load_config
from vlmrl.demo import COMMON
from vlmrl.sft import sft
from vlmrl.train import train

pytestmark = pytest.mark.integration

SCALED = [
    "data.task_train_size=16",
    "data.task_test_size=4",
    "training.eval_batch_size=4",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.report=false",
    "training.overwrite_output_dir=true",
]
SFT = [
    "sft.projector_steps=2",
    "sft.projector_learning_rate=3e-3",
    "sft.steps=2",
    "sft.learning_rate=1e-3",
    "sft.train_vision_tower=true",
    "sft.batch_size=8",
]
GRPO = [
    "rollout.num_generations=4",
    "training.per_device_train_batch_size=4",
    "rollout.generation_batch_size=8",
    "training.gradient_accumulation_steps=2",
    "training.max_steps=2",
    "optim.learning_rate=3e-4",
    "algorithm.loss_type=grpo",
    "algorithm.beta=0.0",
    "rollout.temperature=1.0",
    # The demo's rewards are 0 for a model this briefly fine-tuned: completion length gives the advantages a spread.
    f"algorithm.reward_funcs=[accuracy, answer_format, '{pathlib.Path(__file__).parent / 'rewards_for_tests.py'}:text_length']",
]


def torch_adamw(model, o, num_steps, learning_rate=None):
    """make_optimizer with torch's AdamW as it comes (on the CPU the per-parameter loop) and the same schedule."""
    from vlmrl.engine.optim import WarmupSchedule

    params = [p for p in model.parameters() if p.requires_grad]
    lr = o.learning_rate if learning_rate is None else learning_rate
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon, weight_decay=o.weight_decay)
    schedule = WarmupSchedule(o.lr_scheduler_type, math.ceil(o.warmup_ratio * num_steps), num_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def sft_then_grpo(model, out) -> dict:
    """demo.run_demo's two runs at the scale above: SFT writes the count task, GRPO starts from SFT's final/."""
    common = [c for c in COMMON if not c.startswith(("data.task_train_size", "data.task_test_size", "training.eval_batch_size", "logging."))]
    sft(load_config(None, common + SCALED + SFT + [f"model.name_or_path={model}", f"training.output_dir={out / 'sft'}"]), log=lambda *_: None)
    task = out / "sft" / "data" / "count"
    grpo = common + SCALED + GRPO
    grpo += [f"model.name_or_path={out / 'sft' / 'final'}", f"data.train_path={task / 'train.jsonl'}", f"data.eval_path={task / 'test.jsonl'}"]
    train(load_config(None, grpo + [f"training.output_dir={out / 'grpo'}"]), log=lambda *_: None)
    return {
        "sft": load_file(out / "sft" / "final" / "model.safetensors"),
        "grpo": load_file(out / "grpo" / "final" / "model.safetensors"),
        "metrics": [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()],
    }


def test_fused_head_and_in_place_adamw_train_the_same_bits_as_the_plain_paths(tiny_qwen25vl, tmp_path, monkeypatch):
    used = {"fused": 0}
    applies = logprobs.fused_head_applies

    def counted(*args):
        used["fused"] += bool(applies(*args))
        return applies(*args)

    with monkeypatch.context() as m:
        m.setattr(logprobs, "fused_head_applies", counted)
        memory_paths = sft_then_grpo(tiny_qwen25vl, tmp_path / "memory")
    assert used["fused"] > 0  # the fused head ran
    with monkeypatch.context() as m:
        m.setattr(logprobs, "fused_head_applies", lambda *a: False)  # the checkpointed chunks
        for loop in (sft_module, train_module):
            m.setattr(loop, "make_optimizer", torch_adamw)
        plain = sft_then_grpo(tiny_qwen25vl, tmp_path / "plain")
    for stage in ("sft", "grpo"):
        assert memory_paths[stage].keys() == plain[stage].keys()
        differ = [k for k in plain[stage] if not torch.equal(memory_paths[stage][k], plain[stage][k])]
        assert not differ, (stage, differ[:5])
    keys = ("loss", "grad_norm", "reward")
    assert [{k: r[k] for k in keys} for r in memory_paths["metrics"]] == [{k: r[k] for k in keys} for r in plain["metrics"]]
    assert all(r["grad_norm"] > 0 for r in plain["metrics"])  # GRPO trained: the update path was compared too
    assert any(not torch.equal(plain["sft"][k], plain["grpo"][k]) for k in plain["sft"])
