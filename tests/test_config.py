import dataclasses
import os

import pytest

from vlmrl.config import ConfigError, Config, config_hash, load_config, reference_markdown, replace, save_config


def test_defaults_validate_and_derive():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.generation_batch_size == cfg.training.per_device_train_batch_size * cfg.training.gradient_accumulation_steps
    assert cfg.epsilon_high == cfg.algorithm.epsilon


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  num_generations: 8\ntraining:\n  per_device_train_batch_size: 8\n  max_steps: 3\nbeta: 0.04\n")
    cfg = load_config(path, ["training.max_steps=7", "algorithm.loss_type=dapo"])
    assert cfg.rollout.num_generations == 8
    assert cfg.training.max_steps == 7
    assert cfg.algorithm.beta == 0.04  # TRL-style un-sectioned key
    assert cfg.algorithm.loss_type == "dapo"


def test_frozen():
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.max_steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.num_generation=8", "did you mean 'num_generations'"),
        ("rollut.num_generations=8", "did you mean 'rollout'"),
        ("num_generaions=8", "unknown key"),
        ("training.max_steps=ten", "training.max_steps: expected int"),
        ("training.bf16=1", "training.bf16: expected bool"),
        ("algorithm.loss_type=dapoo", "did you mean 'dapo'"),
        ("algorithm.reward_funcs=accuracy", "algorithm.reward_funcs: expected list[str]"),
        ("max_steps", "expected key=value"),
    ],
)
def test_bad_keys_and_types_name_the_field(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


def test_flat_trl_name_shared_with_sft_means_the_rl_run():
    cfg = load_config(None, ["learning_rate=0.1"])  # optim.learning_rate and sft.learning_rate both exist
    assert cfg.optim.learning_rate == 0.1 and cfg.sft.learning_rate == load_config().sft.learning_rate


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.num_generations=1"], "num_generations=1"),
        (["rollout.num_generations=3"], "not divisible by rollout.num_generations=3"),
        (["rollout.generation_batch_size=6", "rollout.num_generations=2"], "not divisible by per_device_train_batch_size"),
        (["algorithm.epsilon_high=0.1"], "epsilon_high=0.1 must be >= algorithm.epsilon"),
        (["data.min_pixels=1000", "data.max_pixels=100"], "min_pixels=1000 is larger than data.max_pixels=100"),
        (["algorithm.beta=-0.1"], "beta=-0.1 must be >= 0"),
        (["rollout.temperature=0"], "temperature=0.0 must be > 0"),
        (["rollout.top_p=1.5"], "top_p=1.5"),
        (["algorithm.num_iterations=0"], "num_iterations=0"),
        (["algorithm.reward_weights=[1.0]", "algorithm.reward_funcs=[accuracy, iou]"], "reward_weights has 1 entries"),
        (["optim.warmup_ratio=1.0"], "warmup_ratio"),
        (["model.use_lora=true", "model.train_projector_only=true"], "exclude each other"),
        (["training.device=tpu"], "training.device"),
        (["algorithm.reward_funcs=[]"], "reward_funcs is empty"),
    ],
)
def test_cross_field_rules(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("(", r"\(")):
        load_config(None, overrides)


def test_several_problems_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.beta=-1", "rollout.top_k=-1"])
    assert "beta" in str(e.value) and "top_k" in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: invalid YAML"):
        load_config(bad)
    notmap = tmp_path / "list.yaml"
    notmap.write_text("training: 3\n")
    with pytest.raises(ConfigError, match="section 'training' must be a mapping"):
        load_config(notmap)


def test_save_roundtrip_and_hash(tmp_path):
    cfg = load_config(None, ["training.max_steps=5", "algorithm.epsilon_high=0.28"])
    path = save_config(cfg, tmp_path / "out" / "config.yaml")
    again = load_config(path)
    assert again == cfg
    assert config_hash(again) == config_hash(cfg)
    assert config_hash(replace(cfg, training__max_steps=6)) != config_hash(cfg)


def test_replace_revalidates():
    cfg = load_config()
    with pytest.raises(ConfigError):
        replace(cfg, rollout__num_generations=1)


def test_reference_lists_every_field_with_doc():
    text = reference_markdown()
    for name in ["num_generations", "per_device_train_batch_size", "epsilon_high", "max_pixels", "val_before_train"]:
        assert f"`{name}`" in text


def test_config_reference_page_is_current():
    import pathlib
    import re

    page = (pathlib.Path(__file__).parents[1] / "docs" / "config.md").read_text()
    block = re.search(r"<!-- config-reference:start -->\n(.*)<!-- config-reference:end -->", page, re.S).group(1)
    assert block == reference_markdown(), "docs/config.md's config reference is stale: run `make reference`"


