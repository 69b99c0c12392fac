"""Several processes on the CPU (gloo): sharding / gather helpers, DDP vs one process, a 2-node launch on loopback.

Sampling: the multi-process runs use rollout.sampling_seed=prompt (the default `auto` picks it for several
processes) and so does the one-process reference, so both sample the same completions: each prompt draws
from its own stream seeded by (seed, step, position in the global batch), whichever process rolls it out.
Tolerances: per-step losses and rewards agree to 1e-6 relative (they came out bit-identical here); final
weights to 5e-5 absolute after 3 AdamW steps at lr 1e-3 (gradients are summed in a different order across
processes, ~1e-7 relative, and Adam's normalisation amplifies that for parameters with tiny gradients).
"""

import json
import os
import shutil
import sys

import pytest
import torch
from multiproc_runs import grpo_args, launch_env, rendezvous_store, run_launcher, step_metrics, tiny_run_setup, torchrun, two_nodes, worker_env
from safetensors.torch import load_file

from vlmrl.engine.distributed import Distributed, DistributedError, merge_rows, prompt_seed, reduce_metric_dicts, rows_of, shard_prompts
from vlmrl.models.rollout import Completions, cat_completions


# ---------------------------------------------------------------- one process: pure helpers
@pytest.mark.parametrize("P,G,R,W", [(4, 2, 4, 2), (8, 4, 16, 2), (12, 2, 12, 3), (16, 2, 8, 4), (6, 4, 8, 1)])
def test_shard_prompts_gives_whole_prompts_and_splits_every_optimizer_step(P, G, R, W):
    shards = [shard_prompts(P, G, R, W, r) for r in range(W)]
    flat = sorted(p for s in shards for p in s)
    assert flat == list(range(P))  # every prompt once, on exactly one process
    per_opt = R // G
    for s in range(P // per_opt):  # each optimizer step's prompts split evenly over processes
        counts = [sum(1 for p in sh if s * per_opt <= p < (s + 1) * per_opt) for sh in shards]
        assert counts == [per_opt // W] * W
    rows = [rows_of(sh, G) for sh in shards]
    assert all(len(r) == P * G // W for r in rows)
    assert all(r[i * G : (i + 1) * G] == list(range(p * G, p * G + G)) for sh, r in zip(shards, rows) for i, p in enumerate(sh))


def test_shard_prompts_refuses_uneven_batches_with_the_fix():
    with pytest.raises(DistributedError, match="multiple of 2"):
        shard_prompts(3, 2, 6, 2, 0)  # 3 prompts over 2 processes
    with pytest.raises(DistributedError, match="gradient_accumulation_steps"):
        shard_prompts(4, 2, 2, 2, 0)  # one prompt per optimizer step cannot be split over 2 processes


def test_merge_rows_is_the_inverse_of_sharding():
    P, G, R, W = 8, 2, 8, 2
    per_rank = [rows_of(shard_prompts(P, G, R, W, r), G) for r in range(W)]
    values = [[f"row{i}" for i in rows] for rows in per_rank]
    assert merge_rows(values, per_rank) == [f"row{i}" for i in range(P * G)]


def test_reduce_metric_dicts():
    a = {"loss": 0.5, "reward": 1.0, "kl": 0.1, "mem/host_peak_rss": 2.0, "time/step": 1.0, "ratio_dev/iter1": 0.1, "tag": "x"}
    b = {"loss": 0.25, "reward": 1.0, "kl": 0.3, "mem/host_peak_rss": 3.0, "time/step": 2.0, "ratio_dev/iter1": 0.4, "tag": "y"}
    out = reduce_metric_dicts([a, b], sum_keys=("loss",), max_keys=("ratio_dev/iter1",))
    assert out["loss"] == 0.75 and out["reward"] == 1.0 and out["kl"] == pytest.approx(0.2)
    assert out["mem/host_peak_rss"] == 3.0 and out["mem/host_peak_rss/rank0"] == 2.0 and out["mem/host_peak_rss/rank1"] == 3.0
    assert out["time/step"] == 2.0 and out["ratio_dev/iter1"] == 0.4 and out["tag"] == "x"
    assert reduce_metric_dicts([a]) == a


def test_single_process_is_a_pass_through():
    from vlmrl.algo.losses import step_normaliser

    d = Distributed(None)
    assert (d.world_size, d.rank, d.is_main, d.engine.name, d.sharded) == (1, 0, True, "single", False)
    shard = d.shard(4, 2, 4)
    assert shard.prompts == [0, 1, 2, 3] and shard.rows_per_opt_step == 4
    total = [1.0, 2.0]
    assert d.gather_rows(shard, total)[0] is total
    comp = Completions(ids=torch.zeros(2, 3, dtype=torch.long), mask=torch.ones(2, 3, dtype=torch.long), truncated=torch.zeros(2, dtype=torch.bool))
    out = d.gather_rollout(shard, total, {"r": total}, comp)
    assert out[0] is total and torch.equal(out[2], comp.lengths)
    t = torch.arange(8.0)
    assert d.local(shard, t) is t
    masks = [torch.ones(2, 3), torch.zeros(1, 3)]
    assert d.step_normaliser(masks, 5) == step_normaliser(masks, 5)
    metrics = {"loss": 1.0}
    assert d.reduce_metrics(metrics) is metrics and d.broadcast("x") == "x" and d.any(True) and not d.any(False)
    assert list(d.gather_rng_states()) == [0]
    opt = object()
    assert d.prepare(torch.nn.Linear(2, 2), opt) is opt and d.engine.runner is None


def test_prompt_seeds_differ_by_step_position_and_seed():
    seeds = {prompt_seed(s, t, p) for s in range(3) for t in range(1, 20) for p in range(64)}
    assert len(seeds) == 3 * 19 * 64


def test_cat_completions_pads_to_the_longest():
    a = Completions(ids=torch.tensor([[5, 6]]), mask=torch.tensor([[1, 1]]), truncated=torch.tensor([True]))
    b = Completions(ids=torch.tensor([[7, 8, 9]]), mask=torch.tensor([[1, 1, 0]]), truncated=torch.tensor([False]))
    c = cat_completions([a, b], pad_id=0)
    assert c.ids.tolist() == [[5, 6, 0], [7, 8, 9]] and c.mask.tolist() == [[1, 1, 0], [1, 1, 0]]
    assert c.truncated.tolist() == [True, False]


# ---------------------------------------------------------------- two processes, no model: the collectives
def _collectives_worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(worker_env(rank, world, port))
    d = Distributed.from_env(cpu=True)
    shard = d.shard(4, 2, 4)  # 2 optimizer steps of 2 prompts: rank 0 gets prompts 0 and 2, rank 1 gets 1 and 3
    total = [float(i) for i in shard.rows]  # each row's value is its global index
    comp = Completions(ids=torch.zeros(4, 2, dtype=torch.long), mask=torch.ones(4, 2, dtype=torch.long), truncated=torch.tensor([rank == 1] * 4))
    all_total, per_reward, lengths, truncated = d.gather_rollout(shard, total, {"acc": [rank] * 4}, comp)
    norm = d.step_normaliser([torch.ones(2, 3) * rank], 7)  # rank 0: 0 tokens, rank 1: 6 tokens
    metrics = d.reduce_metrics({"loss": 0.5 + rank, "mem/host_peak_rss": 1.0 + rank, "same": 3.0}, sum_keys=("loss",))
    rng = d.gather_rng_states()
    queue.put(
        (
            rank,
            shard.prompts,
            all_total,
            per_reward["acc"],
            truncated.tolist(),
            (norm.num_sequences, norm.num_tokens),
            metrics,
            None if rng is None else sorted(rng),
            d.any(rank == 1),
        )
    )
    import torch.distributed as dist

    dist.destroy_process_group()


def test_collectives_on_two_gloo_processes():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = rendezvous_store()
    queue, port = ctx.Queue(), store.port
    procs = [ctx.Process(target=_collectives_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((item[0], item[1:]) for item in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (p0, total0, acc0, trunc0, norm0, m0, rng0, any0), (p1, total1, acc1, trunc1, norm1, m1, rng1, any1) = results[0], results[1]
    assert p0 == [0, 2] and p1 == [1, 3]
    assert total0 == total1 == [float(i) for i in range(8)]  # global order restored on every process
    assert acc0 == acc1 == [0, 0, 1, 1, 0, 0, 1, 1] and trunc0 == trunc1 == [False, False, True, True] * 2
    assert norm0 == norm1 == (4, 6)  # sequences and tokens summed over processes
    assert m0 == m1 and m0["loss"] == 2.0 and m0["mem/host_peak_rss"] == 2.0 and m0["mem/host_peak_rss/rank0"] == 1.0 and m0["same"] == 3.0
    assert rng0 == [0, 1] and rng1 is None and any0 and any1


# ---------------------------------------------------------------- whole runs: torchrun / loopback nodes
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_setup(tmp_path_factory, "dist")


def _args(setup, out, *extra):
    # 4 prompts x G=2 per step; optimizer steps of 4 completions (2 prompts): with 2 processes each holds one prompt
    # of every optimizer step.
    return grpo_args(setup, out, *extra)


def _assert_same_run(out, ref, steps=(1, 2, 3)):
    a, b = step_metrics(out), step_metrics(ref)
    for s in steps:
        assert a[s]["reward"] == b[s]["reward"], s  # the same completions were sampled
        # After the first update the loss carries the weights' rounding (sharded reductions sum in another order)
        # through the old log-probs of a rollout spanning two optimizer steps: 3.1e-5 relative measured (FSDP2, step 2).
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-4, abs=1e-8), s
        assert a[s]["kl"] == pytest.approx(b[s]["kl"], rel=1e-5, abs=1e-9), s


def _assert_same_weights(out, ref, atol=5e-5):
    a, b = load_file(out / "final" / "model.safetensors"), load_file(ref / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < atol, worst


@pytest.fixture(scope="module")
def reference(setup):
    out = setup[0] / "one"
    run_launcher([sys.executable, "-m", "vlmrl", "train", *_args(setup, out)])
    return out


def test_ddp_two_processes_match_one_process(setup, reference):
    out = setup[0] / "ddp"
    log = run_launcher(torchrun("--standalone", "--nproc_per_node", "2") + _args(setup, out))
    assert "2 processes (ddp)" in log
    _assert_same_run(out, reference)
    _assert_same_weights(out, reference)
    row = step_metrics(out)[1]
    assert {"mem/host_peak_rss/rank0", "mem/host_peak_rss/rank1"} <= row.keys()  # per-process peaks; the plain key is the max
    assert row["mem/host_peak_rss"] == max(row["mem/host_peak_rss/rank0"], row["mem/host_peak_rss/rank1"])
    assert not list(out.glob("rank*"))  # only the main process writes


def _two_nodes(setup, out, *extra):
    return two_nodes(_args(setup, out, *extra), launch_env(), timeout=240)


def _resume_on_one_process(setup, out, reference, name):
    """A copy of `out` as it was after step 2 (checkpoint-2 newest) resumed by ONE process (another world size):
    the same run as the uninterrupted 1-process reference."""
    single = setup[0] / name
    shutil.copytree(out, single, ignore=shutil.ignore_patterns("final", "checkpoint-3", "run_complete.json"))
    (single / "metrics.jsonl").write_text("".join(x + "\n" for x in (out / "metrics.jsonl").read_text().splitlines()[:2]))
    assert "saved by 2 process(es)) on 1" in run_launcher([sys.executable, "-m", "vlmrl", "train", *_args(setup, single)])
    _assert_same_run(single, reference)
    _assert_same_weights(single, reference)


@pytest.mark.multiproc
@pytest.mark.slow  # three launches (~40 s quiet, 90 s loaded): make test's budget
def test_ddp_run_at_the_default_sampling_seed_resumes_on_one_process_exactly(setup, reference):
    """rollout.sampling_seed left at auto: the 2-process run draws per-prompt streams, and its checkpoint resumed on
    ONE process keeps them (resolve_sampling_seed) instead of switching to one stream per step: the same run."""
    out = setup[0] / "ddp_default_seed"
    run_launcher(
        torchrun("--standalone", "--nproc_per_node", "2")
        + _args(setup, out, "training.max_steps=2", "training.save_steps=2", "rollout.sampling_seed=auto")
    )
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["per_prompt_seed"] is True
    single = setup[0] / "ddp_default_seed_on_one"
    shutil.copytree(out, single, ignore=shutil.ignore_patterns("final", "run_complete.json"))
    log = run_launcher([sys.executable, "-m", "vlmrl", "train", *_args(setup, single, "rollout.sampling_seed=auto")])
    assert "saved by 2 process(es)) on 1" in log
    _assert_same_run(single, reference)
    _assert_same_weights(single, reference)


def test_resolve_sampling_seed_keeps_the_checkpoints_choice():
    from vlmrl.checkpoints.state import resolve_sampling_seed

    assert resolve_sampling_seed("auto", 1, {}) is False and resolve_sampling_seed("auto", 2, {}) is True
    state = {"step": 2, "per_prompt_seed": True}
    assert resolve_sampling_seed("auto", 1, state) is True and state["per_prompt_seed"] is True  # 2 -> 1: kept
    notes = []
    assert resolve_sampling_seed("auto", 2, {"step": 2, "per_prompt_seed": False}, notes.append) is False
    assert "samples differently" in notes[0]  # 1 -> 2 with per-step streams: said, not hidden
    assert resolve_sampling_seed("prompt", 1, {"step": 2, "per_prompt_seed": False}) is True  # an explicit choice wins


def _assert_exports_as(ckpt, exported, expected_weights):
    """`vlmrl export ckpt exported`: a plain HF folder whose weights equal `expected_weights` bit for bit."""
    run_launcher([sys.executable, "-m", "vlmrl", "export", str(ckpt), str(exported)])
    a, b = load_file(exported / "model.safetensors"), load_file(expected_weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (exported / "config.json").exists() and list(exported.glob("*token*"))


@pytest.mark.slow  # two loopback nodes (~45 s quiet, 156 s loaded): make test's budget
def test_two_nodes_on_loopback_checkpoint_resume_and_export(setup, reference):
    out = setup[0] / "nodes"
    _two_nodes(setup, out, "training.max_steps=2", "training.save_steps=2")
    ckpt = out / "checkpoint-2"
    assert (ckpt / "rng_state_0.pt").exists() and (ckpt / "rng_state_1.pt").exists()
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    logs = _two_nodes(setup, out)  # max_steps 2 -> 3 is a harmless change: resume from checkpoint-2
    assert "resumed from" in logs[0] and "checkpoint-2" in logs[0]
    assert sorted(step_metrics(out)) == [1, 2, 3]
    _assert_same_run(out, reference)
    _assert_same_weights(out, reference)

    _resume_on_one_process(setup, out, reference, "resized")
    _assert_exports_as(ckpt, setup[0] / "exported", ckpt / "model" / "model.safetensors")


# ---------------------------------------------------------------- FSDP2
def _launch_fsdp2(setup, out, env: dict, *extra) -> str:
    """torchrun x2 with the environment `accelerate launch --config_file configs/accelerate/fsdp2.yaml` exports."""
    cmd = torchrun("--standalone", "--nproc_per_node", "2") + _args(setup, out, *extra)
    return run_launcher(cmd, ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", **env)


def test_fsdp2_train_matches_one_process_checkpoints_and_resumes(setup, reference):
    """`vlmrl train` under FSDP2 as `accelerate launch --config_file configs/accelerate/fsdp2.yaml` asks for it (the
    env it exports) on two CPU processes: accelerate sets up plain multi-CPU, vlmrl applies fully_shard itself.
    Same run as one process; the checkpoint (states gathered to rank 0) resumes on 2 processes and on 1; export."""
    out = setup[0] / "fsdp2"
    log = _launch_fsdp2(setup, out, {}, "training.max_steps=2", "training.save_steps=2")
    assert "2 processes (fsdp2)" in log
    held = float(log.split("this process holds ")[1].split("%")[0])
    assert 45 < held < 55, held  # sharded: about half of the parameters on each of 2 processes
    ckpt = out / "checkpoint-2"
    assert json.loads((ckpt / "trainer_state.json").read_text())["engine"] == "fsdp2"
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    n_trainable = len(load_file(ckpt / "model" / "model.safetensors"))
    assert len(saved["state"]) == n_trainable and all(v["exp_avg"].dim() >= 1 for v in saved["state"].values())  # full, not shards
    log = _launch_fsdp2(setup, out, {})  # max_steps 2 -> 3: resume from checkpoint-2, optimizer state restored into the shards
    assert "resumed from" in log and "checkpoint-2" in log
    assert sorted(step_metrics(out)) == [1, 2, 3]
    _assert_same_run(out, reference)
    _assert_same_weights(out, reference)

    _resume_on_one_process(setup, out, reference, "fsdp2_on_one")  # no FSDP there
    _assert_exports_as(ckpt, setup[0] / "fsdp2_exported", ckpt / "model" / "model.safetensors")


@pytest.mark.slow  # ~35 s quiet, 80 s loaded: make test's budget
def test_fsdp2_sharded_checkpoints_resume_on_two_and_one_process_and_export(setup, reference):
    """fsdp_state_dict_type: SHARDED_STATE_DICT (env FSDP_STATE_DICT_TYPE): each process writes its own shards
    (torch.distributed.checkpoint); resume on 2 processes and on 1 (re-sharded on load) continues the same run;
    `vlmrl export` consolidates on one process."""
    out = setup[0] / "fsdp2_sharded"
    sharded = {"FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}
    _launch_fsdp2(setup, out, sharded, "training.max_steps=2", "training.save_steps=2")
    ckpt = out / "checkpoint-2"
    assert json.loads((ckpt / "trainer_state.json").read_text())["state_format"] == "sharded"
    assert len(list((ckpt / "sharded").glob("*.distcp"))) == 2 and not (ckpt / "optimizer.pt").exists()
    assert not list(out.glob(".tmp-*"))
    log = _launch_fsdp2(setup, out, sharded, "training.save_steps=1")  # also writes checkpoint-3 (sharded), exported below
    assert "resumed from" in log and "checkpoint-2" in log
    _assert_same_run(out, reference)
    _assert_same_weights(out, reference)
    _resume_on_one_process(setup, out, reference, "fsdp2_sharded_on_one")  # checkpoint-2, re-sharded for 1 process
    _assert_exports_as(out / "checkpoint-3", setup[0] / "fsdp2_sharded_exported", out / "final" / "model.safetensors")


def test_optimizer_state_layouts_round_trip():
    """Name-keyed (torch.distributed.checkpoint) <-> index-keyed (optimizer.state_dict()) optimizer states."""
    from vlmrl.engine.distributed import DistributedError, optimizer_state_by_index, optimizer_state_by_name

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.AdamW([{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias], "lr": 0.5}])
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    own = opt.state_dict()
    names = [["0.weight", "1.weight"], ["0.bias"]]
    by_name = optimizer_state_by_name(own, names)
    assert set(by_name["state"]) == {"0.weight", "1.weight", "0.bias"}
    assert torch.equal(by_name["state"]["0.bias"]["exp_avg"], own["state"][2]["exp_avg"])
    back = optimizer_state_by_index(by_name)
    assert back["param_groups"] == own["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg_sq"], own["state"][i]["exp_avg_sq"]) for i in own["state"])
    with pytest.raises(DistributedError, match="param groups"):
        optimizer_state_by_name(own, [["0.weight"], ["0.bias"]])


# ---------------------------------------------------------------- FSDP2 (torch fully_shard applied directly; see docs)
def _fsdp2_worker(rank: int, world: int, port: int, model_path: str, data_path: str, queue) -> None:
    """accelerate enables FSDP only on GPUs, so here fully_shard is applied by hand to the same PolicyCall root that
    accelerate would wrap; the loop's calls (rollout with either generation_gather, update forward, clip) run on it."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from vlmrl.config import AlgorithmConfig, load_config
    from vlmrl.data.rows import load_dataset_split
    from vlmrl.engine.distributed import FSDP2Engine, PolicyCall
    from vlmrl.models.logprobs import group_rows
    from vlmrl.algo.losses import aggregate, per_token_loss
    from vlmrl.models.prefix import LogprobOptions, completion_logps_for
    from vlmrl.models.rollout import generate
    from vlmrl.run.datasets import encode_rows
    from vlmrl.models.policy import load_policy

    os.environ.update(worker_env(rank, world, port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.name_or_path={model_path}", "data.min_pixels=3136", "data.max_pixels=3136", "training.device=cpu"])
    d = Distributed.from_env(cpu=True)
    model, processor = load_policy(cfg, torch.device("cpu"))
    rows, _ = load_dataset_split(data_path, limit_images=4, skip_bad_rows=False)
    prompts = encode_rows(processor, rows[2 * rank : 2 * rank + 2], cfg, torch.device("cpu"))
    plain = copy.deepcopy(model)
    torch.manual_seed(0)
    expected = generate(plain, processor.tokenizer, prompts, num_generations=2, max_new_tokens=5)

    root = PolicyCall(model)
    for m in model.modules():
        if type(m).__name__ in model._no_split_modules:
            fully_shard(m)
    fully_shard(root)
    d.engine = FSDP2Engine(d, d.accelerator)  # the engine accelerate sets up on GPUs, around this root
    d.engine.model, d.engine.runner = model, root
    model.eval()
    same = []
    for mode in ("full", "layers"):
        torch.manual_seed(0)
        with d.gathered_for_generation(mode):
            comp = d.call(generate, processor.tokenizer, prompts, num_generations=2, max_new_tokens=5, decode_agreement=d.decode_agreement(mode))
        same.append(torch.equal(comp.ids, expected.ids))
    same.append([d.decode_agreement(mode) is not None for mode in ("full", "layers")])  # layers: the processes agree

    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    _, row_prompt = group_rows(torch.arange(2).repeat_interleave(2))

    def loss_of(fn_model_call, norm):
        logps = fn_model_call(completion_logps_for, prompts, row_prompt, comp.ids, comp.mask, LogprobOptions(chunk_tokens=1024))
        return aggregate(per_token_loss(logps, logps.detach(), advantages, AlgorithmConfig())[0], comp.mask, "grpo", norm)

    norm = d.step_normaliser([comp.mask], 5)
    # Reference: the unsharded model's gradient of the same global loss (sum of the processes' parts).
    plain.train()
    loss_of(lambda fn, *a: fn(plain, *a), norm).backward()
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in plain.parameters()])
    dist.all_reduce(flat)
    model.train()
    d.backward(loss_of(lambda fn, *a: d.call(fn, *a, grad=True), norm))
    opt = torch.optim.AdamW(root.parameters(), lr=1e-3)

    class _Sched:
        def step(self):
            pass

    sharded = torch.cat([p.grad.full_tensor().reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in root.parameters()])
    grad_error = ((sharded - flat).abs().max() / flat.abs().max()).item()
    norm_fsdp = d.optimizer_step(opt, _Sched(), 1e9).grad_norm
    queue.put((rank, same, flat.double().norm().item(), norm_fsdp, grad_error))
    dist.destroy_process_group()


def test_fsdp2_fully_shard_rollout_and_gradients_on_two_gloo_processes(setup):
    import torch.multiprocessing as mp

    _, model, data = setup
    ctx = mp.get_context("spawn")
    store = rendezvous_store()
    queue, port = ctx.Queue(), store.port
    procs = [ctx.Process(target=_fsdp2_worker, args=(r, 2, port, str(model), str(data["train"]), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((item[0], item[1:]) for item in (queue.get(timeout=180) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in range(2):
        same, expected_norm, fsdp_norm, grad_error = results[rank]
        # generation_gather full and layers sample what the unsharded model samples; only layers decodes in step
        assert same == [True, True, [False, True]]
        assert grad_error < 1e-5  # every gradient = the unsharded gradient of the global loss (sum of the processes' parts)
        # The clip's global norm over the DTensor shards, against a float64 norm of the reference gradients (a float32
        # norm of the concatenated vector is itself 3.7e-5 off here).
        assert fsdp_norm == pytest.approx(expected_norm, rel=1e-5), (fsdp_norm, expected_norm)
