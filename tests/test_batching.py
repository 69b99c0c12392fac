import random

import pytest

from vlmrl.algo.batching import pack_by_tokens, split_by_rows


def test_split_by_rows():
    assert split_by_rows([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4]]


def test_pack_hand_computed():
    # lengths 5, 1, 4, 2 with prompt 2 and budget 14: [0 (7), 2 (6)] -> 2 x 7 = 14; [3, 1] -> 2 x 4 = 8
    assert pack_by_tokens([0, 1, 2, 3], [5, 1, 4, 2], budget=14, prompt_len=2) == [[0, 2], [3, 1]]


def test_row_over_budget_gets_its_own_micro_batch():
    assert pack_by_tokens([7, 8], [50, 3], budget=10) == [[7], [8]]


@pytest.mark.parametrize("seed", range(5))
def test_pack_properties(seed):
    rng = random.Random(seed)
    rows = list(range(40))
    lengths = [rng.randint(1, 30) for _ in rows]
    budget, prompt = 120, 10
    packed = pack_by_tokens(rows, lengths, budget, prompt)
    assert sorted(r for m in packed for r in m) == rows
    for m in packed:
        assert len(m) == 1 or len(m) * (prompt + max(lengths[r] for r in m)) <= budget
