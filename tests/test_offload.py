"""memory.offload_optimizer_during_rollout: optimizer states parked in host memory between updates, training bit-exact."""

import json
from dataclasses import replace

import pytest
import torch

from vlmrl import train as train_module
from vlmrl.checkpoints.files import list_checkpoints
from vlmrl.config import load_config
from vlmrl.engine.offload import OptimizerParking, device_state_bytes, state_tensors
from vlmrl.data.tasks import make_count_task
from vlmrl.train import train

from test_resume import VARIANTS, final_weights, losses, overrides


def stepped_adamw(seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def test_park_frees_every_state_storage_and_restore_gives_the_same_bytes():
    _, opt = stepped_adamw()
    before = [t.clone() for t in state_tensors(opt)]
    assert len(before) == 4 and device_state_bytes(opt) == 4 * 2 * (15 + 7)  # exp_avg and exp_avg_sq: 2 x (15 + 7) fp32
    parking = OptimizerParking(opt, enabled=True)
    assert parking.park() == 4 * 2 * (15 + 7)
    assert device_state_bytes(opt) == 0  # nothing left on the training device
    assert all(t.untyped_storage().nbytes() == 0 for t in state_tensors(opt))
    parking.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, state_tensors(opt)))


def test_parked_steps_equal_unparked_steps():
    params_a, opt_a = stepped_adamw()
    params_b, opt_b = stepped_adamw()
    parking = OptimizerParking(opt_b, enabled=True)
    for step in range(3):
        torch.manual_seed(100 + step)
        grads = [torch.randn_like(p) for p in params_a]
        with parking.parked_states():
            pass  # the rollout would run here
        for params, opt in ((params_a, opt_a), (params_b, opt_b)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(opt_a), state_tensors(opt_b)))


def test_a_rollout_that_raises_does_not_lose_the_states():
    _, opt = stepped_adamw()
    before = [t.clone() for t in state_tensors(opt)]
    parking = OptimizerParking(opt, enabled=True)
    with pytest.raises(RuntimeError, match="rollout failed"):
        with parking.parked_states():
            assert device_state_bytes(opt) == 0
            raise RuntimeError("rollout failed")
    assert all(torch.equal(a, b) for a, b in zip(before, state_tensors(opt)))


def test_disabled_parking_leaves_the_states_alone():
    _, opt = stepped_adamw()
    parking = OptimizerParking(opt, enabled=False)
    with parking.parked_states():
        assert device_state_bytes(opt) == 4 * 2 * (15 + 7)
    assert parking.host == []


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=12, n_test=0, seed=0, image_size=56)


@pytest.mark.parametrize("variant", ["iterations+accumulation+kl", "lora+kl"])
def test_training_with_offload_is_bit_exact_and_parks_during_rollout(variant, tiny_qwen25vl, data, tmp_path, monkeypatch):
    """Four steps with offload (preempted after step 2 and resumed) == four steps without; during every rollout and
    scoring the optimizer holds no state bytes on the training device, during every update it holds all of them."""
    seen = {"rollout": [], "score": [], "update": []}
    for name in seen:
        original = getattr(train_module, name)

        def spy(run, *args, _original=original, _name=name):
            seen[_name].append(device_state_bytes(run.optimizer))
            return _original(run, *args)

        monkeypatch.setattr(train_module, name, spy)

    extra = VARIANTS[variant]
    straight = tmp_path / "straight"
    train(load_config(None, overrides(tiny_qwen25vl, data, straight, *extra)))
    assert all(b > 0 for b in seen["rollout"][1:])  # without offload the states stay (step 1 may precede AdamW's lazy state)
    for name in seen:
        seen[name].clear()

    parked = tmp_path / "parked"
    cfg = load_config(None, overrides(tiny_qwen25vl, data, parked, *extra, "memory.offload_optimizer_during_rollout=true"))
    train(cfg, stop_after=2)
    assert [p.name for p in list_checkpoints(parked)] == ["checkpoint-2"]
    train(cfg)
    assert seen["rollout"] == [0, 0, 0, 0] and seen["score"] == [0, 0, 0, 0]
    assert all(b > 0 for b in seen["update"])

    assert losses(parked) == losses(straight)
    a, b = final_weights(straight), final_weights(parked)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_planner_takes_the_parked_states_off_the_rollout_and_scoring_peaks():
    from vlmrl.plan.planner import Workload, model_spec, plan

    spec = model_spec("qwen2.5-vl-3b")
    base = Workload(num_generations=8, prompts_per_step=4, micro_batch=8, completion_tokens=1024, beta=0.04)
    off, on = plan(spec, base), plan(spec, replace(base, offload_during_rollout=True))
    states = off.terms["optimizer_states"] + off.terms["master_weights"]
    assert states > 10 * 2**30  # bf16 moments of a 3.8B full fine-tune
    assert off.phases["rollout"] - on.phases["rollout"] == states
    assert off.phases["scoring"] - on.phases["scoring"] == states
    assert off.phases["update"] == on.phases["update"]  # the update has them back
    assert on.host["parked_optimizer_states"] == states and off.host["parked_optimizer_states"] == 0


def test_plan_cli_accepts_offload_during_rollout(capsys):
    from vlmrl.cli import main

    args = ["plan", "--model", "qwen2.5-vl-3b", "--num-generations", "8", "--json"]
    assert main(args) in (0, 1)
    before = json.loads(capsys.readouterr().out)
    assert main([*args, "--offload-during-rollout"]) in (0, 1)
    after = json.loads(capsys.readouterr().out)
    assert after["phases_gib"]["rollout"] < before["phases_gib"]["rollout"]


FSDP2_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from vlmrl.engine.offload import OptimizerParking, device_state_bytes, state_tensors
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
runs = []
for park in (False, True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    parking = OptimizerParking(opt, park)
    for step in range(3):
        with parking.parked_states():
            assert (device_state_bytes(opt) == 0) == (park or step == 0)  # no states before the first step
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
    runs.append([t.clone() for t in state_tensors(opt)] + [p.to_local().clone() for p in model.parameters()])
assert all(torch.equal(a, b) for a, b in zip(*runs)), "parked FSDP2 training differs"
print("ok", type(next(iter(opt.state.values()))["exp_avg"]).__name__)
dist.destroy_process_group()
"""


def test_fsdp2_dtensor_states_park_and_train_bit_exact(tmp_path):
    """FSDP2 keeps AdamW's moments as DTensors: parking reaches their local shards and training stays bitwise equal."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", FSDP2_SCRIPT, str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok", "DTensor"]
