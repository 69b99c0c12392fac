"""Routing replay (algorithm.routing_replay) on the tiny Qwen3-VL-MoE and Qwen3.5-MoE: the experts the rollout's
decode loop chose are recorded and replayed in the log-prob forwards. After a router moved enough to send tokens to
other experts, the replayed forward still gives the rollout's log-probs; without replay it does not. With the router
unmoved, replay changes neither log-probs nor gradients (the experts, attention and, in `experts` mode, the router
keep theirs)."""

import pytest
import torch
from test_logprobs import model_cfg, prompt_batch

from vlmrl.models.loading import load_model
from vlmrl.models.prefix import LogprobOptions, completion_logps_for
from vlmrl.models.processing import load_processor
from vlmrl.models.rollout import generate
from vlmrl.models.router import capture_routing, find_routing, record_routing, replay_routing

pytestmark = pytest.mark.integration
G = 3
PATHS = {"shared_prefix": LogprobOptions(), "grouped": LogprobOptions(shared_prefix=False)}


@pytest.fixture(scope="module", params=["tiny_qwen3vl_moe", "tiny_qwen35_moe"])
def rolled(request):
    """A tiny MoE model, its prompts, and a rollout of G completions each with its recorded routes."""
    path = request.getfixturevalue(request.param)
    model, processor = load_model(model_cfg(path)).eval(), load_processor(path)
    prompts = prompt_batch(processor, [1, 2], seed=3)
    routing = find_routing(model)
    with record_routing(routing, keep_weights=True) as recorder:
        comp = generate(model, processor.tokenizer, prompts, num_generations=G, max_new_tokens=6, prompts_per_call=1, prompt_seeds=[5, 6])
    routes = recorder.routes(G)
    return model, prompts, comp, routes


def _logps(model, prompts, comp, routes=None, mode="experts", opts=PATHS["shared_prefix"], grad=False):
    rows = torch.arange(prompts["input_ids"].shape[0]).repeat_interleave(G)
    width = comp.ids.shape[1]
    mine = None if routes is None else routes.for_rows(list(range(prompts["input_ids"].shape[0])), list(range(len(rows))), width)
    with torch.set_grad_enabled(grad), replay_routing(find_routing(model), mine, rows, mode):
        logps = completion_logps_for(model, prompts, rows, comp.ids, comp.mask, opts)
        if grad:
            model.zero_grad()
            (logps * comp.mask).sum().backward()
    return logps.detach()


def _gap(logps, comp) -> float:
    return float(((logps - comp.sampling_logps).abs() * comp.mask).max())


