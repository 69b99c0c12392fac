"""Model-aware defaults (model_defaults.py): the embedded tiny model gets its demo-proven values for the fields the
user leaves unset; any other model keeps each field's own default; what the user writes always wins."""

import json
import shutil

import pytest
import torch
import yaml

from vlmrl.config import EMBEDDED_MODEL, Config, ConfigError, load_config, save_config, to_dict
from vlmrl.defaults import TINY_DEFAULTS, TINY_MARKER, apply_model_defaults, describe, embedded_reason


def value(cfg, key):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def folder(tmp_path, name="model", marker=None):
    """A model folder as far as the defaults look: config.json only (with or without the marker)."""
    path = tmp_path / name
    path.mkdir()
    data = {"model_type": "qwen2_5_vl"}
    if marker:
        data[TINY_MARKER] = marker
    (path / "config.json").write_text(json.dumps(data))
    return path


def test_embedded_model_gets_every_tiny_default():
    cfg = load_config()
    assert cfg.model.name_or_path == EMBEDDED_MODEL and cfg.model.defaults == "tiny"
    assert {key: value(cfg, key) for key in TINY_DEFAULTS} == TINY_DEFAULTS
    assert cfg.optim.learning_rate == 3e-4 and cfg.sft.learning_rate == 1e-3 and cfg.rollout.max_completion_length == 8
    assert cfg.generation_batch_size == 64 and cfg.prompts_per_step == 8  # 8 prompts x G=8, as in the demo
    # Not in the profile: still the field defaults.
    assert cfg.rollout.temperature == Config().rollout.temperature and cfg.algorithm.beta == Config().algorithm.beta


def test_what_the_user_writes_wins(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("sft:\n  steps: 3\nrollout:\n  max_completion_length: 12\n")
    cfg = load_config(yaml_file, ["optim.learning_rate=1e-5", "sft.batch_size=4"])
    assert cfg.model.defaults == "tiny"
    assert (cfg.sft.steps, cfg.rollout.max_completion_length, cfg.optim.learning_rate, cfg.sft.batch_size) == (3, 12, 1e-5, 4)
    assert cfg.sft.learning_rate == 1e-3 and cfg.rollout.num_generations == 8  # the rest: tiny
    # TRL's un-sectioned name counts as set too.
    assert load_config(None, ["learning_rate=2e-4"]).optim.learning_rate == 2e-4
    # A value equal to the field default is still the user's: it is not replaced.
    assert load_config(None, ["rollout.max_completion_length=32"]).rollout.max_completion_length == 32


def test_a_real_model_keeps_the_field_defaults(tmp_path):
    defaults = to_dict(Config())
    plain = folder(tmp_path)
    cfg = load_config(None, [f"model.name_or_path={plain}"])
    assert cfg.model.defaults == "pretrained"
    tree = to_dict(cfg)
    for key in TINY_DEFAULTS:
        section, name = key.split(".")
        assert tree[section][name] == defaults[section][name], key
    assert cfg.optim.learning_rate == 1e-6 and cfg.sft.learning_rate == 2e-5


def test_recognised_by_the_marker_never_by_the_path_name(tmp_path):
    named_like_it = folder(tmp_path, "tiny-qwen2.5-vl-v2")  # the embedded model's folder name, but no marker
    assert load_config(None, [f"model.name_or_path={named_like_it}"]).model.defaults == "pretrained"
    trained = folder(tmp_path, "final", marker="tiny-qwen2.5-vl-v2")  # e.g. outputs/sft/final of the embedded model
    cfg = load_config(None, [f"model.name_or_path={trained}"])
    assert cfg.model.defaults == "tiny" and cfg.optim.learning_rate == 3e-4
    assert TINY_MARKER in embedded_reason(str(trained))
    assert embedded_reason(str(tmp_path / "missing")) is None and embedded_reason(None) is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert embedded_reason(str(broken)) is None  # the model check reports it later; the defaults just stay pretrained


def test_the_choice_can_be_forced_both_ways(tmp_path):
    forced_off = load_config(None, ["model.defaults=pretrained"])
    assert forced_off.optim.learning_rate == 1e-6 and forced_off.rollout.max_completion_length == 32
    forced_on = load_config(None, [f"model.name_or_path={folder(tmp_path)}", "model.defaults=tiny"])
    assert forced_on.optim.learning_rate == 3e-4
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        load_config(None, ["model.defaults=tiyn"])


def test_apply_model_defaults_reports_what_it_filled():
    tree = {"optim": {"learning_rate": 1e-5}}
    filled = apply_model_defaults(tree)
    assert tree["model"]["defaults"] == "tiny" and "optim.learning_rate" not in filled
    assert set(filled) == set(TINY_DEFAULTS) - {"optim.learning_rate"}
    tree = {"model": {"name_or_path": "/nowhere"}}
    assert apply_model_defaults(tree) == [] and tree["model"]["defaults"] == "pretrained"


def test_saved_config_records_the_choice_and_reloads_equal(tmp_path):
    cfg = load_config(None, ["optim.learning_rate=1e-4"])
    path = save_config(cfg, tmp_path / "config.yaml")
    text = path.read_text()
    assert text.startswith("# model.defaults: tiny") and "sft.learning_rate=0.001" in text.splitlines()[1]
    assert "optim.learning_rate" not in text.splitlines()[1]  # the user's own value is not listed as a tiny default
    assert yaml.safe_load(text)["model"]["defaults"] == "tiny"
    assert load_config(path) == cfg
    plain = save_config(load_config(None, ["model.defaults=pretrained"]), tmp_path / "p.yaml").read_text()
    assert not plain.startswith("#") and yaml.safe_load(plain)["model"]["defaults"] == "pretrained"


def test_a_validation_error_names_the_fields_the_profile_filled():
    # 64 completions per step (32 x 2, from the profile) are not divisible by G=3: the user never wrote 32 or 2.
    filled = r"[\s\S]*model.defaults=tiny filled .*per_device_train_batch_size"
    with pytest.raises(ConfigError, match=r"not divisible by rollout.num_generations=3" + filled):
        load_config(None, ["rollout.num_generations=3"])


def test_describe_says_which_and_why(tmp_path):
    line = describe(load_config(None, ["optim.learning_rate=1e-5"]))
    assert line.startswith(f"model defaults: tiny (model.name_or_path is {EMBEDDED_MODEL})") and "sft.learning_rate=0.001" in line
    assert "optim.learning_rate" not in line
    plain = folder(tmp_path)
    line = describe(load_config(None, [f"model.name_or_path={plain}"]))
    assert line.startswith(f"model defaults: pretrained ({plain} is not the embedded tiny model)") and "optim.learning_rate=1e-06" in line


def test_the_marker_survives_training(tiny_qwen25vl, tmp_path):
    """A model trained from the embedded one (SFT's final/) carries the marker, so GRPO from it gets the same defaults."""
    from vlmrl.models.loading import save_model
    from vlmrl.models.policy import load_policy
    from vlmrl.tiny_models.tiny import mark_embedded

    start = shutil.copytree(tiny_qwen25vl, tmp_path / "embedded")
    mark_embedded(start)
    cfg = load_config(None, [f"model.name_or_path={start}", "training.device=cpu"])
    assert cfg.model.defaults == "tiny"
    model, processor = load_policy(cfg, torch.device("cpu"))
    save_model(model, processor, tmp_path / "final")
    assert json.loads((tmp_path / "final" / "config.json").read_text())[TINY_MARKER] == "tiny-qwen2.5-vl-v2"
    assert load_config(None, [f"model.name_or_path={tmp_path / 'final'}"]).model.defaults == "tiny"
