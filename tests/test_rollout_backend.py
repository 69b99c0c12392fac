"""rollout.backend: the config fields and peers' names, `vlmrl check`'s line, and the parity checks' pure functions
(the vLLM engine itself is tested in tests/test_vllm.py, in the vLLM venv)."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from vlmrl.config import ConfigError, load_config
from vlmrl.rollout.backends import describe_backend, make_backend
from vlmrl.rollout.parity import RolloutParityError, check_prompts, probe_mismatch, prompt_mismatch

pytestmark = pytest.mark.unit

IMAGE = 7  # the image placeholder id of these hand-made prompts
NO_VLLM = importlib.util.find_spec("vllm") is None
ONE = SimpleNamespace(world_size=1, decode_agreement=lambda mode: None)  # what make_backend reads of the run's Distributed


def test_backend_defaults_to_the_inprocess_engine():
    cfg = load_config(None, [])
    assert (cfg.rollout.backend, cfg.rollout.vllm_mode, cfg.rollout.vllm_gpu_memory_utilization) == ("inprocess", "colocate", 0.3)
    assert make_backend(cfg, ONE, None, None, None, False, {}, 0).name == "inprocess"
    assert "in-process decoder" in describe_backend(cfg)


@pytest.mark.parametrize(
    "overrides, backend, utilization",
    [
        (["use_vllm=true"], "vllm", 0.3),  # TRL's flag
        (["use_vllm=false"], "inprocess", 0.3),
        (["use_vllm=true", "vllm_mode=colocate", "vllm_gpu_memory_utilization=0.5"], "vllm", 0.5),  # TRL's un-sectioned names
        (["rollout.backend=vllm", "rollout.vllm_gpu_memory_utilization=0.2"], "vllm", 0.2),
    ],
)
def test_trl_names_set_the_backend(overrides, backend, utilization):
    cfg = load_config(None, overrides)
    assert (cfg.rollout.backend, cfg.rollout.vllm_gpu_memory_utilization) == (backend, utilization)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["use_vllm=true", "vllm_mode=server", "rollout.vllm_server_port=65535"], "rollout.vllm_server_port below 65535"),
        (["use_vllm=true", "vllm_mode=server", "rollout.vllm_server_timeout=0"], "rollout.vllm_server_timeout must be > 0"),
        (["use_vllm=maybe"], "use_vllm='maybe': expected true or false"),
        (["use_vllm=true", "vllm_gpu_memory_utilization=1.5"], "rollout.vllm_gpu_memory_utilization=1.5"),
        (["use_vllm=true", "vllm_mode=server", "tools.tools=[crop]", "rollout.engine=continuous"], "rollout.vllm_mode=server with tools.tools"),
        (["use_vllm=true", "model.use_lora=true", "model.lora_target_parameters=[mlp.experts.down_proj]"], "unset model.lora_target_parameters"),
    ],
)
def test_what_the_vllm_backend_cannot_do_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_lora_is_accepted_with_the_vllm_backend():
    """LoRA trains with vLLM sampling: the sync pushes the merged weights (rollout/weights.py; tests/test_vllm.py)."""
    cfg = load_config(None, ["use_vllm=true", "use_peft=true"])
    assert (cfg.rollout.backend, cfg.model.use_lora) == ("vllm", True)


def test_server_mode_is_accepted_with_its_address():
    """TRL's names (vllm_mode, vllm_server_host/port/timeout) set the same fields."""
    for prefix in ("", "rollout."):
        cfg = load_config(None, ["use_vllm=true", "vllm_mode=server", f"{prefix}vllm_server_host=10.0.0.2", f"{prefix}vllm_server_port=9000"])
        r = cfg.rollout
        assert (r.backend, r.vllm_mode, r.vllm_server_host, r.vllm_server_port, r.vllm_server_timeout) == ("vllm", "server", "10.0.0.2", 9000, 240.0)
    assert load_config(None, ["vllm_server_timeout=30"]).rollout.vllm_server_timeout == 30.0


