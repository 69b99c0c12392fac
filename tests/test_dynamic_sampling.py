"""DAPO's dynamic sampling and soft overlong punishment (issue 39, parts 1-2): the pure pieces on hand-computed
examples, the peers' names, and the loop: groups filtered, batches refilled, resume bit-exact."""

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.algo.dynamic_sampling import group_keep_mask, pick_groups, shares_full, source_rows
from vlmrl.config import ConfigError, load_config
from vlmrl.data.tasks import make_count_task
from vlmrl.rewards.combine import compute_rewards
from vlmrl.rewards.functions import overlong_penalty, soft_overlong_punishment
from vlmrl.rewards.scoring import load_reward_funcs
from vlmrl.train import train

from test_resume import overrides as resume_overrides

ODD_LENGTH = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":length_on_odd_counts"


# ---------------------------------------------------------------- which groups are kept
def test_keep_mask_drops_groups_whose_values_are_all_equal():
    # G=3: [1,1,1] all equal, [0,1,0] mixed, [0.5,0.5,0.5] equal, [2,2,2.0001] mixed
    values = torch.tensor([1.0, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5, 2, 2, 2.0001])
    assert group_keep_mask(values, 3).tolist() == [False, True, False, True]


def test_keep_mask_keeps_a_group_with_a_missing_value():
    # a reward that does not apply (None -> NaN) says nothing about the group's spread: kept, not dropped
    values = torch.tensor([0.0, 0.0, float("nan"), 1.0, 1.0, 1.0])
    assert group_keep_mask(values, 3).tolist() == [True, False]


def test_one_process_takes_the_first_kept_groups_in_order():
    keeps = [torch.tensor([True, False, False, True]), torch.tensor([False, True, True, True])]
    shards = [[0, 1, 2, 3]]
    assert shares_full(keeps, shards)
    picks = pick_groups(keeps, shards)
    # kept: (0,0), (0,3), (1,1), (1,2), (1,3): the first four fill positions 0..3
    assert picks.sources == [(0, 0), (0, 3), (1, 1), (1, 2)]
    assert picks.filled == 0 and not picks.identity
    # row map for G=2, B=4: round 1's row i is 8 + i
    assert source_rows(picks, 4, 2) == [0, 1, 6, 7, 10, 11, 12, 13]


def test_first_batch_all_kept_is_unchanged():
    picks = pick_groups([torch.tensor([True, True, True])], [[0, 1, 2]])
    assert picks.identity and picks.filled == 0


def test_rounds_ran_out_the_batch_is_topped_up_with_filtered_groups():
    keeps = [torch.tensor([False, True, False]), torch.tensor([False, False, False])]
    shards = [[0, 1, 2]]
    assert not shares_full(keeps, shards)
    picks = pick_groups(keeps, shards)
    # one kept group first, then the filtered ones in (round, position) order
    assert picks.sources == [(0, 1), (0, 0), (0, 2)]
    assert picks.filled == 2


def test_each_process_fills_its_share_from_its_own_positions():
    # two processes: rank 0 owns positions 0, 1; rank 1 owns 2, 3
    shards = [[0, 1], [2, 3]]
    keeps = [torch.tensor([True, True, True, False])]
    assert not shares_full(keeps, shards)  # 3 kept groups, but rank 1 has only one of its two
    keeps.append(torch.tensor([True, False, False, False]))
    assert not shares_full(keeps, shards)  # 4 kept groups in all, still one of rank 1's two
    keeps.append(torch.tensor([False, False, False, True]))
    assert shares_full(keeps, shards)
    picks = pick_groups(keeps, shards)
    assert picks.sources == [(0, 0), (0, 1), (0, 2), (2, 3)]
    for positions in shards:  # no completion moves between processes
        assert all(picks.sources[k][1] in positions for k in positions)


# ---------------------------------------------------------------- soft overlong punishment
def test_overlong_penalty_at_the_boundaries():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then -1/4 per token, -1 at 10 and beyond
    assert overlong_penalty(0, 10, 4) == 0.0
    assert overlong_penalty(6, 10, 4) == 0.0  # exactly L_max - L_cache
    assert overlong_penalty(7, 10, 4) == -0.25  # inside the buffer
    assert overlong_penalty(9, 10, 4) == -0.75
    assert overlong_penalty(10, 10, 4) == -1.0  # at L_max
    assert overlong_penalty(12, 10, 4) == -1.0


