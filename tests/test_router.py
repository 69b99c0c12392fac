"""MoE router load-balancing loss: the pure formula against transformers' and a hand count, and the captured loss
equal on every log-prob path (naive, grouped, shared prefix) of the tiny Qwen3-VL-MoE and Qwen3.5-MoE."""

import pytest
import torch
from test_logprobs import G, LENGTHS, completions, model_cfg, prompt_batch

from vlmrl.algo.losses import load_balancing_loss
from vlmrl.models.loading import load_model
from vlmrl.models.prefix import LogprobOptions, completion_logps_for
from vlmrl.models.processing import load_processor
from vlmrl.models.router import call_weights, capture_routing, find_routing, routed_aux_loss

pytestmark = pytest.mark.unit


def test_load_balancing_loss_by_hand():
    """2 experts, top 1, two tokens routed to expert 0 with probs (0.75, 0.25) and (0.5+, ...):
    f = (1, 0), p = mean probs; loss = 2 * (1 * p0 + 0 * p1)."""
    logits = [torch.tensor([[torch.log(torch.tensor(3.0)), 0.0], [0.1, 0.0]])]
    p0 = (0.75 + torch.sigmoid(torch.tensor(0.1))) / 2
    got = load_balancing_loss(logits, [torch.ones(2)], num_experts=2, top_k=1)
    assert got.item() == pytest.approx(2 * p0.item(), rel=1e-6)
    # A token of weight 0 is not counted; one of weight 2 counts as two.
    only_first = load_balancing_loss(logits, [torch.tensor([1.0, 0.0])], num_experts=2, top_k=1)
    assert only_first.item() == pytest.approx(2 * 0.75, rel=1e-6)
    doubled = load_balancing_loss([logits[0][[0, 0, 1]]], [torch.ones(3)], 2, 1)
    assert load_balancing_loss(logits, [torch.tensor([2.0, 1.0])], 2, 1).item() == pytest.approx(doubled.item(), rel=1e-6)


def test_load_balancing_loss_equals_transformers():
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    layers = tuple(torch.randn(2 * 5, 6, generator=g) for _ in range(3))
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    want = load_balancing_loss_func(layers, 6, 2, mask)
    got = load_balancing_loss(list(layers), [mask.reshape(-1).float()] * 3, 6, 2)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # A balanced router gives top_k (each expert gets 1/E of the probability and top_k/E of the assignments).
    assert load_balancing_loss([torch.zeros(4, 6)], [torch.ones(4)], 6, 2).item() == pytest.approx(2.0, rel=1e-6)


def test_call_weights_prompt_call_and_whole_rows():
    counts = torch.tensor([3, 1])
    prompt_call = call_weights(torch.tensor([[0, 1, 1], [1, 1, 1]]), counts, prompt_width=3, completion_width=4)
    assert prompt_call.tolist() == [[0, 3, 3], [1, 1, 1]]
    whole_rows = call_weights(torch.ones(4, 7, dtype=torch.long), counts, prompt_width=3, completion_width=4)
    assert whole_rows[:, -1].sum() == 0 and whole_rows[:, :-1].sum() == 4 * 6


def test_dense_model_has_no_routing(tiny_qwen3vl):
    assert find_routing(load_model(model_cfg(tiny_qwen3vl))) is None


MOE = ["tiny_qwen3vl_moe", "tiny_qwen35_moe"]
PATHS = {
    "naive": LogprobOptions(shared_prefix=False, group_vision=False),
    "grouped": LogprobOptions(shared_prefix=False, group_vision=True),
    "shared_prefix": LogprobOptions(shared_prefix=True, group_vision=True),
}


@pytest.fixture(scope="module", params=MOE)
def moe(request):
    path = request.getfixturevalue(request.param)
    return load_model(model_cfg(path)).eval(), load_processor(path)


def _aux(model, prompts, rows, ids, mask, opts):
    routing = find_routing(model)
    with capture_routing(routing) as cap:
        completion_logps_for(model, prompts, rows, ids, mask, opts)
    counts = torch.bincount(rows, minlength=prompts["input_ids"].shape[0])
    return routed_aux_loss(cap, counts, prompts["input_ids"].shape[1], ids.shape[1]), cap


@pytest.mark.integration
def test_aux_loss_same_on_every_path_and_equals_transformers(moe):
    """The naive path's value equals transformers' own aux loss (output_router_logits on the full rows, minus
    the last column); the grouped and shared-prefix paths give the same value and the same router gradients."""
    from vlmrl.models.loading import unwrap
    from vlmrl.models.processing import append_tokens, select_rows

    model, processor = moe
    routing = find_routing(model)
    assert routing is not None and routing.num_experts == 4 and routing.top_k == 2
    prompts = prompt_batch(processor, [1, 2], seed=3)
    rows = torch.arange(2).repeat_interleave(G)
    ids, mask = completions(processor, LENGTHS)
    values, grads = {}, {}
    for name, opts in PATHS.items():
        model.zero_grad()
        with torch.enable_grad():
            aux, cap = _aux(model, prompts, rows, ids, mask, opts)
            aux.backward()
        values[name] = aux.item()
        grads[name] = torch.cat([r.weight.grad.reshape(-1) for r in routing.routers])
        if name == "shared_prefix":
            assert len(cap.calls) == 2 and cap.calls[0].mask.shape[0] == 2  # the prompts ran once
    assert values["naive"] > 0
    for name in ("grouped", "shared_prefix"):
        assert values[name] == pytest.approx(values["naive"], rel=1e-5), name
        torch.testing.assert_close(grads[name], grads["naive"], rtol=1e-4, atol=1e-7)

    full = append_tokens(select_rows(prompts, rows), ids, mask)
    full["attention_mask"] = full["attention_mask"].clone()
    full["attention_mask"][:, -1] = 0
    with torch.no_grad():
        out = unwrap(model)(**full, output_router_logits=True)
    assert out.aux_loss.item() == pytest.approx(values["naive"], rel=1e-5)


@pytest.mark.integration
def test_aux_loss_under_gradient_checkpointing(tiny_qwen3vl_moe):
    """Checkpointed layers recompute their routers during backward, outside the capture: same value, same gradients."""
    out = {}
    for checkpointing in (False, True):
        model = load_model(model_cfg(tiny_qwen3vl_moe, gradient_checkpointing=checkpointing)).train()
        processor = load_processor(tiny_qwen3vl_moe)
        prompts = prompt_batch(processor, [1, 2], seed=3)
        rows = torch.arange(2).repeat_interleave(G)
        ids, mask = completions(processor, LENGTHS)
        aux, _ = _aux(model, prompts, rows, ids, mask, LogprobOptions())
        aux.backward()
        out[checkpointing] = aux.item(), torch.cat([r.weight.grad.reshape(-1) for r in find_routing(model).routers])
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-6)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-4, atol=1e-7)
