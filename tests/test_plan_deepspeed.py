"""DeepSpeed ZeRO's buffers as planner terms (deepspeed), by hand, on the hand-made architecture of
tests/test_planner.py (1,000,000 parameters, embedding 100,000, 4 + 2 layers), bfloat16 weights on 4 ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_planner import FP32, SPEC

from vlmrl.plan.deepspeed import (
    ZeroConfig,
    zero3_reduce_scatter_copies,
    zero_checkpoint_pages,
    zero_flat_at_peak,
    zero3_fp32_grad_buffer,
    zero3_gathered_parameters,
    zero3_persistent_parameters,
    zero_config,
    zero_fp32_grad_partition,
    zero_master_copy,
    zero_reduce_buckets,
    zero_step_temporary,
    zero_terms,
)
from vlmrl.plan.spec import COMM_BUCKET_BYTES, PlanError

W = dataclasses.replace(FP32, dtype="bfloat16", world_size=4, sharding="zero2")


def _z(**kw):
    return ZeroConfig(**kw)


def test_unset_keys_take_deepspeeds_defaults():
    z = zero_config({"zero_optimization": {"stage": 2}}, hidden=64)
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.contiguous_gradients, z.overlap) == (500_000_000, 500_000_000, True, False)
    z3 = zero_config({"zero_optimization": {"stage": 3}}, hidden=64)
    assert (z3.prefetch_bucket_size, z3.param_persistence_threshold, z3.max_live_parameters, z3.overlap) == (50_000_000, 100_000, 10**9, True)
    assert zero_config({}, hidden=64).stage == 0


def test_sizes_as_written_and_auto_as_accelerate_fills_it():
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "overlap_comm": True, "offload_optimizer": {"device": "cpu"}}}
    z = zero_config(ds, hidden=64)
    assert (z.reduce_bucket_size, z.overlap, z.offload_optimizer, z.offload_param) == (50_000_000, True, True, False)
    auto = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}
    z3 = zero_config({"zero_optimization": auto}, hidden=64)
    assert (z3.reduce_bucket_size, z3.prefetch_bucket_size, z3.param_persistence_threshold) == (64 * 64, int(0.9 * 64 * 64), 640)


@pytest.mark.parametrize(
    "section, key",
    [
        ({"stage": 4}, "zero_optimization.stage"),
        ({"stage": 2, "reduce_bucket_size": "big"}, "zero_optimization.reduce_bucket_size"),
        ({"stage": 2, "reduce_bucket_size": -1}, "zero_optimization.reduce_bucket_size"),
        ({"stage": 2, "allgather_bucket_size": "auto"}, "zero_optimization.allgather_bucket_size"),
        ({"stage": 3, "stage3_max_live_parameters": True}, "zero_optimization.stage3_max_live_parameters"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_key(section, key):
    with pytest.raises(PlanError, match=key.replace(".", r"\.")):
        zero_config({"zero_optimization": section}, hidden=64)


def test_reduce_buckets():
    assert zero_reduce_buckets(SPEC, W, _z(stage=2)) == 500_000_000 * 2  # one bf16 bucket, allocated whole
    assert zero_reduce_buckets(SPEC, W, _z(stage=2, overlap_comm=True)) == 2 * 500_000_000 * 2  # double-buffered
    assert zero_reduce_buckets(SPEC, W, _z(stage=3)) == 500_000_000 * 2  # stage 3: one, overlap or not
    assert zero_reduce_buckets(SPEC, W, _z(stage=2, contiguous_gradients=False)) == 0
    assert zero_reduce_buckets(SPEC, W, _z(stage=2, contiguous_gradients=False, offload_optimizer=True)) == 500_000_000 * 2
    assert zero_reduce_buckets(SPEC, dataclasses.replace(W, use_lora=True), _z(stage=1, reduce_bucket_size=1000)) == 1000 * 4
    assert zero_reduce_buckets(SPEC, W, _z(stage=0)) == 0


def test_fp32_gradient_partition_at_the_step():
    assert zero_fp32_grad_partition(SPEC, W, _z(stage=2)) == 250_000 * (4 + 2)  # flat bf16 copy + float32
    three = dataclasses.replace(W, world_size=3)
    assert zero_fp32_grad_partition(SPEC, three, _z(stage=1)) == 333_334 * 6  # padded to a multiple of the ranks
    assert zero_fp32_grad_partition(SPEC, W, _z(stage=2, offload_optimizer=True)) == 0  # on the host
    assert zero_fp32_grad_partition(SPEC, W, _z(stage=3, sub_group_size=100_000)) == 100_000 * (2 + 4)  # one sub-group


def test_zero3_fp32_gradient_buffer():
    assert zero3_fp32_grad_buffer(SPEC, W, _z(stage=3)) == 250_000 * 4
    assert zero3_fp32_grad_buffer(SPEC, W, _z(stage=3, sub_group_size=100_000)) == 100_000 * 4  # the largest sub-group
    assert zero3_fp32_grad_buffer(SPEC, W, _z(stage=2)) == 0


def test_zero3_gathered_parameters():
    # a layer's share: (1,000,000 - 100,000) / (4 + 2) = 150,000 elements; the embedding 100,000
    assert zero3_gathered_parameters(SPEC, W, _z(stage=3)) == 1_000_000 * 2  # the default prefetch exceeds the model
    assert zero3_gathered_parameters(SPEC, W, _z(stage=3, prefetch_bucket_size=100_000)) == (150_000 + 100_000) * 2
    assert zero3_gathered_parameters(SPEC, W, _z(stage=3, prefetch_bucket_size=100_000, max_live_parameters=200_000)) == 200_000 * 2
    assert zero3_gathered_parameters(SPEC, W, _z(stage=3, max_live_parameters=1000)) == 150_000 * 2  # the running layer always
    assert zero3_gathered_parameters(SPEC, W, _z(stage=2)) == 0


def test_zero3_persistent_parameters():
    sizes = ((64, 9), (1000, 2), (200_000, 3))  # norms, biases, matrices
    kept = 64 * 9 + 1000 * 2  # at most 100,000 elements each
    assert zero3_persistent_parameters(SPEC, W, _z(stage=3), sizes) == kept * 2 * (1 - 1 / 4)
    assert zero3_persistent_parameters(SPEC, W, _z(stage=3, model_persistence_threshold=1000), sizes) == 64 * 9 * 2 * 0.75
    assert zero3_persistent_parameters(SPEC, W, _z(stage=3, param_persistence_threshold=10), sizes) == 0
    assert zero3_persistent_parameters(SPEC, W, _z(stage=2), sizes) == 0


def test_zero_terms_of_a_deepspeed_config():
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 100_000}}
    t = zero_terms(SPEC, dataclasses.replace(W, sharding="zero3"), ds, ((64, 9),))
    assert t == {
        "zero_reduce_buckets": 64 * 64 * 2,  # auto: hidden^2 elements, one bf16 bucket
        "zero3_reduce_scatter_copies": 64 * 64 * 2,  # the bucket concatenated for its reduce-scatter
        "zero_checkpoint_pages": 0,  # a GPU run
        "zero_master_copy": 0,  # bf16 weights: the optimizer states' float32 master is the only one
        "zero_fp32_grad_partition": 250_000 * (2 + 4),  # the sub-group (the whole partition) flattened + float32
        "zero_allgather_staging": 0,  # ZeRO-1/2 over gloo only
        "zero_step_temporary": 250_000 * 4,  # one sub-group (the whole partition), foreach on a GPU
        "zero3_fp32_grad_buffer": 250_000 * 4,
        "zero3_gathered_parameters": (150_000 + 100_000) * 2,
        "zero3_persistent_parameters": int(64 * 9 * 2 * 0.75),
    }


def test_a_cpu_bucket_holds_only_the_pages_gradients_are_written_to():
    cpu = dataclasses.replace(W, device="cpu")
    assert zero_reduce_buckets(SPEC, cpu, _z(stage=2)) == 1_000_000 * 2  # 5e8 elements allocated, 1e6 gradients written
    assert zero_reduce_buckets(SPEC, cpu, _z(stage=2, reduce_bucket_size=1000)) == 1000 * 2
    assert zero_reduce_buckets(SPEC, cpu, _z(stage=3, reduce_bucket_size=2_000_000)) == 1_000_000 * 2


def test_master_clone_of_float32_trainables():
    fp32 = dataclasses.replace(W, dtype="float32")
    assert zero_master_copy(SPEC, fp32, _z(stage=2)) == 250_000 * 4  # DeepSpeed clones the float32 partition
    assert zero_master_copy(SPEC, fp32, _z(stage=1)) == 250_000 * 4
    assert zero_master_copy(SPEC, W, _z(stage=2)) == 0  # bf16: the optimizer states' master is the copy
    assert zero_master_copy(SPEC, fp32, _z(stage=3)) == 250_000 * 4  # ZeRO-3 too (its in-place branch never matches)
    assert zero_master_copy(SPEC, fp32, _z(stage=2, offload_optimizer=True)) == 0
    lora = dataclasses.replace(W, use_lora=True, lora_r=4, lora_targets=("q_proj",))
    assert zero_master_copy(SPEC, lora, _z(stage=2)) == -(-SPEC.lora_params(4, ("q_proj",)) // 4) * 4  # float32 adapters


def test_optimizer_step_over_one_flat_partition():
    assert zero_fp32_grad_partition(SPEC, dataclasses.replace(W, dtype="float32"), _z(stage=2)) == 250_000 * 4  # no conversion copy
    assert zero_step_temporary(SPEC, W, _z(stage=2)) == 250_000 * 4  # foreach: sqrt(exp_avg_sq)
    assert zero_step_temporary(SPEC, dataclasses.replace(W, device="cpu"), _z(stage=2)) == 0  # vlmrl's fused AdamW on the CPU
    assert zero_step_temporary(SPEC, W, _z(stage=3, sub_group_size=100_000)) == 100_000 * 4
    assert zero_step_temporary(SPEC, W, _z(stage=2, offload_optimizer=True)) == 0
    assert zero_step_temporary(SPEC, W, _z(stage=0)) == 0


def _planned(w, zero=None):
    from vlmrl.plan.planner import plan

    return plan(SPEC, dataclasses.replace(w, zero=zero))


def test_plan_adds_zero2_buffers_to_backward_and_step():
    w = dataclasses.replace(W, grad_accum=1)
    z = _z(stage=2, reduce_bucket_size=10_000_000)
    base, ds = _planned(w), _planned(w, z)
    assert base.terms["comm_buffers"] == COMM_BUCKET_BYTES and ds.terms["comm_buffers"] == 0  # ZeRO's buckets replace it
    assert ds.terms["zero_reduce_buckets"] == 10_000_000 * 2
    # the peak is backward's: the bf16 gradient partition (250,000 x 2) is held from the first backward on, the bucket
    # of 10^7 bf16 elements lives in it, and the generic 25 MiB bucket is gone
    assert ds.phases["update"] - base.phases["update"] == 250_000 * 2 + 10_000_000 * 2 - COMM_BUCKET_BYTES
    assert ds.workload["zero"]["reduce_bucket_size"] == 10_000_000 and "zero" not in base.workload


def test_plan_zero3_gathers_the_configured_window():
    w = dataclasses.replace(W, sharding="zero3", grad_accum=1, generation_gather="layers")
    ds = _planned(w, _z(stage=3, prefetch_bucket_size=100_000, reduce_bucket_size=1000))
    assert ds.terms["gathered_parameters"] == (150_000 + 100_000) * 2
    assert ds.terms["zero_master_copy"] == 0 and ds.terms["zero_fp32_grad_partition"] == 250_000 * (2 + 4)


def test_a_zero_config_must_match_the_sharding():
    with pytest.raises(PlanError, match="asks for ZeRO-3: use sharding zero3"):
        _planned(W, _z(stage=3))


@pytest.mark.integration  # builds a meta-device model (transformers)
def test_parameter_sizes_count_every_parameter_in_order():
    import torch
    from planner_accuracy import tiny_qwen25_config
    from transformers import AutoModelForImageTextToText

    from vlmrl.plan.hf import parameter_sizes, spec_from_hf_config

    cfg = tiny_qwen25_config()
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    sizes = parameter_sizes(model)
    assert sum(n * c for n, c in sizes) == spec_from_hf_config(cfg.to_dict(), "tiny").total_params
    assert sum(c for _, c in sizes) == len(list(model.parameters()))
    assert all(a[0] != b[0] for a, b in zip(sizes, sizes[1:]))  # runs merged


def test_zero3_reduce_scatter_copies_the_bucket():
    z3 = dataclasses.replace(W, sharding="zero3")
    assert zero3_reduce_scatter_copies(SPEC, z3, _z(stage=3)) == 500_000_000 * 2  # torch.cat of the bucket (NCCL in place)
    cpu = dataclasses.replace(z3, device="cpu")
    assert zero3_reduce_scatter_copies(SPEC, cpu, _z(stage=3)) == 2 * 1_000_000 * 2  # + gloo's staging, pages written only
    assert zero3_reduce_scatter_copies(SPEC, cpu, _z(stage=3, reduce_bucket_size=1000)) == 2 * 1000 * 2
    assert zero3_reduce_scatter_copies(SPEC, z3, _z(stage=2)) == 0


def test_checkpoint_pages_stay_mapped_beside_the_flat_copy_when_some_weights_are_frozen():
    cpu = dataclasses.replace(W, device="cpu", freeze_vision=True)
    # trainable: 1,000,000 - 200,000 (tower) + 10,000 (projector) = 810,000 bf16 weights whose file pages stay resident
    assert zero_checkpoint_pages(SPEC, cpu, _z(stage=2)) == 810_000 * 2
    assert zero_checkpoint_pages(SPEC, dataclasses.replace(cpu, freeze_vision=False), _z(stage=2)) == 0  # all trainable: unmapped
    assert zero_checkpoint_pages(SPEC, dataclasses.replace(cpu, use_lora=True), _z(stage=2)) == 0  # the pages are the weights
    assert zero_checkpoint_pages(SPEC, dataclasses.replace(cpu, sharding="zero3"), _z(stage=3)) == 0  # every weight partitioned
    assert zero_checkpoint_pages(SPEC, dataclasses.replace(cpu, device="cuda"), _z(stage=2)) == 0


def test_flat_buffers_at_the_peak_leave_no_heap_slack():
    mib = 2**20
    t = {
        "weights": 64 * mib,
        "master_weights": 0,
        "optimizer_states": 128 * mib,  # two moments of 64 MiB
        "zero_master_copy": 40 * mib,
        "gradients": 10 * mib,  # under glibc's 32 MiB ceiling: heap
        "zero_reduce_buckets": 48 * mib,
        "zero_checkpoint_pages": 5,  # file pages: never heap
        "optimizer_step_temporary": 80 * mib,  # two temporaries of 40 MiB on the CPU
        "zero_fp32_grad_partition": 40 * mib,
    }
    w = dataclasses.replace(W, device="cpu", zero=_z(stage=2))
    backward = {"rollout": 1, "scoring": 1, "update": 1000 * mib}
    assert zero_flat_at_peak(SPEC, w, t, backward, 1000 * mib) == 5 + (64 + 128 + 40 + 48) * mib
    step = {"rollout": 1, "scoring": 1, "update": 1000 * mib}
    assert zero_flat_at_peak(SPEC, w, t, step, 900 * mib) == 5 + (64 + 128 + 40 + 80 + 40) * mib
    rollout = {"rollout": 2000 * mib, "scoring": 1, "update": 1000 * mib}
    assert zero_flat_at_peak(SPEC, w, t, rollout, 1000 * mib) == 5 + (64 + 128 + 40) * mib


def test_plan_cli_reads_the_deepspeed_json(tmp_path, capsys):
    from vlmrl.plan.cli import main

    ds = tmp_path / "zero3.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}')
    args = ["--model", "qwen2.5-vl-3b", "--gpus", "8", "--json"]
    assert main([*args, "--deepspeed-config", str(ds)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["workload"]["sharding"] == "zero3" and got["workload"]["zero"]["reduce_bucket_size"] == 1000
    assert got["terms_gib"]["zero_reduce_buckets"] == round(1000 * 2 / 2**30, 3)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "cannot read it as JSON"),
        ("[1]", "expected a JSON object"),
        ('{"zero_optimization": {"stage": 0}}', "stage is 0"),
        ('{"zero_optimization": {"stage": 2, "reduce_bucket_size": "huge"}}', "zero_optimization.reduce_bucket_size"),
    ],
)
def test_plan_cli_refuses_a_bad_deepspeed_json_in_one_line(tmp_path, capsys, text, message):
    from vlmrl.plan.cli import main

    ds = tmp_path / "ds.json"
    ds.write_text(text)
    assert main(["--model", "qwen2.5-vl-3b", "--gpus", "8", "--deepspeed-config", str(ds)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


# ---------------------------------------------------------------- search and auto_fit under a DeepSpeed config
def test_search_keeps_the_deepspeed_configs_stage_and_buffers():
    from vlmrl.plan.planner import search

    z = zero_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}, hidden=SPEC.hidden)
    base = dataclasses.replace(W, sharding="zero3", zero=z, gpu_memory_bytes=10**12)
    found = search(SPEC, base, top=0)  # other engines would contradict the config (a PlanError per candidate)
    assert found and {(c.workload.sharding, c.workload.offload, c.workload.zero) for c in found} == {("zero3", "none", z)}
    assert all(c.plan.terms["zero_reduce_buckets"] == 1000 * 2 for c in found)


def test_auto_fit_plans_under_the_deepspeed_config_in_use(tmp_path):
    from test_planner import _cfg

    from vlmrl.plan.planner import auto_fit, plan_for_config

    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 3e8}}  # 0.56 GiB of bf16 bucket, and its reduce-scatter copy
    cfg, run = _cfg(tmp_path, "training.auto_fit_gpu_memory_gib=2.5"), {"world_size": 2, "sharding": "zero3"}
    blind, _ = auto_fit(cfg, **run)  # planned without ZeRO's buffers: a choice that does not fit beside them
    assert not plan_for_config(blind, deepspeed=ds, **run).fits
    new, changes = auto_fit(cfg, deepspeed=ds, **run)
    assert changes and plan_for_config(new, deepspeed=ds, **run).fits
    mb = new.training.per_device_train_batch_size
    assert mb < blind.training.per_device_train_batch_size and mb * new.training.gradient_accumulation_steps == 32


def test_a_zero_run_with_auto_fit_hands_its_deepspeed_config_to_the_planner(monkeypatch, tmp_path):
    import vlmrl.train as train_module
    from test_host_alloc import _fake_deepspeed, _Started

    from vlmrl.config import load_config
    from vlmrl.engine import host_alloc
    from vlmrl.engine.distributed import Distributed

    monkeypatch.setattr(host_alloc, "pin_mmap_threshold", lambda: True)  # not done to the pytest process
    monkeypatch.setattr(Distributed, "from_env", classmethod(lambda cls, cpu=False: cls(_fake_deepspeed(3))))
    seen = {}

    def recorded(cfg, log, **kw):
        seen.update(kw)
        raise _Started

    monkeypatch.setattr(train_module, "apply_auto_fit", recorded)
    cfg = load_config(None, [f"training.output_dir={tmp_path}", "training.auto_fit=true", "training.auto_fit_gpu_memory_gib=8"])
    with pytest.raises(_Started):
        train_module.start_run(cfg, lambda *_: None)
    assert seen["sharding"] == "zero3" and seen["deepspeed"] == {"zero_optimization": {"stage": 3}}


# ---------------------------------------------------------------- ZeRO-Offload
def test_the_deepspeed_configs_offload_is_the_planned_offload():
    from vlmrl.plan.deepspeed import zero_offload

    cpu = {"device": "cpu"}
    assert zero_offload(zero_config({"zero_optimization": {"stage": 2}}, 64)) == "none"
    assert zero_offload(zero_config({"zero_optimization": {"stage": 2, "offload_optimizer": cpu}}, 64)) == "optimizer"
    assert zero_offload(zero_config({"zero_optimization": {"stage": 3, "offload_optimizer": cpu, "offload_param": cpu}}, 64)) == "optimizer+params"
    assert zero_offload(zero_config({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}}, 64)) == "none"


def test_offload_host_buffers():
    from vlmrl.plan.deepspeed import zero_offload_host_buffers

    off = dict(offload_optimizer=True)
    # bf16 weights, 4 ranks: 250,000-element partitions; the float32 master is host.py's (16-bit trainables)
    assert zero_offload_host_buffers(SPEC, W, _z(stage=2, **off)) == 250_000 * 2  # the bf16 copy-back buffer
    fp32 = dataclasses.replace(W, dtype="float32")
    assert zero_offload_host_buffers(SPEC, fp32, _z(stage=2, **off)) == 250_000 * 4 + 250_000 * 4  # master clone + copy-back
    assert zero_offload_host_buffers(SPEC, fp32, _z(stage=3, **off)) == 250_000 * 4  # ZeRO-3: the clone only
    assert zero_offload_host_buffers(SPEC, fp32, _z(stage=2)) == 0


def test_plan_of_an_offloading_deepspeed_config_keeps_the_states_on_the_host():
    from vlmrl.plan.planner import plan

    z = zero_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, SPEC.hidden)
    fp32 = dataclasses.replace(W, dtype="float32", zero=z, offload="optimizer")
    p = plan(SPEC, fp32)
    assert p.terms["optimizer_states"] == p.terms["gradients"] == p.terms["zero_master_copy"] == p.terms["zero_fp32_grad_partition"] == 0
    assert p.host["offloaded_optimizer_states"] == 4 * 250_000 * 8  # 4 processes' moments
    assert p.host["engine_host_buffers"] == 4 * 250_000 * 8 and p.host["offloaded_gradients"] == 4 * 250_000 * 4
    with pytest.raises(PlanError, match="offloads optimizer"):
        plan(SPEC, dataclasses.replace(fp32, offload="none"))


def test_plan_cli_takes_the_offload_from_the_deepspeed_json(tmp_path, capsys):
    from vlmrl.plan.cli import main

    ds = tmp_path / "offload.json"
    ds.write_text('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}')
    assert main(["--model", "qwen2.5-vl-3b", "--gpus", "8", "--json", "--deepspeed-config", str(ds)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["workload"]["offload"] == "optimizer" and got["host_gib"]["engine_host_buffers"] > 0


def test_a_runs_offloading_deepspeed_config_plans_the_offload(tmp_path):
    from test_planner import _cfg

    from vlmrl.plan.planner import plan_for_config

    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    p = plan_for_config(_cfg(tmp_path), world_size=2, gpu_memory_bytes=10**12, deepspeed=ds, sharding="zero2")
    assert p.workload["offload"] == "optimizer" and p.terms["optimizer_states"] == 0 and p.host["offloaded_optimizer_states"] > 0


# ---------------------------------------------------------------- ZeRO-3's backward as measured on the CPU
def test_zero3_reduces_once_when_the_bucket_holds_every_gradient():
    from vlmrl.plan.deepspeed import zero3_reduces_once

    z3 = dataclasses.replace(W, sharding="zero3")  # 1,000,000 trainable parameters
    assert zero3_reduces_once(SPEC, z3, _z(stage=3, reduce_bucket_size=1_000_000))
    assert not zero3_reduces_once(SPEC, z3, _z(stage=3, reduce_bucket_size=999_999))
    assert not zero3_reduces_once(SPEC, z3, _z(stage=3, contiguous_gradients=False))
    assert not zero3_reduces_once(SPEC, z3, _z(stage=2))


def test_zero3_prefix_gathered_is_the_decoder():
    from vlmrl.plan.deepspeed import zero3_prefix_gathered

    # 1,000,000 - 200,000 (vision) - 100,000 (embedding) = 700,000 decoder weights, bf16
    assert zero3_prefix_gathered(SPEC, W, _z(stage=3)) == 700_000 * 2
    lora = dataclasses.replace(W, use_lora=True, lora_r=4, lora_targets=("q_proj",))
    assert zero3_prefix_gathered(SPEC, lora, _z(stage=3)) == 700_000 * 2 + SPEC.lora_params(4, ("q_proj",)) * 4
    assert zero3_prefix_gathered(SPEC, W, _z(stage=2)) == 0


def test_zero3_copies_its_single_bucket_at_the_end_of_backward():
    w = dataclasses.replace(W, sharding="zero3", grad_accum=1, generation_gather="layers")
    once, flush = _planned(w, _z(stage=3, reduce_bucket_size=1_000_000)), _planned(w, _z(stage=3, reduce_bucket_size=999_999))
    # flushed during backward, the copies meet the activations; reduced once, they come after them
    assert once.phases["update"] < flush.phases["update"] - flush.terms["zero3_reduce_scatter_copies"] / 2
    bigger = _planned(w, _z(stage=3, reduce_bucket_size=2_000_000))
    # still one reduce at the end: 10^6 more bf16 elements of bucket and of its copy (the GPU holds the bucket whole)
    assert bigger.phases["update"] - once.phases["update"] == 1_000_000 * 2 + 1_000_000 * 2


def test_zero3_shared_prefix_backward_counts_the_gathered_decoder_and_the_copies():
    from vlmrl.plan.deepspeed import zero3_prefix_gathered

    lora = dataclasses.replace(W, sharding="zero3", grad_accum=1, generation_gather="layers", use_lora=True, lora_r=4, lora_targets=("q_proj",))
    z = _z(stage=3, prefetch_bucket_size=1000, max_live_parameters=1000)  # a one-module gather window
    p = _planned(lora, z)
    assert p.terms["prefix_held_gradients"] == SPEC.lora_params(4, ("q_proj",)) * 4  # what other engines hold there
    # ZeRO-3: the whole decoder gathered (700,000 bf16 weights + the adapters) beside the bucket's copies (measured)
    floor = p.terms["weights"] + p.terms["optimizer_states"] + zero3_prefix_gathered(SPEC, lora, z) + p.terms["zero3_reduce_scatter_copies"]
    assert p.phases["update"] >= floor > p.terms["weights"] + p.terms["optimizer_states"] + p.terms["gathered_parameters"] + 700_000 * 2 // 2


def test_zero12_allgather_after_the_step_is_staged_whole_over_gloo():
    from vlmrl.plan.deepspeed import zero_allgather_staging

    cpu = dataclasses.replace(W, device="cpu")  # bf16, 4 ranks: 4 partitions of 250,000
    assert zero_allgather_staging(SPEC, cpu, _z(stage=2)) == 4 * 250_000 * 2
    assert zero_allgather_staging(SPEC, cpu, _z(stage=1)) == 4 * 250_000 * 2
    assert zero_allgather_staging(SPEC, W, _z(stage=2)) == 0  # NCCL gathers in place
    assert zero_allgather_staging(SPEC, cpu, _z(stage=3)) == 0  # ZeRO-3 gathers per module
    small = dataclasses.replace(cpu, sharding="zero2", grad_accum=1, micro_batch=1, num_generations=2, prompts_per_step=1, completion_tokens=8)
    p = _planned(small, _z(stage=2, reduce_bucket_size=1000))
    assert p.terms["zero_allgather_staging"] > p.terms["zero_fp32_grad_partition"]  # 2,000,000 > 250,000 x (2 + 4)
    # a small step peaks after the optimizer step: the persistent bytes (the scoring phase here: nothing is scored)
    # and the staging, the float32 gradient partition being released by then
    assert p.phases["update"] == p.phases["scoring"] + p.terms["zero_allgather_staging"]