def test_shipped_example_configs_load():
    import pathlib

    configs = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = load_config(path)
        assert cfg.generation_batch_size % cfg.rollout.num_generations == 0


def test_readme_demo_figures_come_from_the_result_file():
    """The README's demo figures are rendered from benchmarks/results/demo_cpu.json (a demo run's own output), never typed."""
    import json
    import pathlib
    import re

    from vlmrl.demo import figures_markdown

    root = pathlib.Path(__file__).parents[1]
    result = json.loads((root / "benchmarks/results/demo_cpu.json").read_text())
    readme = (root / "README.md").read_text()
    block = re.search(r"<!-- demo-figures:start -->\n(.*)<!-- demo-figures:end -->", readme, re.S).group(1)
    assert block == figures_markdown(result), "README demo figures are stale: run `make reference`"


def test_trl_names_are_accepted():
    """The names TRL's GRPOConfig / ModelConfig use (and VLM-R1 / ms-swift pass on) map to vlmrl's fields."""
    cfg = load_config(
        None,
        [
            "model_name_or_path=/models/x",
            "use_peft=true",
            "num_train_epochs=2",
            "max_prompt_length=512",
            "steps_per_generation=4",
            "per_device_train_batch_size=2",
            "num_generations=4",
            "log_completions=false",
            "eval_strategy=no",
            "save_strategy=steps",
            "save_steps=7",
        ],
    )
    assert cfg.model.name_or_path == "/models/x" and cfg.model.use_lora
    assert cfg.training.num_train_epochs == 2.0 and cfg.data.max_prompt_length == 512
    assert cfg.generation_batch_size == 8 and cfg.prompts_per_step == 2  # per_device x steps_per_generation
    assert cfg.logging.log_completions == 0 and cfg.training.eval_steps == 0 and cfg.training.save_steps == 7
    assert load_config(None, ["log_completions=true"]).logging.log_completions == load_config().logging.log_completions
    with pytest.raises(ConfigError, match="eval_strategy='epoch'"):
        load_config(None, ["eval_strategy=epoch"])
    with pytest.raises(ConfigError, match="both set the generation batch"):
        load_config(None, ["steps_per_generation=2", "rollout.generation_batch_size=8"])


def test_data_columns_mapping_and_format():
    cfg = load_config(None, ["data.columns.problem=question", "data.columns.solution=answer_text", "data.image_root=[a, b]"])
    assert cfg.data.columns == {"problem": "question", "solution": "answer_text"} and cfg.data.image_root == [
        os.path.abspath("a"),
        os.path.abspath("b"),
    ]  # anchored at load
    with pytest.raises(ConfigError, match="data.columns.problme: vlmrl reads no field 'problme'.*did you mean data.columns.problem"):
        load_config(None, ["data.columns.problme=q"])
    with pytest.raises(ConfigError, match="data.format='sharegpt' is not one of auto, vlmrl, trl"):
        load_config(None, ["data.format=sharegpt"])


def test_epochs_decide_max_steps(tiny_qwen25vl, tmp_path):
    from vlmrl.run.datasets import epochs_as_steps
    from vlmrl.data.tasks import make_count_task

    data = make_count_task(tmp_path / "d", n_train=10, n_test=0, seed=0, image_size=56)
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_qwen25vl}",
            f"data.train_path={data['train']}",
            "num_train_epochs=1.5",
            "per_device_train_batch_size=4",
            "num_generations=2",
            f"training.output_dir={tmp_path / 'o'}",
        ],
    )
    logged = []
    resolved = epochs_as_steps(cfg, logged.append)
    assert resolved.training.max_steps == 8  # ceil(1.5 x 10 rows / 2 prompts per step)
    assert "training.max_steps=8" in logged[0]


@pytest.mark.parametrize(
    "template",
    ["{{ content }} Think step by step.", "{% if x %}a{% endif %}{{ content }}", "Q: {{ content }}: answer in \\boxed{}", "{{content}}"],
)
def test_inline_template_on_the_command_line_is_taken_as_written(template):
    """Issue 35 (small): a Jinja prompt template given inline (EasyR1's format_prompt as text) failed with a raw YAML
    error. A text field takes it as written; the template then renders."""
    cfg = load_config(None, [f"data.prompt_template={template}"])
    assert cfg.data.prompt_template == template


def test_override_yaml_error_is_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["training.max_steps=[1"])
    assert "\n" not in str(e.value) and "training.max_steps" in str(e.value)
