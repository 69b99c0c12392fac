"""The engine seam (engines.py): which class the launcher's accelerate state picks, DeepSpeed's refusals, and that
neither the loop nor the checkpoint code branches on the engine's name. One process, fake accelerate states, no model."""

import pathlib
from types import SimpleNamespace

import pytest

from vlmrl.engine.distributed import DDPEngine, DeepSpeedEngine, Distributed, DistributedError, FSDP2Engine, SingleProcessEngine

SRC = pathlib.Path(__file__).parent.parent / "src" / "vlmrl"


def fake_accelerator(distributed_type: str, **state) -> SimpleNamespace:
    """What Distributed reads from accelerate's Accelerator: its state (two processes, this one rank 0)."""
    return SimpleNamespace(state=SimpleNamespace(num_processes=2, process_index=0, local_process_index=0, distributed_type=distributed_type, **state))


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for key in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)


def test_engine_is_picked_from_the_accelerate_state(monkeypatch):
    assert type(Distributed(None).engine) is SingleProcessEngine
    ddp = Distributed(fake_accelerator("DistributedType.MULTI_CPU"))
    assert type(ddp.engine) is DDPEngine and (ddp.world_size, ddp.planner_sharding, ddp.sharded) == (2, "ddp", False)
    fsdp = Distributed(fake_accelerator("DistributedType.FSDP", fsdp_plugin=SimpleNamespace(fsdp_version=2)))
    assert type(fsdp.engine) is FSDP2Engine and not fsdp.engine.by_hand and (fsdp.planner_sharding, fsdp.sharded) == ("fsdp", True)
    assert fsdp.describe() == "2 processes (fsdp2), rank 0, local rank 0"
    with pytest.raises(DistributedError, match="fsdp_version: 2"):
        Distributed(fake_accelerator("DistributedType.FSDP", fsdp_plugin=SimpleNamespace(fsdp_version=1)))
    ds = Distributed(fake_accelerator("DistributedType.DEEPSPEED", deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    assert type(ds.engine) is DeepSpeedEngine and (ds.planner_sharding, ds.sharded) == ("zero3", True)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")  # accelerate launch --config_file configs/accelerate/fsdp2.yaml on CPU
    by_hand = Distributed(fake_accelerator("DistributedType.MULTI_CPU"))
    assert type(by_hand.engine) is FSDP2Engine and by_hand.engine.by_hand
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.warns(UserWarning, match="this run uses DDP"):
        assert type(Distributed(fake_accelerator("DistributedType.MULTI_CPU")).engine) is DDPEngine


def test_deepspeed_refuses_what_was_never_run_here(tmp_path):
    from vlmrl.config import load_config
    from vlmrl.checkpoints.state import save, save_final

    ds = Distributed(fake_accelerator("DistributedType.DEEPSPEED", deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    with pytest.raises(DistributedError, match="writing checkpoints and the final model from DeepSpeed states"):
        ds.check_supported(save_steps=10, save_final_model=False)
    ds.check_supported(save_steps=0, save_final_model=False)  # nothing to write: allowed
    # Through the checkpoint code: the refusal is not taken for a storage error (training.on_save_error=continue).
    cfg = load_config(None, ["training.on_save_error=continue"])
    sampler = SimpleNamespace(epoch=0, state_dict=dict)
    with pytest.raises(DistributedError, match="checkpoints of DeepSpeed engines is not supported yet with deepspeed"):
        save(cfg, tmp_path, 1, None, None, None, sampler, {"best_metric": None, "best_step": None}, print, ds)
    with pytest.raises(DistributedError, match="saving the final model of DeepSpeed engines"):
        save_final(None, None, tmp_path / "final", ds, None, cfg)
    assert list(tmp_path.iterdir()) == []


def test_loop_and_checkpoint_code_never_ask_which_engine_runs():
    for name in ("train.py", "run_checkpoint.py", "distributed.py", "collectives.py"):
        text = (SRC / name).read_text()
        assert "engine ==" not in text and "engine !=" not in text and "engine in (" not in text, name