def test_soft_overlong_punishment_reads_completion_ids():
    fn = soft_overlong_punishment(max_completion_len=8, soft_punish_cache=2)
    ids = [[1] * 5, [1] * 6, [1] * 7, [1] * 8]
    assert fn(["p"] * 4, ["c"] * 4, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0]
    assert fn(["p"], ["c"]) == [None]  # no ids: the term does not apply


def test_overlong_shaping_adds_the_term_weighted_by_the_penalty_factor():
    cfg = load_config(
        None,
        [
            "algorithm.reward_funcs=[answer_format]",
            "rollout.max_completion_length=8",
            "algorithm.overlong_shaping=true",
            "algorithm.overlong_buffer_len=4",
            "algorithm.overlong_penalty_factor=0.5",
        ],
    )
    funcs, weights = load_reward_funcs(cfg)
    assert list(funcs) == ["answer_format", "overlong"] and weights["overlong"] == 0.5
    completions = ["<answer>1</answer>", "<answer>1</answer>", "no answer"]
    ids = [[1] * 4, [1] * 6, [1] * 8]  # 4 <= 8 - 4: no penalty; 6: -2/4; 8: -1
    total, per = compute_rewards(funcs, weights, ["q"] * 3, completions, {}, completion_ids=ids)
    assert per["overlong"] == [0.0, -0.5, -1.0]
    assert total == [1.0, 1.0 - 0.25, -0.5]


def test_overlong_shaping_needs_a_buffer_within_the_length():
    for length in (0, 9):
        with pytest.raises(ConfigError, match="overlong_buffer_len"):
            load_config(None, ["rollout.max_completion_length=8", "algorithm.overlong_shaping=true", f"algorithm.overlong_buffer_len={length}"])


# ---------------------------------------------------------------- the peers' names
def test_verl_yaml_names(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(
        "algorithm:\n  filter_groups: {enable: true, metric: acc, max_num_gen_batches: 5}\n"
        "reward_model:\n  overlong_buffer: {enable: true, len: 4, penalty_factor: 0.5, log: false}\n"
        "rollout:\n  max_completion_length: 16\n"
    )
    a = load_config(path).algorithm
    assert (a.dynamic_sampling, a.dynamic_sampling_metric, a.dynamic_sampling_max_batches) == (True, "accuracy", 5)
    assert (a.overlong_shaping, a.overlong_buffer_len, a.overlong_penalty_factor) == (True, 4, 0.5)


def test_easyr1_and_ms_swift_names():
    a = load_config(None, ["algorithm.online_filtering=true", "trainer.max_try_make_batch=7"]).algorithm
    assert (a.dynamic_sampling, a.dynamic_sampling_max_batches) == (True, 7)
    a = load_config(None, ["dynamic_sample=true", "max_resample_times=3", "overlong_filter=true"]).algorithm
    assert (a.dynamic_sampling, a.dynamic_sampling_max_batches, a.mask_truncated_completions) == (True, 3, True)


@pytest.mark.parametrize("key", ["algorithm.filter_groups.max_num_gen_batches=0", "trainer.max_try_make_batch=-1"])
def test_an_unbounded_number_of_batches_is_refused(key):
    with pytest.raises(ConfigError, match="no limit"):
        load_config(None, [key])


def test_a_metric_that_is_no_reward_is_refused():
    cfg = load_config(None, ["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_metric=acc_typo"])
    with pytest.raises(ConfigError, match="dynamic_sampling_metric='acc_typo'"):
        load_reward_funcs(cfg)


# ---------------------------------------------------------------- the loop
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=12, n_test=0, seed=0, image_size=56)


