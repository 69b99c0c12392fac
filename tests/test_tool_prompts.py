"""What the model is told in a tool run's prompts (issue 35, findings 11 and 13): the tools' schemas reach every chat
template that reads `tools` (as TRL and verl pass them), `vlmrl check` says when a template ignores them, and the
preflight's text / image token split counts an image's tokens on the image side.
"""

import shutil

import pytest
import torch

from vlmrl.tiny_models.tiny import QWEN_CHAT_TEMPLATE

pytestmark = pytest.mark.integration

# What a tool-aware template does (Qwen2.5 / Qwen3 / Qwen3-VL's own print each schema as JSON in a system turn).
TOOLS_BLOCK = "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"


def _cfg(model, tmp_path, *extra):
    from vlmrl.config import load_config
    from vlmrl.data.tasks import make_count_task

    data = make_count_task(tmp_path / "count", n_train=2, n_test=0, seed=0, image_size=56)
    return load_config(
        None,
        [
            f"model.name_or_path={model}",
            f"data.train_path={data['train']}",
            "data.eval_path=",
            f"training.output_dir={tmp_path / 'run'}",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            "rollout.engine=continuous",
            *extra,
        ],
    )


def _tool_aware_copy(tiny, tmp_path):
    folder = shutil.copytree(tiny, tmp_path / "tool-aware")
    (folder / "chat_template.jinja").write_text(TOOLS_BLOCK + QWEN_CHAT_TEMPLATE)
    return folder


def _check_lines(cfg) -> list[str]:
    from vlmrl.run.preflight import preflight

    lines = []
    preflight(cfg, "check", log=lines.append)
    return [str(x) for x in lines]


def test_training_prompts_carry_the_tool_schemas(tiny_qwen25vl, tmp_path):
    """Finding 11: with tools.tools=[zoom], the prompts the run encodes (run.datasets.encode_rows: training and
    evaluation) hold zoom's schema as the template renders it; the preflight's count is the encoded prompt's length."""
    from vlmrl.models.processing import load_processor
    from vlmrl.run.datasets import encode_rows, load_datasets
    from vlmrl.run.prompt_budget import PromptCounter

    model = _tool_aware_copy(tiny_qwen25vl, tmp_path)
    cfg = _cfg(model, tmp_path, "tools.tools=[zoom]")
    processor = load_processor(str(model), min_pixels=3136, max_pixels=3136)
    rows = load_datasets(cfg, need_train=True, keep_for_run=False).train[:1]
    batch = encode_rows(processor, rows, cfg, torch.device("cpu"))
    text = processor.tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert "# Tools" in text and '"name": "zoom"' in text and '"bbox_2d"' in text, text
    n_all, _, _ = PromptCounter(processor, cfg).row(rows[0], None)
    assert n_all == int(batch["attention_mask"].sum())


def test_check_says_whether_the_template_shows_the_tools(tiny_qwen25vl, tmp_path):
    """Finding 11: `vlmrl check` renders the prompt with and without the schemas: the tiny Qwen2.5-VL template
    (as Qwen2.5-VL's own) ignores them, which check says; a tool-aware template shows them, which check says too."""
    ignored = _check_lines(_cfg(tiny_qwen25vl, tmp_path / "a", "tools.tools=[zoom]"))
    assert any("ignores the tools' schemas" in line and "zoom" in line for line in ignored), ignored
    shown = _check_lines(_cfg(_tool_aware_copy(tiny_qwen25vl, tmp_path), tmp_path / "b", "tools.tools=[zoom]"))
    assert any("describes zoom to the model" in line for line in shown), shown
    assert not any(line.startswith("tools:") for line in _check_lines(_cfg(tiny_qwen25vl, tmp_path / "c"))), "single-turn runs say nothing"


def test_preflight_splits_text_and_image_tokens_as_the_processor_does(tiny_qwen25vl, tmp_path):
    """Finding 13: a 56x56 image is 4 <|image_pad|> tokens for the tiny Qwen2.5-VL; check's line on the longest
    prompt says 4 image tokens and the rest text, counted on the processor's own encoding of the prompt."""
    from vlmrl.models.processing import load_processor
    from vlmrl.run.datasets import encode_rows, load_datasets

    cfg = _cfg(tiny_qwen25vl, tmp_path)
    processor = load_processor(str(tiny_qwen25vl), min_pixels=3136, max_pixels=3136)
    rows = load_datasets(cfg, need_train=True, keep_for_run=False).train
    batch = encode_rows(processor, rows, cfg, torch.device("cpu"))
    lengths = batch["attention_mask"].sum(dim=1)
    longest = int(lengths.argmax())
    images = int((batch["input_ids"][longest] == processor.image_token_id).sum())
    assert images == 4
    line = next(line for line in _check_lines(cfg) if "prompts: the longest" in line)
    assert f"({int(lengths[longest]) - images:,} text + {images:,} image tokens" in line, line
