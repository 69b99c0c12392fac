"""End to end on tiny real architectures: GRPO steps, num_iterations, LoRA reference, SFT stages, save/reload."""

import copy
import json

import pathlib

import pytest
from family_fixtures import ALL_FAMILY_FIXTURES
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from vlmrl.config import load_config
from vlmrl.sft import sft
from vlmrl.data.tasks import make_count_task
from vlmrl.train import train


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=32, n_test=8, seed=0, image_size=56)


LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"


def grpo_cfg(model_path, data, out, *extra):
    return load_config(
        None,
        [
            f"model.name_or_path={model_path}",
            f"data.train_path={data['train']}",
            f"data.eval_path={data['test']}",
            f"training.output_dir={out}",
            "training.max_steps=2",
            "rollout.num_generations=4",
            "training.per_device_train_batch_size=4",
            "rollout.generation_batch_size=8",
            "training.gradient_accumulation_steps=1",
            "rollout.max_completion_length=6",
            "optim.learning_rate=1e-3",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            f"algorithm.reward_funcs=[accuracy, '{LENGTH_REWARD}']",
            *extra,
        ],
    )


def weights(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", ALL_FAMILY_FIXTURES)
def test_two_grpo_steps_change_weights_and_reload(family, request, count_data, tmp_path):
    model_path = request.getfixturevalue(family)
    out = tmp_path / "run"
    train(grpo_cfg(model_path, count_data, out))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    before, after = weights(model_path), weights(out / "final")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no weight changed"
    # The final folder is a plain HF model: transformers loads it without vlmrl and generates.
    model = AutoModelForImageTextToText.from_pretrained(out / "final")
    ids = torch.tensor([[1, 2, 3]])
    assert model.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape[1] >= 3


def test_num_iterations_reuses_old_logps(tiny_qwen25vl, count_data, tmp_path):
    out1 = tmp_path / "mu1"
    # One optimizer step per rollout (8 rows = 4 x 2 accumulation): on-policy, the ratio is exactly 1. (Without the
    # accumulation the rollout feeds two optimizer steps and the second one's ratio is rightly not 1: test_offpolicy.py.)
    train(grpo_cfg(tiny_qwen25vl, count_data, out1, "training.max_steps=1", "training.gradient_accumulation_steps=2"))
    (m1,) = read_metrics(out1)
    assert m1["ratio_dev/iter1"] == 0.0
    out2 = tmp_path / "mu2"
    # One optimizer step per pass (8 rows = 4 x 2 accumulation), so pass 1 sees the rollout policy.
    train(grpo_cfg(tiny_qwen25vl, count_data, out2, "training.max_steps=1", "algorithm.num_iterations=2", "training.gradient_accumulation_steps=2"))
    (m2,) = read_metrics(out2)
    assert m2["ratio_dev/iter1"] < 1e-5  # stored old log-probs == first-pass log-probs
    assert m2["ratio_dev/iter2"] > 1e-4  # second pass: the policy moved, the ratio is not 1


def test_beta_with_lora_uses_no_model_copy(tiny_qwen25vl, count_data, tmp_path, monkeypatch):
    real_deepcopy = copy.deepcopy

    def no_model_copy(obj, *a, **k):
        if isinstance(obj, torch.nn.Module):
            raise AssertionError("a model copy was made")
        return real_deepcopy(obj, *a, **k)

    monkeypatch.setattr(copy, "deepcopy", no_model_copy)
    out = tmp_path / "lora"
    train(
        grpo_cfg(
            tiny_qwen25vl,
            count_data,
            out,
            "model.use_lora=true",
            "algorithm.beta=0.1",
            "model.lora_r=4",
            "optim.learning_rate=1e-2",
            "training.save_final_model=false",
            "training.gradient_accumulation_steps=2",
        )
    )
    rows = read_metrics(out)
    assert rows[0]["kl"] < 1e-6  # step 1 is one optimizer step: LoRA B starts at zero, policy == reference
    assert rows[-1]["kl"] > 0  # after updates the adapter moved away from the (adapter-disabled) reference


# Name part that every projector weight of a family has in the saved safetensors (Qwen-VL: merger and DeepStack mergers).
PROJECTOR_KEY = {
    "tiny_qwen25vl": "merger",
    "tiny_qwen3vl": "merger",
    "tiny_gemma3": "multi_modal_projector",
    "tiny_qwen3vl_moe": "merger",
    "tiny_qwen35": "merger",
    "tiny_qwen35_moe": "merger",
    "tiny_llava_onevision": "multi_modal_projector",
    "tiny_internvl": "multi_modal_projector",
    "tiny_llava": "multi_modal_projector",
}


@pytest.mark.parametrize("family", ["tiny_qwen25vl", "tiny_qwen3vl", "tiny_gemma3", "tiny_llava"])
def test_sft_projector_stage_changes_only_projector(family, request, count_data, tmp_path):
    model_path = request.getfixturevalue(family)
    out = tmp_path / "sft"
    cfg = load_config(
        None,
        [
            f"model.name_or_path={model_path}",
            f"data.train_path={count_data['train']}",
            "data.eval_path=",
            f"training.output_dir={out}",
            "sft.projector_steps=2",
            "sft.steps=0",
            "sft.batch_size=4",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
        ],
    )
    sft(cfg)
    before, after = weights(model_path), weights(out / "final")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(PROJECTOR_KEY[family] in k for k in changed), sorted(changed)[:5]
    assert (out / "report.png").stat().st_size > 10_000  # SFT runs draw the same report as GRPO runs


@pytest.mark.parametrize(
    "family", ["tiny_qwen3vl", "tiny_gemma3", "tiny_qwen3vl_moe", "tiny_qwen35", "tiny_qwen35_moe", "tiny_llava_onevision", "tiny_internvl"]
)
def test_cli_sft_both_stages_then_eval(family, request, count_data, tmp_path):
    """`vlmrl sft` stage 1 (projector) then stage 2 (language model), then `vlmrl eval` on its final folder."""
    from vlmrl.cli import main

    model_path = request.getfixturevalue(family)
    out = tmp_path / "sft"
    common = [f"data.eval_path={count_data['test']}", "logging.progress_bar=false", "logging.tensorboard=false", "logging.report=false"]
    common += ["data.min_pixels=3136", "data.max_pixels=3136"]
    args = [f"model.name_or_path={model_path}", f"data.train_path={count_data['train']}", f"training.output_dir={out}", *common]
    assert main(["sft", *args, "sft.projector_steps=1", "sft.steps=1", "sft.batch_size=4", "sft.learning_rate=1e-3"]) == 0
    before, after = weights(model_path), weights(out / "final")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(PROJECTOR_KEY[family] in k for k in changed)  # stage 1
    assert any("layers" in k and "self_attn" in k and "vision" not in k and "visual" not in k for k in changed)  # stage 2
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(("router/aux_loss" in m) == ("moe" in family) for m in logged if "loss" in m)  # MoE: the router loss
    ev = tmp_path / "eval"
    assert main(["eval", f"model.name_or_path={out / 'final'}", f"training.output_dir={ev}", "algorithm.reward_funcs=[accuracy]", *common]) == 0
    result = json.loads((ev / "eval.json").read_text())
    assert 0.0 <= result["eval/accuracy"] <= 1.0 and result["eval/num_samples"] == 8


@pytest.mark.parametrize("family", ["tiny_qwen25vl", "tiny_llava", "tiny_qwen3vl", "tiny_gemma3"])
def test_rollout_never_samples_vision_placeholders(family, request, count_data):
    """A sampled <|image_pad|> would make scoring fail ('image features and image tokens do not match')."""
    from vlmrl.models.rollout import generate, vision_token_ids
    from vlmrl.run.datasets import encode_rows
    from vlmrl.models.policy import load_policy
    from vlmrl.data.rows import load_dataset_split

    cfg = grpo_cfg(request.getfixturevalue(family), count_data, "unused")
    model, processor = load_policy(cfg, torch.device("cpu"))
    banned = vision_token_ids(model)
    assert banned
    with torch.no_grad():  # make the placeholders the most likely tokens, then check they are never sampled
        head = model.get_output_embeddings()
        if head.bias is not None:
            head.bias[banned] += 100
        else:
            head.weight[banned] *= 0
            head.weight[banned] += head.weight.abs().max() * 50 * torch.sign(torch.randn(1))
    rows, _ = load_dataset_split(count_data["train"], limit_images=1, skip_bad_rows=False)
    prompts = encode_rows(processor, rows[:2], cfg, torch.device("cpu"))
    comp = generate(model, processor.tokenizer, prompts, num_generations=4, max_new_tokens=8)
    assert not torch.isin(comp.ids, torch.tensor(banned)).any()


def test_bf16_autocast_checkpointing_and_bf16_weights(tiny_qwen25vl, count_data, tmp_path):
    out = tmp_path / "bf16"
    train(
        grpo_cfg(
            tiny_qwen25vl,
            count_data,
            out,
            "training.max_steps=1",
            "training.bf16=true",
            "model.gradient_checkpointing=true",
            "model.dtype=bfloat16",
            "data.eval_path=",
        )
    )
    (row,) = read_metrics(out)
    assert torch.isfinite(torch.tensor(row["loss"]))
    assert next(iter(weights(out / "final").values())).dtype == torch.bfloat16


def test_ground_task_with_iou_reward_and_eval_cli(tiny_qwen2vl, tmp_path, capsys):
    from vlmrl.cli import main

    out = tmp_path / "ground"
    args = [
        f"model.name_or_path={tiny_qwen2vl}",
        "data.task=ground",
        "data.task_train_size=8",
        "data.task_test_size=4",
        f"training.output_dir={out}",
        "training.max_steps=1",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=4",
        "rollout.max_completion_length=6",
        "algorithm.reward_funcs=[iou, format]",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    assert main(["train", *args]) == 0
    assert (out / "report.png").stat().st_size > 0 and (out / "samples.jsonl").exists()
    assert (out / "config.yaml").read_text().count("task: ground") == 1
    assert main(["eval", *args, f"model.name_or_path={out / 'final'}"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert 0.0 <= result["eval/iou"] <= 1.0 and result["eval/num_samples"] == 4


def test_cli_errors_are_readable(tmp_path, capsys):
    from vlmrl.cli import main

    assert main(["train", "rollout.num_generation=4"]) == 2
    assert "did you mean 'num_generations'" in capsys.readouterr().err
    assert main(["train", f"model.name_or_path={tmp_path / 'missing'}", f"training.output_dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "missing") in err


@pytest.mark.parametrize("command", ["train", "sft", "eval", "demo", "config", "tiny"])
def test_every_command_has_help(command, capsys):
    from vlmrl.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: vlmrl" in capsys.readouterr().out


def test_demo_quick_runs_end_to_end(tmp_path, monkeypatch):
    """`vlmrl demo --quick`: builds the embedded model, SFT, GRPO, evaluation, report (a few steps each)."""
    from vlmrl.demo import run_demo

    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    result = run_demo(str(tmp_path / "demo"), quick=True)
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0
    assert (tmp_path / "demo" / "grpo" / "report.png").exists()
    assert (tmp_path / "demo" / "grpo" / "final" / "model.safetensors").exists()


def test_grpo_with_lora_on_moe_experts_trains_them(tiny_qwen3vl_moe, count_data, tmp_path):
    """`vlmrl train` with model.lora_target_parameters (beta > 0: the reference is the adapter-disabled model):
    the saved adapter holds expert LoRA weights that moved, and the merged final folder differs in the experts."""
    out = tmp_path / "run"
    experts = "model.lora_target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"
    train(grpo_cfg(tiny_qwen3vl_moe, count_data, out, "model.use_lora=true", "algorithm.beta=0.05", "optim.learning_rate=1e-2", experts))
    adapter = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    expert_b = {k: v for k, v in adapter.items() if "experts" in k and "lora_B" in k}
    assert expert_b and all(v.abs().sum() > 0 for v in expert_b.values())  # B starts at zero: these were trained
    before, after = weights(tiny_qwen3vl_moe), weights(out / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before if "experts" in k)


def test_router_aux_loss_logged_and_trains_only_when_configured(tiny_qwen3vl_moe, count_data, tmp_path):
    """With a reward that gives every row the same value (advantages 0, beta 0) the policy loss moves nothing:
    at router_aux_loss_coef=0 the weights stay put while router/aux_loss is logged; at 1.0 the routers move.
    A dense model with a coefficient is refused (ConfigError)."""
    zero = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":constant_zero"
    runs = {}
    for coef in (0.0, 1.0):
        out = tmp_path / f"coef{coef}"
        train(
            grpo_cfg(
                tiny_qwen3vl_moe,
                count_data,
                out,
                f"algorithm.reward_funcs=['{zero}']",
                f"algorithm.router_aux_loss_coef={coef}",
                "optim.learning_rate=1e-2",
                "training.save_final_model=true",
            )
        )
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        aux = [m["router/aux_loss"] for m in lines if "router/aux_loss" in m]
        assert len(aux) == 2 and all(v > 0 for v in aux)
        runs[coef] = weights(out / "final")
    before = weights(tiny_qwen3vl_moe)
    routers = [k for k in before if k.endswith("mlp.gate.weight")]
    assert routers
    assert all(torch.equal(before[k], runs[0.0][k]) for k in before)
    assert all(not torch.equal(before[k], runs[1.0][k]) for k in routers)


def test_router_aux_loss_on_dense_model_refused(tiny_qwen25vl, count_data, tmp_path):
    from vlmrl.config import ConfigError

    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.01 but the model has no MoE router"):
        train(grpo_cfg(tiny_qwen25vl, count_data, tmp_path / "run", "algorithm.router_aux_loss_coef=0.01"))
