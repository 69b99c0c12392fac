"""`vlmrl train` with Ulysses sequence parallelism (training.sequence_parallel_size = the number of processes): the
two processes hold the same rows (sampled identically from the per-prompt seeds, rollout.sampling_seed=prompt, and
checked equal every step), each runs the decoder on half of every sequence in scoring (old and reference log-probs)
and the update, and DDP's gradient average is the one-process gradient. So a 2-step GRPO run with SP 2 on 2 gloo
processes is the one-process run: per-step rewards equal, losses / KL within float tolerance, final weights within
5e-5 (the same tolerance as DDP vs one process in test_distributed.py: sums in another order, amplified by Adam)."""

import sys

import pytest
import torch
from multiproc_runs import grpo_args, run_launcher, step_metrics, tiny_run_setup, torchrun
from safetensors.torch import load_file

from vlmrl.engine.collectives import Collectives, DistributedError


# ---------------------------------------------------------------- one process: the data view of an SP group
class _TwoProcessesOneGroup(Collectives):
    """Collectives as rank 1 of 2 processes forming one SP group (no process group: only pass-through paths run)."""

    def __init__(self):
        super().__init__(None)
        self.world_size, self.rank, self.sp = 2, 1, 2


def test_an_sp_group_is_one_data_parallel_rank():
    c = _TwoProcessesOneGroup()
    shard = c.shard(4, 2, 4)
    assert c.data_world == 1 and shard.prompts == [0, 1, 2, 3] and shard.rows_per_opt_step == 4  # every row, like one process
    t = torch.arange(8.0)
    assert c.local(shard, t) is t and c.all_values(t) is t and c.all_sum([3.0]) == [3.0]
    cols = ([1.0, 2.0],)
    assert c.gather_rows(shard, *cols)[0] is cols[0]
    masks = [torch.ones(2, 3)]
    norm = c.step_normaliser(masks, 5)
    assert norm.num_sequences == 2 and norm.num_tokens == 6  # not doubled by the second process of the group


def test_sp_processes_that_sampled_different_rows_stop_in_one_line(monkeypatch):
    """The other process's rollout hashed differently (a sampler not deterministic across processes): every process
    raises the same DistributedError instead of training on a mix of rows."""
    import torch.distributed as dist

    from vlmrl.models.rollout import Completions

    c = _TwoProcessesOneGroup()
    comp = Completions(ids=torch.tensor([[5, 6]]), mask=torch.ones(1, 2, dtype=torch.long), truncated=torch.zeros(1, dtype=torch.bool))
    mine = []

    def gather(out, obj):  # rank 0 sampled [5, 7]: its hash differs
        mine.append(obj)
        out[:] = [obj.replace(obj[0], "x" if obj[0] != "x" else "y", 1), obj]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    with pytest.raises(DistributedError, match="sequence-parallel processes sampled different completions"):
        c.gather_rollout(c.shard(1, 1, 1), [1.0], {}, comp)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj, obj]))
    total, _, lengths, _ = c.gather_rollout(c.shard(1, 1, 1), [1.0], {}, comp)  # the same rows: passed through
    assert total == [1.0] and lengths.tolist() == [2]


@pytest.mark.parametrize(
    "world,engine,expected",
    [
        (4, "ddp", "training.sequence_parallel_size=2 with 4 processes: set it to the number of processes or 1"),
        (2, "fsdp2", "training.sequence_parallel_size=2: not yet with the fsdp2 engine"),
        (2, "deepspeed", "training.sequence_parallel_size=2: not yet with the deepspeed engine"),
    ],
)
def test_use_sequence_parallel_refuses_what_the_loop_does_not_run(world, engine, expected):
    from types import SimpleNamespace

    from vlmrl.engine.distributed import Distributed

    d = Distributed(None)
    d.world_size, d.engine = world, SimpleNamespace(name=engine)
    with pytest.raises(DistributedError, match=expected):
        d.use_sequence_parallel(2)
    assert d.sp == 1
    d.use_sequence_parallel(1)  # off: nothing asked of the engine or the processes
    assert d.sequence_metrics() == {}


# ---------------------------------------------------------------- two processes vs one
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_setup(tmp_path_factory, "ulysses_train")


def _args(setup, out, *extra):
    # 4 prompts x G=2 per step, optimizer steps of 4 completions: 2 optimizer steps per rollout, so the old
    # log-probs are scored (and the reference's, beta 0.05) before the first update.
    return grpo_args(setup, out, *extra, steps=2)


@pytest.fixture(scope="module")
def reference(setup):
    ref = setup[0] / "one"
    run_launcher([sys.executable, "-m", "vlmrl", "train", *_args(setup, ref)])
    return ref


@pytest.mark.multiproc
@pytest.mark.slow  # two launches of the tiny model (~60 s on 2 shared cores)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_grpo_with_sp2_on_two_processes_equals_one_process(setup, reference, checkpointing):
    """checkpointing: the SP run recomputes each decoder layer in backward, which
    runs the Ulysses attention again there: the split must span backward, not only the forward (model.gradient_checkpointing)."""
    ref = reference
    out = setup[0] / f"sp2_checkpointing_{checkpointing}"
    extra = ("training.sequence_parallel_size=2", f"model.gradient_checkpointing={str(checkpointing).lower()}")
    log = run_launcher(torchrun("--standalone", "--nproc_per_node", "2") + _args(setup, out, *extra))
    assert "2 processes (ddp)" in log and "4 of 4 prompts per step on each process" in log  # both hold every row
    a, b = step_metrics(out), step_metrics(ref)
    for s in (1, 2):
        assert a[s]["reward"] == b[s]["reward"], s  # the same completions
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-4, abs=1e-7), s
        assert a[s]["kl"] == pytest.approx(b[s]["kl"], rel=1e-4, abs=1e-9), s
        assert {"mem/host_peak_rss/rank0", "mem/host_peak_rss/rank1"} <= a[s].keys()
        assert a[s]["grad_norm"] == pytest.approx(b[s]["grad_norm"], rel=1e-4), s  # the gradient's scale, not only its direction
        # The decoder ran on half of each (sp-padded) sequence on each process: the rows were split, not replicated.
        assert a[s]["sequence_parallel/tokens"] == 2 * a[s]["sequence_parallel/tokens_per_process"] > 0, a[s]
    wa, wb = load_file(out / "final" / "model.safetensors"), load_file(ref / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    moved = max((wb[k] - load_file(setup[1] / "model.safetensors")[k]).abs().max().item() for k in wb)
    assert worst < 5e-5 < moved, (worst, moved)  # equal, and the weights did move
