import dataclasses

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