def test_server_mode_is_accepted_for_the_inprocess_backend():
    """vllm_mode only matters with the vLLM backend: a TRL config with use_vllm=false keeps its vllm_mode."""
    assert load_config(None, ["use_vllm=false", "vllm_mode=server"]).rollout.backend == "inprocess"


@pytest.mark.skipif(not NO_VLLM, reason="vllm is installed here: the missing-package line cannot show")
def test_check_says_vllm_is_missing_in_one_line():
    cfg = load_config(None, ["rollout.backend=vllm"])
    with pytest.raises(ConfigError, match=r"rollout.backend=vllm: the vllm package is not installed .*make test-vllm"):
        describe_backend(cfg)
    with pytest.raises(ConfigError, match="not installed"):
        make_backend(cfg, ONE, None, None, None, False, {}, 0)


@pytest.mark.skipif(NO_VLLM, reason="vllm is not installed here (make test-vllm)")
def test_check_describes_the_vllm_backend():
    cfg = load_config(None, ["rollout.backend=vllm"])
    assert "vLLM colocated in the training process" in describe_backend(cfg)
    # the GPU-only settings a converted ms-swift / EasyR1 run carries: stored for the planner, said to be not applied
    gpu_only = load_config(None, ["rollout.backend=vllm", "sleep_level=1", "vllm_tensor_parallel_size=2", "training.device=cpu"])
    said = describe_backend(gpu_only)
    assert "vllm_sleep_level=1, vllm_tensor_parallel_size=2 not applied on CPU" in said and "`vlmrl plan` counts them" in said
    assert "vLLM colocated in each of the 2 training processes (DDP or FSDP2)" in describe_backend(cfg, world_size=2)


def test_several_processes_run_vllm_colocated_under_ddp_or_fsdp2(monkeypatch):
    """Several training processes: each with its own colocated engine under DDP or FSDP2 (every process pushes the
    whole model); DeepSpeed and a rollout server shared by several processes are refused in one line naming what to
    change. Decided before any engine is built (vLLM itself is not needed here)."""
    import vlmrl.rollout.backends as backends

    monkeypatch.setattr(backends, "vllm_missing", lambda: None)
    cfg = load_config(None, ["rollout.backend=vllm"])
    for engine in ("ddp", "fsdp2"):
        backends.refuse_vllm(cfg, 2, engine)
    backends.refuse_vllm(cfg, 1, "single")
    with pytest.raises(ConfigError, match="runs under DDP or FSDP2 .* the deepspeed engine's gather for the push is not wired"):
        backends.refuse_vllm(cfg, 2, "deepspeed")
    with pytest.raises(ConfigError, match="runs under DDP or FSDP2"):
        backends.make_backend(cfg, SimpleNamespace(world_size=2, engine=SimpleNamespace(name="deepspeed")), None, None, None, False, {}, 0)
    server = load_config(None, ["rollout.backend=vllm", "rollout.vllm_mode=server"])
    with pytest.raises(ConfigError, match="rollout.vllm_mode=server with 2 training processes"):
        backends.refuse_vllm(server, 2, "ddp")


def test_same_prompt_passes():
    assert prompt_mismatch([1, IMAGE, IMAGE, 2], [1, IMAGE, IMAGE, 2], {"image": IMAGE}) is None


def test_double_expansion_names_the_image_token_counts():
    """A prompt whose image pads were already expanded gets expanded again by the sampler: more image tokens."""
    trainer = [1, 9, IMAGE, IMAGE, IMAGE, IMAGE, 10, 5]
    sampler = [1, 9, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 10, 5]
    assert prompt_mismatch(sampler, trainer, {"image": IMAGE}) == "vLLM's prompt has 7 image tokens, the trainer's processor built 4"


