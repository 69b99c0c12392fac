"""The cross-process decode agreement is an argument, not ambient state: the training engine says how the processes
agree that some row is unfinished (Engine.decode_agreement: sharded parameters gathered layer by layer), the run's
in-process rollout backend holds it (make_backend) and hands it to every decoder call it makes, and the decoders
follow it. Dropping it anywhere on the way would let processes run different numbers of all-gathering forwards
(a hang), so each hand-over is checked here."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from vlmrl.config import load_config
from vlmrl.engine.engines import Engine
from vlmrl.models import rollout as rollout_mod
from vlmrl.models.prefix import keep_decoding
from vlmrl.rollout import inprocess
from vlmrl.rollout.backends import make_backend
from vlmrl.rollout.base import SampleRequest

pytestmark = pytest.mark.unit


def agree(local: bool) -> bool:
    return True  # as if another process were still decoding


class FakeDist:
    """The Distributed surface the in-process backend uses; its engine decodes in step under `layers`."""

    world_size = 1

    def __init__(self):
        self.modes = []

    def decode_agreement(self, mode):
        self.modes.append(mode)
        return agree if mode == "layers" else None

    def gathered_for_generation(self, mode):
        return contextlib.nullcontext()

    def call(self, fn, *args, **kwargs):
        return fn("MODEL", *args, **kwargs)


OPTS = SimpleNamespace(autocast=contextlib.nullcontext, shared_prefix=True)


def backend_for(*overrides, tools=None):
    cfg = load_config(None, ["memory.generation_gather=layers", *overrides])
    processor = SimpleNamespace(tokenizer="TOKENIZER")
    return make_backend(cfg, FakeDist(), "MODEL", processor, OPTS, False, tools or {}, 0)


def request():
    return SampleRequest(step=0, rows=[{}], names=["row"], prompts={}, seeds=[7], step_seed=3, prompts_per_call=1)


@pytest.mark.parametrize("engine", ["loop", "continuous"])
def test_the_backend_passes_the_engines_agreement_to_generate(monkeypatch, engine):
    seen = []
    monkeypatch.setattr(inprocess, "generate", lambda *a, **kw: seen.append(kw.get("decode_agreement")) or "COMPLETIONS")
    backend = backend_for(f"rollout.engine={engine}")
    assert backend.decode_agreement is agree
    assert backend.sample(request()) == "COMPLETIONS"
    assert backend.greedy([{}], {}, ["row"]) == "COMPLETIONS"
    assert backend.evaluator("MODEL", OPTS).greedy([{}], {}, ["row"]) == "COMPLETIONS"  # an evaluation's decoder too
    assert seen == [agree, agree, agree]


def test_the_backend_passes_the_agreement_to_tool_rollouts(monkeypatch):
    seen = []
    monkeypatch.setattr(inprocess, "sample_with_tools", lambda *a, **kw: seen.append(a[-1]) or "COMPLETIONS")
    backend = backend_for("tools.tools=[zoom]", "rollout.engine=continuous", tools={"zoom": object()})
    assert backend.sample(request()) == "COMPLETIONS"
    assert seen == [agree]


def test_full_gathering_decodes_alone():
    cfg = load_config(None, ["memory.generation_gather=full"])
    dist = FakeDist()
    backend = make_backend(cfg, dist, "MODEL", SimpleNamespace(tokenizer=None), OPTS, False, {}, 0)
    assert backend.decode_agreement is None and dist.modes == ["full"]


class Sharded(Engine):
    def __init__(self, shards):
        self.collectives = SimpleNamespace(any=agree)
        self.shards = shards

    def _shards_parameters(self):
        return self.shards


def test_only_a_sharded_engine_gathering_layers_decodes_in_step():
    assert Sharded(True).decode_agreement("layers") is agree
    assert Sharded(True).decode_agreement("full") is None
    assert Sharded(False).decode_agreement("layers") is None


class Model(torch.nn.Module):
    generation_config = SimpleNamespace(eos_token_id=2)
    config = SimpleNamespace(model_type="none")

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def generate(self, **kw):
        self.calls.append(("hf", kw["synced_gpus"]))
        return torch.tensor([[5, 2]])


TOK = SimpleNamespace(pad_token_id=0, eos_token_id=2)
BATCH = {"input_ids": torch.tensor([[5]]), "attention_mask": torch.tensor([[1]])}


def test_the_decoders_follow_the_agreement_they_are_given(monkeypatch):
    """keep_decoding asks the agreement; generate hands it to the shared-prefix loop, to HF generate as synced_gpus,
    and keeps the continuous decoder out (its steps depend on this process's rows only)."""
    assert keep_decoding(False, None) is False and keep_decoding(False, agree) is True
    calls = []
    monkeypatch.setattr(rollout_mod, "vision_token_ids", lambda model: [])
    monkeypatch.setattr(rollout_mod, "prefix_supported", lambda model, batch: True)
    monkeypatch.setattr(rollout_mod, "_engine_supported", lambda model: True)
    monkeypatch.setattr(rollout_mod, "sample_continuous", lambda *a, **kw: calls.append(("continuous",)) or (torch.tensor([[2]]), None))
    loop = lambda *a, **kw: calls.append(("loop", kw["decode_agreement"])) or (torch.tensor([[2]]), None)  # noqa: E731
    monkeypatch.setattr(rollout_mod, "sample_with_shared_prefix", loop)
    for agreement in (None, agree):
        for shared_prefix in (True, False):
            kw = dict(num_generations=1, max_new_tokens=2, shared_prefix=shared_prefix, engine="continuous", decode_agreement=agreement)
            rollout_mod.generate(Model(calls), TOK, BATCH, **kw)
    assert calls == [("continuous",), ("hf", None), ("loop", agree), ("hf", True)]
