"""optim.py: the schedule equals transformers' (without importing it in the run), AdamW's state allocated up
front equals its lazy start, a non-finite gradient norm changes nothing; oom.is_out_of_memory."""

import pytest
import torch

from vlmrl.engine.oom import is_out_of_memory, retry_on_oom
from vlmrl.engine.optim import WarmupSchedule, allocate_optimizer_state, clip_and_step

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind, hf_name", [("constant", "constant_with_warmup"), ("linear", "linear"), ("cosine", "cosine")])
@pytest.mark.parametrize("warmup", [0, 3])
def test_schedule_equals_transformers(kind, hf_name, warmup):
    from transformers import get_scheduler

    total = 17
    ours = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3), WarmupSchedule(kind, warmup, total))
    hf = get_scheduler(hf_name, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3), num_warmup_steps=warmup, num_training_steps=total)
    for _ in range(total + 2):
        assert ours.get_last_lr() == hf.get_last_lr()  # exactly: resumed runs compare bit for bit
        ours.optimizer.step()
        hf.optimizer.step()
        ours.step()
        hf.step()


def _model_and_grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    loss = model(torch.randn(5, 4)).pow(2).sum()
    loss.backward()
    return model


def test_adamw_state_allocated_up_front_equals_lazy_start():
    lazy, eager = _model_and_grads(), _model_and_grads()
    opt_lazy = torch.optim.AdamW(lazy.parameters(), lr=0.1)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=0.1)
    allocated = allocate_optimizer_state(opt_eager)
    assert allocated == 2 * 4 * sum(p.numel() for p in eager.parameters())  # exp_avg + exp_avg_sq, fp32
    assert all(len(opt_eager.state[p]) == 3 for p in eager.parameters())
    for _ in range(3):
        opt_lazy.step()
        opt_eager.step()
    for a, b in zip(lazy.parameters(), eager.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt_lazy.state.values(), opt_eager.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_nonfinite_gradient_norm_changes_nothing():
    model = _model_and_grads()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupSchedule("linear", 0, 10))
    params = list(model.parameters())
    assert not clip_and_step(params, opt, sched, 1.0).skipped  # a good step first: AdamW state exists
    before = [p.detach().clone() for p in params]
    state_before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    model(torch.randn(2, 4)).sum().backward()
    params[1].grad[0] = float("nan")
    result = clip_and_step(params, opt, sched, 1.0)
    assert result.skipped and result.grad_norm != result.grad_norm
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(torch.equal(state_before[k], opt.state[params[0]][k]) for k in state_before)
    assert sched.last_epoch == 1 and all(p.grad is None for p in params)


@pytest.mark.parametrize(
    "message, expected",
    [
        ("CUDA out of memory. Tried to allocate 2.00 GiB", True),
        ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", True),
        ("CUDA error: out of memory", True),
        ("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)", False),
        ("the memory layout is out of order", False),
    ],
)
def test_out_of_memory_is_recognised_by_the_allocators_message(message, expected):
    assert is_out_of_memory(RuntimeError(message)) is expected


def test_a_cublas_alloc_failure_is_retried_and_other_runtime_errors_surface():
    calls = []

    def work(size):
        calls.append(size)
        if size > 2:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return size

    assert retry_on_oom(work, 8, "test", lambda _: None) == (2, 2) and calls == [8, 4, 2]

    def broken(size):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        retry_on_oom(broken, 8, "test", lambda _: None)


class _NewTensorsOfSize(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that return a fresh tensor of `numel` elements (in-place ops return their input)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.fresh = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and id(t) not in inputs:
                self.fresh.append(func.__name__)
        return out


def test_make_optimizer_steps_without_parameter_sized_temporaries():
    """The CPU default AdamW (a loop over parameters) makes sqrt(v) and its division as new tensors the size of each
    parameter: a vocabulary-sized head's step then holds two more copies of it. make_optimizer's fused AdamW updates
    in place, and ends where the loop does (to float32 rounding)."""
    from types import SimpleNamespace

    from vlmrl.engine.optim import fused_adamw_applies, make_optimizer

    o = SimpleNamespace(
        learning_rate=1e-2, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, weight_decay=0.01, lr_scheduler_type="constant", warmup_ratio=0.0
    )
    cfg = SimpleNamespace(optim=o)
    fused, loop = _model_and_grads(), _model_and_grads()
    opt, _ = make_optimizer(fused, cfg, 10)
    reference = torch.optim.AdamW(loop.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    allocate_optimizer_state(opt)  # as training does: the moments exist before the first step
    allocate_optimizer_state(reference)
    biggest = max(p.numel() for p in fused.parameters())
    with _NewTensorsOfSize(biggest) as counted:
        opt.step()
    with _NewTensorsOfSize(biggest) as counted_loop:
        reference.step()
    assert counted.fresh == [] and len(counted_loop.fresh) >= 2, (counted.fresh, counted_loop.fresh)
    for _ in range(3):
        opt.step()
        reference.step()
    for a, b in zip(fused.parameters(), loop.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not fused_adamw_applies([torch.zeros(2, device="meta")])  # other devices: torch's default
    assert not fused_adamw_applies([torch.zeros(2, dtype=torch.float64)])


def test_fused_adamw_dropped_when_an_engine_repoints_the_groups():
    """FSDP2 points the optimizer's groups at its sharded parameters after make_optimizer: the fused kernel is kept
    only where it still applies (here: parameters on another device), torch's default elsewhere."""
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    allocate_optimizer_state(opt)
    assert opt.param_groups[0]["fused"] is True
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.1, fused=True)
    opt.param_groups[0]["params"] = [torch.nn.Parameter(torch.zeros(3, device="meta"))]
    allocate_optimizer_state(opt)
    assert opt.param_groups[0]["fused"] is None