def test_same_counts_other_text_names_the_position():
    problem = prompt_mismatch([1, IMAGE, 3, 4], [1, IMAGE, 3, 8], {"image": IMAGE})
    assert "from position 3" in problem and "vLLM [4]" in problem and "trainer [8]" in problem


def test_check_prompts_names_the_row_and_reads_the_left_padded_batch():
    pad = 0
    batch = {
        "input_ids": torch.tensor([[pad, pad, 1, IMAGE, 2], [1, IMAGE, IMAGE, 3, 2]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
    }
    names = ["step 1, row 12 (train.jsonl:13)", "step 1, row 40 (train.jsonl:41)"]
    check_prompts([[1, IMAGE, 2], [1, IMAGE, IMAGE, 3, 2]], batch, {"image": IMAGE}, names)  # padding is not a difference
    with pytest.raises(RolloutParityError) as e:
        check_prompts([[1, IMAGE, 2], [1, IMAGE, IMAGE, IMAGE, IMAGE, 3, 2]], batch, {"image": IMAGE}, names)
    assert str(e.value).startswith("step 1, row 40 (train.jsonl:41): vLLM's prompt has 4 image tokens, the trainer's processor built 2")
    assert "\n" not in str(e.value)


def test_probe_within_tolerance_passes_and_past_it_fails():
    trainer = torch.tensor([-1.0, -2.0, -0.5])
    assert probe_mismatch(trainer + 5e-7, trainer, 1e-3) is None
    problem = probe_mismatch(trainer + torch.tensor([0.0, 0.3, 0.0]), trainer, 1e-3)
    assert "differ from the trainer's by up to 0.3" in problem and "not sampling with the trained weights" in problem


def test_vllm_sample_streams_of_neighbouring_prompts_never_overlap():
    """vLLM seeds sample i of an n-sample request with seed + i; the trainer's prompt seeds are consecutive
    (prompt_seed: step * 100003 + position). Passed unchanged, prompt p's sample i and prompt p+1's sample i-1 drew
    from one stream (a step of 8 prompts x G 8 sampled from 15 streams). Every seed vLLM derives must be distinct,
    within int64."""
    from vlmrl.engine.collectives import prompt_seed
    from vlmrl.rollout.vllm_backend import sampling_params

    cfg = load_config(None, ["rollout.num_generations=8"])
    for step in (1, 2, 20):
        params = sampling_params(cfg.rollout, [prompt_seed(0, step, p) for p in range(8)], eos=[2])
        streams = [p["seed"] + i for p in params for i in range(p["n"])]
        assert len(set(streams)) == 64 and max(streams) < 2**63
    # the same prompt seed (a redo after an OOM, or a resume) still gives the same seed
    assert sampling_params(cfg.rollout, [5], [2]) == sampling_params(cfg.rollout, [5], [2])


def test_pushed_lora_weights_are_the_merged_model_under_the_base_names():
    """rollout/weights.pushed_weights of a peft LoRA model: exactly the base model's parameter names, each adapted
    weight equal to peft's own merge (merge_and_unload on a copy), the live model left unmerged."""
    import copy

    from peft import LoraConfig, get_peft_model

    from vlmrl.rollout.weights import pushed_weights

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 4)
            self.q_proj = torch.nn.Linear(4, 4)
            self.out = torch.nn.Linear(4, 3, bias=False)

    torch.manual_seed(0)
    base_names = set(Tiny().state_dict())
    model = get_peft_model(Tiny(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "out"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero (no delta): give the adapters one
                p.normal_()
    pushed = dict(pushed_weights(model))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(pushed) == base_names == set(merged)
    for name, value in merged.items():
        assert torch.allclose(pushed[name], value, atol=1e-6), name
    assert not torch.allclose(pushed["q_proj.weight"], model.base_model.model.q_proj.base_layer.weight)  # the delta is in
    assert not any(m.merged for m in model.modules() if hasattr(m, "merged"))
