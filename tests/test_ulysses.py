"""Ulysses sequence parallelism (engine/ulysses.py): the reshuffle simulated in one process, the all-to-all over gloo,
and per-token log-probs / gradients of the tiny Qwen2.5-VL with SP 2 on 2 processes equal to one process."""

import os

import pytest
import torch
from multiproc_runs import rendezvous_store, worker_env

from vlmrl.engine.ulysses import (
    SequenceParallelError,
    check_sp_size,
    heads_send_buffer,
    local_share,
    merge_heads,
    merge_sequence,
    pad_to_multiple,
    sequence_send_buffer,
    simulated_all_to_all,
    ulysses_mask,
)


# ---------------------------------------------------------------- pure pieces, ranks simulated in one process
@pytest.mark.parametrize("sp,T,H", [(2, 6, 4), (3, 9, 6), (4, 8, 4), (1, 5, 2)])
def test_seq_to_heads_and_back_matches_the_whole_tensor(sp, T, H):
    x = torch.randn(2, T, H, 3)  # [B, T, H, D], the whole tensor one process would hold
    shares = [local_share(x, r, sp, 1) for r in range(sp)]  # rank r: [B, T/sp, H, D]
    heads = [merge_sequence(b) for b in simulated_all_to_all([heads_send_buffer(s, sp) for s in shares])]
    for r in range(sp):  # rank r: the whole sequence, heads r*H/sp .. (r+1)*H/sp
        assert torch.equal(heads[r], x[:, :, r * H // sp : (r + 1) * H // sp])
    back = [merge_heads(b) for b in simulated_all_to_all([sequence_send_buffer(h, sp) for h in heads])]
    for r in range(sp):
        assert torch.equal(back[r], shares[r])


def test_hand_computed_two_rank_reshuffle():
    # B=1, T=2, H=2, D=1; value = 10 * position + head.
    x = torch.tensor([[[[0.0], [1.0]], [[10.0], [11.0]]]])
    shares = [local_share(x, r, 2, 1) for r in range(2)]
    heads = [merge_sequence(b) for b in simulated_all_to_all([heads_send_buffer(s, 2) for s in shares])]
    assert heads[0].flatten().tolist() == [0.0, 10.0] and heads[1].flatten().tolist() == [1.0, 11.0]


def test_padding_to_a_multiple_and_the_mask():
    ids = torch.tensor([[1, 2, 3]])
    assert pad_to_multiple(ids, 2, 1, value=7).tolist() == [[1, 2, 3, 7]]
    assert pad_to_multiple(ids, 3, 1) is ids
    pos = torch.arange(3).view(1, 1, 3).expand(3, 1, 3)  # M-RoPE [3, B, T]
    assert pad_to_multiple(pos, 2, -1).shape == (3, 1, 4)
    mask = ulysses_mask(torch.tensor([[0, 1, 1, 0]]))[0, 0]
    assert mask.tolist() == [
        [True, False, False, False],  # left padding: only itself (no fully masked row)
        [False, True, False, False],  # real tokens never read padding keys
        [False, True, True, False],
        [False, True, True, True],  # sp padding at the end: itself and earlier real keys, read by no real token
    ]


def test_deepstack_share_hand_computed():
    """Qwen3-VL's DeepStack rows follow the image tokens in row-major order: (0,1) (0,2) (1,0) (1,3) -> rows 0..3; with
    sp 2 over T 4, rank 0 holds columns 0-1 (rows 0 and 2), rank 1 columns 2-3 (rows 1 and 3). T 3 is padded to 4
    (the padding column is not an image token)."""
    from vlmrl.engine.ulysses import deepstack_share

    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    embeds = [torch.arange(4.0).view(4, 1), 10 + torch.arange(4.0).view(4, 1)]  # two DeepStack layers
    m0, e0 = deepstack_share(mask, embeds, 0, 2)
    m1, e1 = deepstack_share(mask, embeds, 1, 2)
    assert m0.tolist() == [[False, True], [True, False]] and m1.tolist() == [[True, False], [False, True]]
    assert [e.flatten().tolist() for e in e0] == [[0.0, 2.0], [10.0, 12.0]]
    assert [e.flatten().tolist() for e in e1] == [[1.0, 3.0], [11.0, 13.0]]
    m, e = deepstack_share(mask[:, :3], [embeds[0][:3]], 1, 2)  # T 3: rank 1 holds column 2 and the padding
    assert m.tolist() == [[True, False], [False, False]] and e[0].flatten().tolist() == [1.0]


def test_check_sp_size_names_the_field():
    check_sp_size(2, 4, 4, 2)
    with pytest.raises(SequenceParallelError, match=r"training.sequence_parallel_size=2 must divide the key/value heads \(1\)"):
        check_sp_size(2, 2, 4, 1)
    with pytest.raises(SequenceParallelError, match="number of processes"):
        check_sp_size(2, 3, 4, 2)


# ---------------------------------------------------------------- two gloo processes
def _all_to_all_worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    from vlmrl.engine.ulysses import GatherSequence, HeadsToSeq, SeqToHeads

    os.environ.update(worker_env(rank, world, port))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, 3)  # same on both ranks: the whole tensor
    w = torch.randn(2, 6, 2, 3)  # weights of a head-sharded loss, whole
    share = local_share(x, rank, 2, 1).clone().requires_grad_(True)
    heads = SeqToHeads.apply(share, None)
    loss = (heads * w).sum()  # rank r's heads weighted by w
    loss.backward()
    back = HeadsToSeq.apply(heads.detach(), None)
    g = share.detach().clone().requires_grad_(True)
    full = GatherSequence.apply(g, None)
    (full * torch.arange(full.numel()).view_as(full)).sum().backward()
    # numpy, not tensors: a tensor put on a torch queue lives in this process's shared memory, gone once it exits
    heads_ok, back_ok, full_ok = (
        torch.equal(heads.detach(), x[:, :, 2 * rank : 2 * rank + 2]),
        torch.equal(back, share.detach()),
        torch.equal(full, x),
    )
    queue.put((rank, heads_ok, share.grad.numpy(), back_ok, full_ok, g.grad.numpy()))
    dist.destroy_process_group()


def _spawn(target, *args, timeout=180):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = rendezvous_store()
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, 2, store.port, *args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((item[0], item[1:]) for item in (queue.get(timeout=timeout) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_all_to_all_and_gather_on_two_gloo_processes():
    results = _spawn(_all_to_all_worker)
    torch.manual_seed(0)
    x, w = torch.randn(2, 6, 4, 3), torch.randn(2, 6, 2, 3)
    full_weights = torch.cat([w, w], dim=2)  # rank r's heads 2r, 2r+1 are weighted by w
    index = torch.arange(x.numel()).view_as(x).float()
    for rank in range(2):
        heads_ok, grad, back_ok, gathered_ok, gather_grad = results[rank]
        assert heads_ok and back_ok and gathered_ok
        # d loss / d share: the inverse all-to-all brings each head's gradient back to the rank holding its tokens
        assert torch.equal(torch.from_numpy(grad), local_share(full_weights, rank, 2, 1))
        assert torch.equal(torch.from_numpy(gather_grad), 2 * local_share(index, rank, 2, 1))  # sp x the own share (reduce-scatter of equal grads)


def _exactness_worker(rank: int, world: int, port: int, model_path: str, data_path: str, pixels: int, queue) -> None:
    try:
        _exactness_run(rank, world, port, model_path, data_path, pixels, queue)
    except BaseException as e:  # the test fails at once with the reason instead of waiting on the queue
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise


def _exactness_run(rank: int, world: int, port: int, model_path: str, data_path: str, pixels: int, queue) -> None:
    import copy

    import torch.distributed as dist

    from vlmrl.algo.losses import aggregate, per_token_loss, step_normaliser
    from vlmrl.config import AlgorithmConfig, load_config
    from vlmrl.data.rows import load_dataset_split
    from vlmrl.engine import ulysses
    from vlmrl.models.logprobs import group_rows
    from vlmrl.models.policy import load_policy
    from vlmrl.models.prefix import LogprobOptions, completion_logps_for
    from vlmrl.run.datasets import encode_rows

    os.environ.update(worker_env(rank, world, port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = load_config(None, [f"model.name_or_path={model_path}", f"data.min_pixels={pixels}", f"data.max_pixels={pixels}", "training.device=cpu"])
    model, processor = load_policy(cfg, torch.device("cpu"))
    rows, _ = load_dataset_split(data_path, limit_images=4, skip_bad_rows=False)
    prompts = encode_rows(processor, rows[:2], cfg, torch.device("cpu"))
    # One left-padding column on both prompts (the padding mask must reach attention).
    pad = {"input_ids": processor.tokenizer.pad_token_id or 0, "attention_mask": 0, "mm_token_type_ids": 0}
    for k, v in pad.items():
        if k in prompts:
            prompts[k] = torch.cat([torch.full_like(prompts[k][:, :1], v), prompts[k]], dim=1)
    _, row_prompt = group_rows(torch.arange(2).repeat_interleave(2))
    out = {}
    for width in (5, 6):  # one of the two total lengths is odd: the sp padding is exercised
        g = torch.Generator().manual_seed(width)
        ids = torch.randint(10, 200, (4, width), generator=g)
        mask = (torch.arange(width) < torch.tensor([[width], [3], [width - 1], [2]])).long()  # right padded
        adv = torch.tensor([1.0, -1.0, 0.5, -0.25])
        paths = [("default", LogprobOptions(chunk_tokens=1024))]  # grouped vision (the prefix path is off under SP)
        if width == 6:
            paths.append(("naive", LogprobOptions(chunk_tokens=1024, shared_prefix=False, group_vision=False)))
        for name, opts in paths:

            def loss_and_logps(m, opts=opts, ids=ids, mask=mask, adv=adv, width=width):
                logps = completion_logps_for(m, prompts, row_prompt, ids, mask, opts)
                return aggregate(
                    per_token_loss(logps, logps.detach(), adv, AlgorithmConfig())[0], mask, "grpo", step_normaliser([mask], width)
                ), logps

            results = []
            for sp_on in (False, True):
                m = copy.deepcopy(model)
                m.train()
                ctx = ulysses.sequence_parallel(m) if sp_on else torch.enable_grad()
                with ctx:
                    with torch.no_grad():
                        scored = completion_logps_for(m, prompts, row_prompt, ids, mask, opts)
                    loss, logps = loss_and_logps(m)
                    loss.backward()
                grads = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in m.parameters()])
                if sp_on:
                    dist.all_reduce(grads)  # the mean over the SP ranks is the one-process gradient (what DDP averages)
                    grads /= 2
                results.append((scored * mask, logps.detach() * mask, loss.detach(), grads))
            (s1, l1, loss1, g1), (s2, l2, loss2, g2) = results
            out[(width, name)] = (
                (s1 - s2).abs().max().item(),
                (l1 - l2).abs().max().item(),
                abs(loss1.item() - loss2.item()),
                ((g1 - g2).abs().max() / g1.abs().max()).item(),
            )
    queue.put((rank, out))
    dist.destroy_process_group()


# (builder, pixels per image): Qwen3-VL's patches are 16 px and merged 2x2, so its images are 64 x 64.
FAMILIES = {
    "qwen2.5-vl": ("tiny.build_tiny_qwen25vl", 3136),
    "qwen2-vl": ("tiny.build_tiny_qwen2vl", 3136),
    "qwen3-vl": ("tiny_families.build_tiny_qwen3vl", 4096),
}


@pytest.fixture(scope="module")
def count_task(tmp_path_factory):
    from vlmrl.data.tasks import make_count_task

    return make_count_task(tmp_path_factory.mktemp("ulysses_count"), n_train=16, n_test=0, seed=0, image_size=56)


@pytest.mark.multiproc
@pytest.mark.slow  # ~20-30 s per family on 2 shared cores: two processes load the tiny model and score it 6 times
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sp2_on_two_gloo_processes_scores_and_gradients_equal_one_process(family, count_task, tmp_path):
    """The vision encoder runs whole on each rank (its sharding is a later slice); the decoder is split in two.
    Qwen3-VL: its DeepStack features (added to the image tokens' hidden states in the first decoder layers) are cut
    to each rank's share of the sequence too."""
    import importlib

    module, builder = FAMILIES[family][0].split(".")
    model = getattr(importlib.import_module(f"vlmrl.tiny_models.{module}"), builder)(tmp_path / "model")
    results = _spawn(_exactness_worker, str(model), str(count_task["train"]), FAMILIES[family][1], timeout=240)
    for rank in range(2):
        assert isinstance(results[rank][0], dict), results[rank][0]
        for key, (scored, logps, loss, grad) in results[rank][0].items():
            assert scored < 1e-5 and logps < 1e-5 and loss < 1e-6 and grad < 1e-5, (rank, key, scored, logps, loss, grad)


# ---------------------------------------------------------------- config: the peers' names, the refusals
@pytest.mark.parametrize(
    "override",
    [
        "training.sequence_parallel_size=2",
        "sequence_parallel_size=2",  # ms-swift
        "ulysses_sequence_parallel_size=2",  # verl / EasyR1's flat name
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",  # verl
        "worker.actor.ulysses_size=2",  # EasyR1
    ],
)
def test_peers_names_set_sequence_parallel_size(override):
    from vlmrl.config import load_config

    assert load_config(None, [override]).training.sequence_parallel_size == 2


def test_verl_nested_yaml_sets_sequence_parallel_size(tmp_path):
    from vlmrl.config import load_config

    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    ulysses_sequence_parallel_size: 4\n")
    assert load_config(path, []).training.sequence_parallel_size == 4


def test_sequence_parallel_size_below_one_is_refused():
    from vlmrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"training.sequence_parallel_size=0 must be >= 1"):
        load_config(None, ["training.sequence_parallel_size=0"])


@pytest.mark.parametrize(
    "sp,world,extra,expected",
    [
        (3, 3, (), "training.sequence_parallel_size=3 must divide the attention heads (4); pick a divisor of 4"),
        (2, 3, (), "training.sequence_parallel_size=2 must divide the number of processes (3); pick a divisor of 3"),
        (4, 4, (), "training.sequence_parallel_size=4 must divide the key/value heads (2); pick a divisor of 2"),
        (2, 4, (), "training.sequence_parallel_size=2 with 4 processes: sequence parallelism inside data parallelism is not done yet"),
        (2, 2, ("model.use_lora=true",), "training.sequence_parallel_size=2: not yet with model.use_lora=true"),
        (2, 2, ("rollout.engine=continuous",), "training.sequence_parallel_size=2: not yet with rollout.engine=continuous"),
    ],
)
def test_cli_train_refuses_sequence_parallel_in_one_line(tiny_qwen25vl, tmp_path, capsys, monkeypatch, sp, world, extra, expected):
    """The tiny Qwen2.5-VL has 4 attention heads and 2 key/value heads; the size is checked against the launch's
    processes (WORLD_SIZE), then the settings Ulysses does not run with yet are refused, each in one line."""
    from vlmrl import cli
    from vlmrl.data.tasks import make_count_task

    data = make_count_task(tmp_path / "count", n_train=4, n_test=0, seed=0, image_size=56)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "1")  # not the main process: no data read before the refusal
    args = [f"model.name_or_path={tiny_qwen25vl}", f"data.train_path={data['train']}", f"training.output_dir={tmp_path / 'out'}"]
    code = cli.main(["train", *args, *extra, f"training.sequence_parallel_size={sp}", "training.device=cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_sequence_parallel_refusal_names_the_family():
    from types import SimpleNamespace

    from vlmrl.engine.ulysses import sequence_parallel_refusal

    text = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    assert sequence_parallel_refusal(1, 2, None) is None
    assert "(dense) for now, not llava; set it to 1" in sequence_parallel_refusal(2, 2, SimpleNamespace(model_type="llava", text_config=text))
    moe = SimpleNamespace(model_type="qwen3_vl_moe", text_config=SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_experts=4))
    assert "(dense) for now, not qwen3_vl_moe (experts); set it to 1" in sequence_parallel_refusal(2, 2, moe)
    qwen25 = SimpleNamespace(model_type="qwen2_5_vl", text_config=text)
    assert "not yet in `vlmrl sft`" in sequence_parallel_refusal(2, 2, qwen25, "sft")
    assert sequence_parallel_refusal(2, 2, qwen25) is None  # what `vlmrl train` runs: sp = the processes
    assert "not the embedded model" in sequence_parallel_refusal(2, 2, None)


def test_sequence_parallel_of_one_process_keeps_the_values_and_leaves_the_model_as_it_was(tiny_qwen25vl):
    """SP 1 over a one-process gloo group: the same forward through the Ulysses attention (its own mask, the padding,
    the hooks); after the `with`, the model's attention implementation and hooks are its own again."""
    import torch.distributed as dist
    from torch.distributed import TCPStore
    from transformers import AutoModelForImageTextToText

    from vlmrl.engine.ulysses import ATTENTION_NAME, sequence_parallel

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen25vl).eval()
    text = model.model.language_model
    ids = torch.randint(10, 200, (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])  # left and right padding
    with torch.no_grad():
        expected = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        implementation, hooks = text.config._attn_implementation, (dict(text._forward_pre_hooks), dict(text._forward_hooks))
        with sequence_parallel(model), torch.no_grad():
            assert text.config._attn_implementation == ATTENTION_NAME
            got = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        assert text.config._attn_implementation == implementation and (dict(text._forward_pre_hooks), dict(text._forward_hooks)) == hooks
        assert not hasattr(model, "vlmrl_sequence_parallel")
    finally:
        dist.destroy_process_group()
    real = mask.bool()
    assert torch.allclose(got[real], expected[real], atol=1e-5)
