"""Family registry: `vlmrl tiny`, the families x features matrix behind the README table, fallback logging."""

import json
import logging
import subprocess
import sys
from pathlib import Path


import pytest

from vlmrl.cli import main
from vlmrl.families import log_fallback
from vlmrl.tiny_models.tiny_families import BUILDERS

ROOT = Path(__file__).parents[1]
MATRIX = json.loads((ROOT / "docs" / "families_matrix.json").read_text())


def matrix_tests() -> set[str]:
    return {node for entry in MATRIX["families"].values() for cell in entry["cells"].values() if isinstance(cell, list) for node in cell}


def test_every_yes_in_the_matrix_names_collected_tests():
    files = sorted({node.split("::")[0] for node in matrix_tests()})
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow or not slow", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    collected = set(out.stdout.split())
    missing = sorted(matrix_tests() - collected)
    assert not missing, missing


def test_matrix_is_complete_and_renders():
    sys.path.insert(0, str(ROOT / "scripts"))
    from families_table import render

    features = MATRIX["features"]
    for family, entry in MATRIX["families"].items():
        assert list(entry["cells"]) == features, family
        for cell in entry["cells"].values():
            assert (isinstance(cell, list) and cell) or cell.split(":")[0] in ("no", "fallback"), (family, cell)
        assert family in BUILDERS  # every row is a family `vlmrl tiny` builds
    table = render(MATRIX)
    assert table.count("\n| ") == len(MATRIX["families"])  # one row per family under the header
    assert "| qwen3-vl | yes | yes | yes | yes | yes | yes |" in table


def test_tiny_cli_refuses_unknown_family_and_existing_model(tmp_path, capsys):
    assert main(["tiny", "--family", "qwen9", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "unknown --family 'qwen9'" in err and "qwen3-vl" in err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    assert main(["tiny", "--family", "qwen3-vl", str(tmp_path / "b")]) == 2
    assert "already holds a model" in capsys.readouterr().err
    assert (tmp_path / "b" / "config.json").read_text() == "{}"  # untouched


def test_tiny_cli_builds_a_folder_the_normal_model_path_loads(tmp_path):
    from transformers import AutoConfig

    from vlmrl.models.loading import check_model_folder
    from vlmrl.models.processing import QwenImageProcessor, load_processor

    out = tmp_path / "q3"
    assert main(["tiny", "--family", "qwen3-vl", str(out)]) == 0
    assert check_model_folder(out) == []
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "qwen3_vl" and config.vision_config.patch_size == 16
    assert config.vision_config.deepstack_visual_indexes == [0, 1]
    processor = load_processor(out)
    assert isinstance(processor, QwenImageProcessor) and processor.image_processor.patch_size == 16
    tok = processor.tokenizer
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") < len(tok) == config.text_config.vocab_size


def test_fallback_is_logged_once_with_its_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="vlmrl.families"):
        log_fallback("smolvlm")
        log_fallback("smolvlm")
        log_fallback("some_new_vlm")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "smolvlm" in lines[0] and "image splitting" in lines[0]
    assert "some_new_vlm" in lines[1] and "no fast path is implemented" in lines[1]


def test_unknown_family_takes_the_naive_path_and_says_why(tiny_qwen25vl, monkeypatch, caplog):
    """A model type outside the tested fast families: grouped_family is None (naive path), logged once."""
    from types import SimpleNamespace

    import vlmrl.families as families
    from vlmrl.models.logprobs import grouped_family
    from vlmrl.models.loading import load_model

    monkeypatch.setattr(families, "_logged", set())
    model = load_model(SimpleNamespace(**{**_model_cfg(tiny_qwen25vl)}))
    model.config.model_type = "qwen2_5_vl_variant"
    with caplog.at_level(logging.WARNING, logger="vlmrl.families"):
        assert grouped_family(model) is None
        assert grouped_family(model) is None
    assert [r.getMessage() for r in caplog.records] == [
        "model_type qwen2_5_vl_variant: grouped vision and shared prefix off, naive path (no fast path is implemented for this model type)"
    ]


def _model_cfg(path) -> dict:
    from test_logprobs import model_cfg

    return vars(model_cfg(path))


@pytest.mark.parametrize("side", [224, 448, 500, 1000])
def test_planner_qwen3_vl_image_tokens_follow_the_processor(side):
    """The planner's Qwen3-VL image-token count (patch 16, 2x2 merge) equals what the image processor itself
    produces for a square image at the pixel cap."""
    from PIL import Image

    from vlmrl.plan.planner import image_tokens, model_spec
    from vlmrl.tiny_models.tiny import qwen_image_processor

    processor = qwen_image_processor(min_pixels=32 * 32, max_pixels=side * side, patch_size=16)
    grid = processor(images=[Image.new("RGB", (side, side))], return_tensors="pt")["image_grid_thw"][0]
    expected = int(grid.prod()) // 4
    for preset in ("qwen3-vl-4b", "qwen3-vl-8b"):
        assert image_tokens(model_spec(preset), side * side) == expected


def test_registry_points_at_tiny_builders_and_falls_back_to_generic():
    from vlmrl.families import FAMILIES, GENERIC, family_of

    for fam in FAMILIES:
        for name in fam.tiny:
            assert fam.tiny_builder(name) is BUILDERS[name], (fam.name, name)
        assert all(family_of(t) is fam for t in fam.model_types)
    assert sorted(name for fam in FAMILIES for name in fam.tiny) == sorted(BUILDERS)  # every builder has its family
    assert family_of("some_new_vlm") is GENERIC and family_of(None) is GENERIC
    assert GENERIC.grouped is None and not GENERIC.continuous and not GENERIC.multiturn
