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
    """Counts the ops that return a fresh tensor of `numel` elements (in-place ops return their input, views and detach
    share its storage: neither allocates)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.fresh = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = [*args, *(kwargs or {}).values()]  # out= included
        inputs = {a.untyped_storage().data_ptr() for a in given if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and t.untyped_storage().data_ptr() not in inputs:
                self.fresh.append(func.__name__)
        return out


def _optim_cfg(weight_decay=0.01):
    from types import SimpleNamespace

    o = SimpleNamespace(
        learning_rate=1e-2,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        weight_decay=weight_decay,
        lr_scheduler_type="constant",
        warmup_ratio=0.0,
    )
    return o


def _fresh_grads(model, seed):
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_make_optimizer_steps_without_parameter_sized_temporaries(monkeypatch, weight_decay):
    """The CPU default AdamW (a loop over parameters) makes sqrt(v) and its division as new tensors the size of each
    parameter: a vocabulary-sized head's step then holds two more copies of it. make_optimizer's InPlaceAdamW makes
    none and ends where the loop does bit for bit (torch's fused CPU kernel, also without temporaries, did not: it moved
    the demo's trajectory). After the first step the scratch is cut to 5 elements: each parameter in several slices."""
    from vlmrl.engine.optim import InPlaceAdamW, make_optimizer

    ours, loop = _model_and_grads(), _model_and_grads()
    opt, _ = make_optimizer(ours, _optim_cfg(weight_decay), 10)
    assert isinstance(opt, InPlaceAdamW)
    reference = torch.optim.AdamW(loop.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    assert reference.defaults["fused"] is None and reference.defaults["foreach"] is None  # torch's CPU default: the loop
    allocate_optimizer_state(opt)  # as training does: the moments exist before the first step
    allocate_optimizer_state(reference)
    biggest = max(p.numel() for p in ours.parameters())
    opt.step()  # the first step makes the reused buffer (the largest parameter's size here); later steps allocate nothing
    reference.step()
    with _NewTensorsOfSize(biggest) as counted:
        opt.step()
    with _NewTensorsOfSize(biggest) as counted_loop:
        reference.step()
    assert counted.fresh == [] and len(counted_loop.fresh) >= 2, (counted.fresh, counted_loop.fresh)
    monkeypatch.setattr(InPlaceAdamW, "SCRATCH_ELEMENTS", 5)
    opt.__dict__.pop("_scratch_buffers")
    for step in range(6):
        _fresh_grads(ours, step)
        _fresh_grads(loop, step)
        opt.step()
        reference.step()
    for a, b in zip(ours.parameters(), loop.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), reference.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fused = _model_and_grads()
    torch_fused = torch.optim.AdamW(fused.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, fused=True)
    for step in range(-1, 6):
        if step >= 0:
            _fresh_grads(fused, step)
        torch_fused.step()
    assert not all(torch.equal(a, b) for a, b in zip(fused.parameters(), loop.parameters()))  # why not the fused kernel


def test_in_place_adamw_leaves_what_it_does_not_cover_to_torch():
    """amsgrad (or a group on another device, DTensor shards, ...) takes torch's own step: same values as torch's AdamW,
    and the step hooks run once per step, not once more inside."""
    from vlmrl.engine.optim import InPlaceAdamW

    ours, theirs = _model_and_grads(), _model_and_grads()
    opt = InPlaceAdamW(ours.parameters(), lr=0.1, amsgrad=True)
    reference = torch.optim.AdamW(theirs.parameters(), lr=0.1, amsgrad=True)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    for step in range(3):
        _fresh_grads(ours, step)
        _fresh_grads(theirs, step)
        opt.step()
        reference.step()
    assert calls == [1, 1, 1]
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    assert "max_exp_avg_sq" in next(iter(opt.state.values()))