def overrides(model, data, out, *extra):
    """test_resume's run (the same data, sizes and seeds) with dynamic sampling on, 3 steps, a constant learning rate."""
    return resume_overrides(
        model,
        data,
        out,
        "training.max_steps=3",
        "optim.lr_scheduler_type=constant",
        "optim.warmup_ratio=0.0",
        f"algorithm.reward_funcs=['{ODD_LENGTH}']",  # groups of even counts have equal rewards
        "algorithm.dynamic_sampling=true",
        *extra,
    )


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_filtered_groups_are_replaced_by_further_batches(tiny_qwen25vl, data, tmp_path):
    train(load_config(None, overrides(tiny_qwen25vl, data, tmp_path / "run", "algorithm.dynamic_sampling_max_batches=4")))
    rows = metrics(tmp_path / "run")
    assert sum(r["dynamic_sampling/filtered_groups"] for r in rows) > 0  # the reward leaves some groups without signal
    assert sum(r["dynamic_sampling/extra_batches"] for r in rows) > 0
    for r in rows:
        assert r["dynamic_sampling/extra_rollouts"] == r["dynamic_sampling/extra_batches"] * 8
        if r["dynamic_sampling/filled_groups"] == 0:
            assert r["frac_reward_zero_std"] == 0.0  # the batch trained on holds only groups with a spread


def test_without_extra_batches_the_step_trains_on_what_it_has_and_says_so(tiny_qwen25vl, data, tmp_path, capsys):
    train(load_config(None, overrides(tiny_qwen25vl, data, tmp_path / "run", "algorithm.dynamic_sampling_max_batches=1")))
    lines = capsys.readouterr().out.splitlines()
    rows = metrics(tmp_path / "run")
    assert all(r["dynamic_sampling/extra_batches"] == 0 for r in rows)
    filled = [r for r in rows if r["dynamic_sampling/filled_groups"] > 0]
    assert filled and all(r["frac_reward_zero_std"] > 0 for r in filled)
    assert any("dynamic sampling kept" in line and "dynamic_sampling_max_batches" in line for line in lines), lines


def test_stop_and_resume_with_dynamic_sampling_is_bit_exact(tiny_qwen25vl, data, tmp_path):
    extra = ("training.max_steps=4", "algorithm.dynamic_sampling_max_batches=3")
    straight = tmp_path / "straight"
    train(load_config(None, overrides(tiny_qwen25vl, data, straight, *extra)))
    resumed = tmp_path / "resumed"
    cfg = load_config(None, overrides(tiny_qwen25vl, data, resumed, *extra))
    train(cfg, stop_after=2)
    train(cfg)
    assert sum(r["dynamic_sampling/extra_batches"] for r in metrics(straight)[2:]) > 0  # the resumed steps drew extra batches
    keys = ("loss", "reward", "dynamic_sampling/extra_batches", "dynamic_sampling/filtered_groups")
    assert [[r[k] for k in keys] for r in metrics(resumed)] == [[r[k] for k in keys] for r in metrics(straight)]
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dynamic_sampling_is_refused_with_multiturn_rollouts_and_routing_replay():
    with pytest.raises(ConfigError, match="dynamic_sampling assembles the batch"):
        load_config(None, ["algorithm.dynamic_sampling=true", "tools.tools=[crop]", "rollout.engine=continuous"])
    with pytest.raises(ConfigError, match="dynamic_sampling assembles the batch"):
        load_config(None, ["algorithm.dynamic_sampling=true", "algorithm.routing_replay=experts"])


@pytest.mark.multiproc
def test_two_processes_agree_on_the_kept_groups(tmp_path_factory):
    """Two DDP processes: each fills its share from its own groups, the rounds decided from the gathered rewards (a
    process that drew one batch more than the other would leave a collective unmatched and the run would hang)."""
    from multiproc_runs import grpo_args, run_launcher, tiny_run_setup, torchrun

    setup = tiny_run_setup(tmp_path_factory, "dynamic_ddp")
    out = setup[0] / "ddp"
    args = grpo_args(setup, out, f"algorithm.reward_funcs=['{ODD_LENGTH}']", "algorithm.dynamic_sampling=true")
    log = run_launcher(torchrun("--standalone", "--nproc_per_node", "2") + args, timeout=600)
    assert "2 processes (ddp)" in log
    rows = metrics(out)
    assert len(rows) == 3 and sum(r["dynamic_sampling/extra_batches"] for r in rows) > 0
    for r in rows:
        if r["dynamic_sampling/filled_groups"] == 0:
            assert r["frac_reward_zero_std"] == 0.0
