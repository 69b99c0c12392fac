"""Real-architecture presets: consistent configs, published parameter counts, and the GPU benchmark's CPU smoke run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.plan.presets import PRESETS, count_parameters_meta, preset_config, vision_out_size
from vlmrl.tiny_models.tiny import QWEN_SPECIAL_TOKENS, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]

# Published totals (tied embeddings counted once): Qwen2.5-VL-3B ~3.75B, Qwen2.5-VL-7B ~8.29B,
# Qwen2-VL-2B ~2.21B, Qwen2-VL-7B ~8.29B.
EXPECTED_PARAMS = {"qwen2.5-vl-3b": 3.75e9, "qwen2.5-vl-7b": 8.29e9, "qwen2-vl-2b": 2.21e9, "qwen2-vl-7b": 8.29e9}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(family="qwen")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_config_is_consistent(name, tokenizer):
    cfg = preset_config(name, tokenizer)
    text = cfg.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert text.hidden_size % text.num_attention_heads == 0
    assert text.num_attention_heads % text.num_key_value_heads == 0
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2 == 64
    # The merger projects into the language model's width.
    assert vision_out_size(name) == text.hidden_size
    v = cfg.vision_config
    merged_out = getattr(v, "out_hidden_size", None) if name.startswith("qwen2.5") else v.hidden_size
    assert merged_out == text.hidden_size
    # Special tokens come from our tokenizer, the vocabulary stays the real (larger) one.
    n = len(tokenizer)
    ids = [
        cfg.image_token_id,
        cfg.video_token_id,
        cfg.vision_start_token_id,
        cfg.vision_end_token_id,
        text.eos_token_id,
        text.pad_token_id,
        text.bos_token_id,
    ]
    assert all(0 <= i < n for i in ids), ids
    assert cfg.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert text.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert text.vocab_size in (151936, 152064) and text.vocab_size > n
    assert cfg.tie_word_embeddings == PRESETS[name]["tie_word_embeddings"]
    assert all(t in tokenizer.get_vocab() for t in QWEN_SPECIAL_TOKENS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_meta_parameter_count_matches_published(name):
    n = count_parameters_meta(name)
    assert abs(n / EXPECTED_PARAMS[name] - 1) < 0.03, f"{name}: {n / 1e9:.3f}B vs {EXPECTED_PARAMS[name] / 1e9:.2f}B"


def test_build_preset_model_small_variant_loads(tmp_path, monkeypatch):
    """build_preset_model's path (no-init construction, random fill, save, reload) on a shrunken preset."""
    import torch
    from transformers import AutoModelForImageTextToText

    import vlmrl.plan.presets as presets
    from vlmrl.models.processing import load_processor

    spec = dict(presets.PRESETS["qwen2.5-vl-3b"])
    spec["text_config"] = dict(
        spec["text_config"],
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=2048,
    )
    spec["vision_config"] = dict(
        spec["vision_config"], depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=256, fullatt_block_indexes=[1]
    )
    monkeypatch.setitem(presets.PRESETS, "tiny-test", spec)
    out = presets.build_preset_model("tiny-test", tmp_path / "m", seed=1)
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    processor = load_processor(str(out))
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id


@pytest.mark.slow  # ~27 s on a 2-core CPU (two subprocesses importing torch, tiny model, data, 2 GRPO steps)
def test_gpu_memory_quick_cpu_smoke(tmp_path):
    """The benchmark end to end on the embedded tiny model, on the CPU."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_memory.py"), "--quick", "--allow-cpu", "--steps", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_memory_quick.json").read_text())
    assert result["torch"] and result["transformers"] and result["date"]
    (rec,) = result["records"]
    assert rec["returncode"] == 0 and not rec["oom"]
    assert rec["steps_logged"] == 2 and rec["time_step_s"] > 0
    assert rec["completions_per_step"] == 8 and rec["tokens_per_s"] > 0
    assert "quick-tiny-G4" in r.stdout


def _benchmark_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_memory_bench", ROOT / "benchmarks" / "gpu_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_memory_refuses_full_run_without_gpu(tmp_path, monkeypatch, capsys):
    bench = _benchmark_module()
    monkeypatch.setattr(bench, "probe", lambda: {"cuda_available": False, "torch": "x", "cuda": None})
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --allow-cpu is for the tiny smoke test only
        bench.main(["--allow-cpu", "--out", str(tmp_path)])
    assert "--quick" in capsys.readouterr().err


def test_gpu_memory_summary_drops_warmup_step():
    bench = _benchmark_module()
    rows = [
        {
            "step": s,
            "mem/gpu_peak_allocated": a,
            "mem/gpu_peak_reserved": a + 1,
            "time/step": t,
            "time/rollout": t / 2,
            "time/update": t / 2,
            "completions/mean_length": 64.0,
        }
        for s, a, t in [(1, 50.0, 9.0), (2, 30.0, 2.0), (3, 31.0, 4.0)]
    ]
    out = bench.summarize(rows, steps=3, completions_per_step=16, max_len=64)
    assert out["steps_used"] == [2, 3]
    assert out["gpu_peak_allocated_gib"] == 31.0 and out["gpu_peak_reserved_gib"] == 32.0
    assert out["time_step_s"] == 3.0 and out["tokens_per_s"] == round(16 * 64 / 3.0, 1) and out["full_length"]
    grid = bench.grid()
    assert len(grid) == 5 and sum("model.use_lora=true" in c["overrides"] for c in grid) == 1
