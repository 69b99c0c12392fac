"""The fused LM-head log-probs (`_FusedHeadLogps`: one reused [chunk, V] buffer, the weight gradient accumulated in
place) against the checkpointed chunks it replaces and a full log-softmax, and the heads it must leave alone."""

import pytest
import torch

import vlmrl.models.logprobs as logprobs
from vlmrl.models.logprobs import fused_head_applies, selective_logps

pytestmark = pytest.mark.unit


def full_softmax(hidden, head, targets, temperature):
    logits = head(hidden).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def run(path, hidden, head, targets, temperature, chunk, weights, monkeypatch=None):
    """(log-probs, hidden grad, weight grad) through `path`: fused, checkpointed (fused switched off) or full."""
    hidden = hidden.detach().clone().requires_grad_(hidden.requires_grad)
    head.weight.grad = None
    if path == "full":
        out = full_softmax(hidden, head, targets, temperature)
    else:
        with monkeypatch.context() as m:
            if path == "checkpointed":
                m.setattr(logprobs, "fused_head_applies", lambda *a: False)
            out = selective_logps(hidden, head, targets, temperature, chunk_tokens=chunk)
    (out * weights).sum().backward()
    return out.detach(), hidden.grad, head.weight.grad


@pytest.mark.parametrize("temperature,chunk", [(1.0, 4), (0.7, 4), (1.3, 64)])
def test_fused_equals_checkpointed_and_full_softmax(monkeypatch, temperature, chunk):
    """15 tokens in chunks of 4 (uneven last chunk) and in one chunk; a non-uniform upstream gradient, zeros included
    (masked tokens). Against the checkpointed chunks bit for bit (same kernels, the chunks' weight gradients added in
    autograd's order): a seeded run gives the same bits with the fused head as without it. Against one full softmax
    (one matmul over all tokens, the weight gradient not summed over chunks) to float32 rounding."""
    torch.manual_seed(0)
    n, t, h, v = 3, 5, 16, 50
    head = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, t, h, requires_grad=True)
    targets = torch.randint(v, (n, t))
    targets[0, :3] = targets[0, 3]  # repeated targets inside one chunk: their gradients add up
    weights = torch.rand(n, t)
    weights[2, 3:] = 0.0
    assert fused_head_applies(hidden, head)
    fused = run("fused", hidden, head, targets, temperature, chunk, weights, monkeypatch)
    checkpointed = run("checkpointed", hidden, head, targets, temperature, chunk, weights, monkeypatch)
    full = run("full", hidden, head, targets, temperature, chunk, weights)
    for got, want in zip(fused, checkpointed):
        assert torch.equal(got, want)
    torch.testing.assert_close(fused[0], full[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(fused[1], full[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fused[2], full[2], rtol=1e-5, atol=1e-7)


def test_fused_gradient_to_weight_only_and_hidden_only(monkeypatch):
    """A frozen decoder (hidden without grad) trains only the head; a frozen head (LoRA elsewhere) passes only the
    hidden gradient on and leaves the weight's grad None."""
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 30, bias=False)
    targets = torch.randint(30, (2, 6))
    weights = torch.rand(2, 6)
    hidden = torch.randn(2, 6, 8)
    fused = run("fused", hidden, head, targets, 0.9, 5, weights, monkeypatch)
    reference = run("full", hidden, head, targets, 0.9, 5, weights)
    assert fused[1] is None
    torch.testing.assert_close(fused[2], reference[2], rtol=1e-5, atol=1e-7)
    head.weight.requires_grad_(False)
    hidden.requires_grad_(True)
    fused = run("fused", hidden, head, targets, 0.9, 5, weights, monkeypatch)
    reference = run("full", hidden, head, targets, 0.9, 5, weights)
    assert fused[2] is None
    torch.testing.assert_close(fused[1], reference[1], rtol=1e-5, atol=1e-7)


def test_fused_bf16_head_rounds_like_the_module(monkeypatch):
    """A bf16 head: logits rounded to bf16 before the float32 softmax, gradients through bf16 matmuls, as
    lm_head(h).float() would give (checkpointed path: same rounding, so near-equal; not the float32 values)."""
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 40, bias=False).to(torch.bfloat16)
    hidden = torch.randn(2, 7, 16, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(40, (2, 7))
    weights = torch.rand(2, 7)
    assert fused_head_applies(hidden, head)
    fused = run("fused", hidden, head, targets, 0.8, 3, weights, monkeypatch)
    checkpointed = run("checkpointed", hidden, head, targets, 0.8, 3, weights, monkeypatch)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == fused[2].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], checkpointed[0], rtol=0, atol=1e-5)
    # bf16 gradients summed in another order (addmm_ into one tensor vs a sum of per-chunk ones): within one bf16 ulp.
    torch.testing.assert_close(fused[1].float(), checkpointed[1].float(), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(fused[2].float(), checkpointed[2].float(), rtol=2e-2, atol=1e-2)


class WrappedHead(torch.nn.Module):
    """What LoRA / quantised heads look like: a module around a weight, with its own forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.weight = inner, inner.weight

    def forward(self, x):
        return self.inner(x) * 2.0


def test_heads_the_fused_path_leaves_alone():
    """Anything that intercepts the head's forward keeps the module call: hooks (FSDP2 / ZeRO-3 gather weights in
    them), a bias, a wrapper module, autocast. The hook is still called and the wrapper's forward still counts."""
    torch.manual_seed(3)
    hidden = torch.randn(1, 4, 8)
    targets = torch.randint(20, (1, 4))
    head = torch.nn.Linear(8, 20, bias=False)
    calls = []
    handle = head.register_forward_pre_hook(lambda module, args: calls.append(1))
    assert not fused_head_applies(hidden.reshape(4, 8), head)
    with torch.no_grad():
        selective_logps(hidden, head, targets, 1.0, chunk_tokens=2)
    assert len(calls) == 2  # one call per chunk
    handle.remove()
    assert fused_head_applies(hidden.reshape(4, 8), head)
    assert not fused_head_applies(hidden.reshape(4, 8), torch.nn.Linear(8, 20, bias=True))
    wrapped = WrappedHead(head)
    assert not fused_head_applies(hidden.reshape(4, 8), wrapped)
    with torch.no_grad():
        torch.testing.assert_close(
            selective_logps(hidden, wrapped, targets, 1.0, chunk_tokens=2), full_softmax(hidden, wrapped, targets, 1.0), rtol=0, atol=1e-6
        )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused_head_applies(hidden.reshape(4, 8), head)
