"""prefix.SamplingWorkspace: the decode loops' vocabulary-sized buffers, reused across steps, give the tokens the
fresh-tensor path gives (same kernels written in place) and keep one allocation per buffer."""

import pytest
import torch

from vlmrl.models.prefix import SamplingWorkspace, sample_rows

pytestmark = pytest.mark.unit


def test_workspace_draws_the_same_tokens_and_reuses_its_buffers():
    torch.manual_seed(0)
    workspace = SamplingWorkspace()
    pointers = None
    for n in (6, 6, 3, 6):  # rows leave (3) and the buffers' first rows serve them
        scores = torch.randn(n, 5000) * 4
        scores[:, :7] = float("-inf")  # banned tokens: probability 0, never drawn
        uniforms = torch.rand(n, 1, dtype=torch.float64)
        fresh = sample_rows(scores, uniforms)
        reused = sample_rows(scores, uniforms, workspace)
        assert torch.equal(fresh, reused)
        assert bool((reused >= 7).all())
        now = {k: v.data_ptr() for k, v in workspace.buffers.items()}
        assert pointers is None or now == pointers, "a buffer was reallocated"
        pointers = now
    cdf = workspace.buffers["cdf"]
    assert cdf.dtype == torch.float64 and cdf.shape == (6, 5000)


def test_banned_copy_leaves_the_logits_alone():
    """The sampler's log-probs read the logits after the bans: the bans go into the workspace's copy."""
    logits = torch.randn(2, 10)
    before = logits.clone()
    workspace = SamplingWorkspace()
    scores = workspace.banned(logits)
    scores.index_fill_(1, torch.tensor([0, 3]), float("-inf"))
    assert torch.equal(logits, before)
    assert bool(torch.isinf(scores[:, [0, 3]]).all())