def test_routes_recorded_for_every_decoded_token(rolled):
    model, prompts, comp, routes = rolled
    routing = find_routing(model)
    n, t = comp.ids.shape
    assert routes.prompt.shape == (2, prompts["input_ids"].shape[1], len(routing.routers), routing.top_k)
    assert routes.completion.shape[:2] == (n, t - 1)  # the last token is sampled, never run
    assert int(routes.completion.min()) >= 0 and int(routes.completion.max()) < routing.num_experts
    torch.testing.assert_close(routes.completion_weights.sum(-1), torch.ones(routes.completion.shape[:-1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_replay_keeps_the_rollouts_logps_when_routing_flips(rolled, path):
    model, prompts, comp, routes = rolled
    opts = PATHS[path]
    before = _logps(model, prompts, comp, opts=opts)
    assert _gap(before, comp) < 1e-4  # in-process sampler and scorer agree to rounding
    routing = find_routing(model)
    saved = [r.weight.detach().clone() for r in routing.routers]
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for r in routing.routers:
                r.weight.add_(torch.randn(r.weight.shape, generator=g) * r.weight.std() * 0.5)
        rows = torch.arange(2).repeat_interleave(G)
        with capture_routing(routing) as cap:
            plain = _logps(model, prompts, comp, opts=LogprobOptions())
        moved = torch.stack([c.topk(routing.top_k, dim=-1).indices.sort(-1).values for c in cap.calls[1].logits], dim=1)
        want = routes.completion.long().sort(-1).values
        flipped = (moved.reshape(want.shape) != want).any(-1)  # [N, T-1, L]: a token sent to another expert
        assert int(flipped.sum()) > 0
        assert rows.numel() == comp.ids.shape[0]
        exact = _logps(model, prompts, comp, routes, "experts_and_weights", opts=opts)
        experts = _logps(model, prompts, comp, routes, "experts", opts=opts)
    finally:
        with torch.no_grad():
            for r, w in zip(routing.routers, saved):
                r.weight.copy_(w)
    assert _gap(exact, comp) < 1e-4  # the router's move does not reach the log-probs
    torch.testing.assert_close(exact, before, rtol=0, atol=1e-5)
    assert _gap(plain, comp) > 1e-3  # without replay the flipped tokens change them
    assert _gap(experts, comp) < _gap(plain, comp)  # same experts, the moved router's weights


@pytest.mark.parametrize("mode", ["experts", "experts_and_weights"])
def test_replay_with_an_unmoved_router_changes_no_value_or_gradient(rolled, mode):
    model, prompts, comp, routes = rolled
    routing = find_routing(model)
    # The reference: no replay; for experts_and_weights the gate weights as constants (detached by a plain hook), the
    # function whose gradient the replayed weights give.
    handles = []
    if mode == "experts_and_weights":
        handles = [r.register_forward_hook(lambda m, a, out: (out[0], out[1].detach(), out[2])) for r in routing.routers]
    try:
        plain = _logps(model, prompts, comp, grad=True)
    finally:
        for h in handles:
            h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    replayed = _logps(model, prompts, comp, routes, mode, grad=True)
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-6)
    router_names = {n for n, p in model.named_parameters() if any(p is r.weight for r in routing.routers)}
    assert router_names
    for name, p in model.named_parameters():
        if name not in grads:
            continue
        if mode == "experts_and_weights" and name in router_names:
            assert p.grad is None or not p.grad.any(), name  # the recorded weights carry no gradient to the router
        else:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    if mode == "experts":
        assert any(grads[n].abs().sum() > 0 for n in router_names)


def test_a_call_the_routes_do_not_cover_is_refused(rolled):
    model, prompts, comp, routes = rolled
    one = routes.for_rows([0], [0], comp.ids.shape[1])
    with pytest.raises(ValueError, match="matches no recorded tokens"):
        with replay_routing(find_routing(model), one, torch.zeros(1, dtype=torch.long)):
            completion_logps_for(model, prompts, torch.arange(2).repeat_interleave(G), comp.ids, comp.mask, LogprobOptions())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_replays_in_scoring_and_update(tiny_qwen3vl_moe, tmp_path, monkeypatch, checkpointing):
    """A GRPO run with routing replay: a rollout of two optimizer steps is scored (old log-probs) and updated with the
    rollout's experts replayed in every policy forward (under gradient checkpointing too: the replay spans backward,
    where checkpointed layers route again); the sampler and the scorer agree to rounding."""
    import json

    import vlmrl.train as train_module
    from test_integration import grpo_cfg
    from vlmrl.data.tasks import make_count_task

    entered = []

    class counting(replay_routing):  # noqa: N801
        def __enter__(self):
            entered.append(self.routes is not None)
            return super().__enter__()

    monkeypatch.setattr(train_module, "replay_routing", counting)
    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    extra = ["algorithm.routing_replay=experts", "training.max_steps=2", f"model.gradient_checkpointing={str(checkpointing).lower()}"]
    train_module.train(grpo_cfg(tiny_qwen3vl_moe, data, tmp_path / "run", *extra))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "mismatch/kl" in m]
    assert len(steps) == 2 and all(m["mismatch/max_abs_logp_diff"] < 1e-4 for m in steps)
    # Per rollout: one scoring forward and two optimizer steps' update forwards, each over 4-row micro-batches.
    assert entered and all(entered) and len(entered) >= 2 * 3


def test_replay_refused_where_it_cannot_record(tiny_qwen25vl, tmp_path):
    from test_integration import grpo_cfg

    from vlmrl.config import ConfigError
    from vlmrl.data.tasks import make_count_task
    from vlmrl.train import train

    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    with pytest.raises(ConfigError, match="routing_replay=experts but the model has no MoE router"):
        train(grpo_cfg(tiny_qwen25vl, data, tmp_path / "run", "algorithm.routing_replay=experts"))
    with pytest.raises(ConfigError, match="routing_replay=experts records expert choices in the shared-prefix decode loop"):
        grpo_cfg(tiny_qwen25vl, data, tmp_path / "run2", "algorithm.routing_replay=experts", "rollout.engine=continuous")


def test_replay_under_gradient_checkpointing_spans_backward(tiny_qwen3vl_moe):
    """Checkpointed layers run their routers again in backward: with a moved router, the replayed gradients under
    gradient checkpointing equal those without it (the replay is still in force when the layers recompute)."""
    processor = load_processor(tiny_qwen3vl_moe)
    prompts = prompt_batch(processor, [1, 2], seed=3)
    grads = {}
    for checkpointing in (False, True):
        model = load_model(model_cfg(tiny_qwen3vl_moe, gradient_checkpointing=checkpointing))
        routing = find_routing(model)
        with record_routing(routing, keep_weights=True) as recorder:
            comp = generate(model.eval(), processor.tokenizer, prompts, num_generations=G, max_new_tokens=6, prompt_seeds=[5, 6])
        routes = recorder.routes(G)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for r in routing.routers:
                r.weight.add_(torch.randn(r.weight.shape, generator=g) * r.weight.std() * 0.5)
        model.train()
        _logps(model, prompts, comp, routes, "experts", opts=PATHS["grouped"], grad=True)
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys()
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
