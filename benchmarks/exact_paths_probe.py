"""Do the memory paths round like the plain ones? One LM-head chunking and five AdamW steps at the demo's sizes.

    PYTHONPATH=<tree>/src python benchmarks/exact_paths_probe.py [--time]

Compares, with the vlmrl on the path: `selective_logps` through the fused head against the checkpointed chunks (the
head's `fused_head_applies` switched off) on 8 x 16 tokens of the tiny model's sizes (hidden 64, vocabulary 604,
128-token chunks): log-probs, hidden and weight gradients; and five AdamW steps on a 604 x 64 and a 64 parameter:
torch's fused CPU kernel and `make_optimizer`'s optimizer against torch's default (the per-parameter loop). Prints
how many elements differ and by how much: 0 means bit for bit. --time also times one AdamW step on a 151,936 x 128
float32 parameter (a Qwen-size LM head), 7 steps of each optimizer interleaved, with the machine's load.
"""

import os
import statistics
import sys
import time

import torch

import vlmrl.models.logprobs as logprobs
from vlmrl.engine import optim


def differ(a: torch.Tensor, b: torch.Tensor) -> str:
    n = int((a != b).sum())
    return "equal" if n == 0 else f"{n}/{a.numel()} elements differ, max {float((a - b).abs().max()):.2e}"


def head_paths() -> None:
    torch.manual_seed(0)
    n, t, h, v = 8, 16, 64, 604
    head = torch.nn.Linear(h, v, bias=False)
    hidden, targets, weights = torch.randn(n, t, h), torch.randint(v, (n, t)), torch.rand(n, t)

    def run(fused: bool):
        x = hidden.clone().requires_grad_(True)
        head.weight.grad = None
        applies = logprobs.fused_head_applies
        logprobs.fused_head_applies = applies if fused else (lambda *a: False)
        try:
            out = logprobs.selective_logps(x, head, targets, 1.0, chunk_tokens=128)
        finally:
            logprobs.fused_head_applies = applies
        (out * weights).sum().backward()
        return out.detach(), x.grad, head.weight.grad.clone()

    for name, a, b in zip(("log-probs", "hidden grad", "head weight grad"), run(True), run(False)):
        print(f"fused head vs checkpointed chunks, {name}: {differ(a, b)}")


def adamw_paths() -> None:
    from types import SimpleNamespace

    torch.manual_seed(0)
    shapes = [(604, 64), (64,)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(5)]
    o = SimpleNamespace(
        learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, lr_scheduler_type="constant", warmup_ratio=0.0
    )

    def run(kind: str):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        if kind == "make_optimizer":
            opt, _ = optim.make_optimizer(torch.nn.ParameterList(params), o, 10)
        else:
            opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True if kind == "fused" else None)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params], type(opt).__name__

    default, _ = run("default")
    for kind in ("fused", "make_optimizer"):
        got, name = run(kind)
        print(f"AdamW {kind} ({name}) vs torch's default after 5 steps: " + "; ".join(differ(a, b) for a, b in zip(got, default)))


def adamw_times() -> None:
    v, h = 151936, 128

    def make(cls, **kw):
        p = torch.nn.Parameter(torch.randn(v, h))
        p.grad = torch.randn(v, h)
        opt = cls([p], lr=1e-4, **kw)
        opt.step()  # state and buffers made
        return opt

    opts = {"torch default": make(torch.optim.AdamW), "torch fused": make(torch.optim.AdamW, fused=True), "InPlaceAdamW": make(optim.InPlaceAdamW)}
    times = {k: [] for k in opts}
    load = os.getloadavg()[0]
    for _ in range(7):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    print(
        f"AdamW step on {v} x {h}, load {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: "
        + "; ".join(f"{k} median {statistics.median(t):.3f} s (min {min(t):.3f})" for k, t in times.items())
    )


if __name__ == "__main__":
    print(f"torch {torch.__version__}, vlmrl from {logprobs.__file__}")
    head_paths()
    adamw_paths()
    if "--time" in sys.argv:
        adamw_times()
