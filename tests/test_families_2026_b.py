"""More 2026 families (issue 38, second batch), checked as tests/test_families_2026.py checks the first: each builds
offline, its processor feeds the model's own forward, the registry names it; slow tier: 2 GRPO steps with the memory
engine on, exact resume, `final/` reloads in plain transformers; then SFT and a LoRA GRPO run end to end."""

import pytest
import torch

# The checks themselves are test_families_2026's (imported under names pytest does not collect twice).
from test_families_2026 import _weights, built, data  # noqa: F401 (fixtures)
from test_families_2026 import test_builds_and_its_processor_feeds_the_model as builds_and_its_processor_feeds_the_model
from test_families_2026 import test_grpo_resume_and_reload as grpo_resume_and_reload

# (`vlmrl tiny --family` name, config.model_type, the processor class vlmrl loads here)
NEW_FAMILIES = [
    ("smolvlm", "smolvlm", "SmolVLMImageOnlyProcessor"),
]
NAMES = [name for name, _, _ in NEW_FAMILIES]


@pytest.mark.integration
@pytest.mark.parametrize("name,model_type,processor_class", NEW_FAMILIES)
def test_builds_and_its_processor_feeds_the_model(name, model_type, processor_class, built):  # noqa: F811 (fixtures imported above)
    builds_and_its_processor_feeds_the_model(name, model_type, processor_class, built)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_grpo_resume_and_reload(name, built, data, tmp_path):  # noqa: F811 (fixtures imported above)
    grpo_resume_and_reload(name, built, data, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_sft_and_lora_grpo(name, built, data, tmp_path):  # noqa: F811 (fixtures imported above)
    """`vlmrl sft` (projector warm-up, then full) and `vlmrl train` with LoRA (beta > 0: the reference is the adapter
    switched off) on image rows: both finish, move weights, and write a `final/` folder."""
    from vlmrl.cli import main

    common = [f"model.name_or_path={built(name)}", f"data.train_path={data['train']}", "data.eval_path="]
    common += ["logging.progress_bar=false", "logging.tensorboard=false", "logging.report=false", "data.min_pixels=3136", "data.max_pixels=3136"]
    sft = [f"training.output_dir={tmp_path / 'sft'}", "sft.projector_steps=1", "sft.steps=1", "sft.batch_size=2"]
    assert main(["sft", *common, *sft]) == 0
    before, after = _weights(built(name)), _weights(tmp_path / "sft" / "final")
    assert after.keys() == before.keys() and any(not torch.equal(before[k], after[k]) for k in before), "SFT changed no weight"
    grpo = [f"training.output_dir={tmp_path / 'lora'}", "training.max_steps=1", "rollout.num_generations=2", "training.per_device_train_batch_size=4"]
    grpo += ["rollout.max_completion_length=4", "model.use_lora=true", "algorithm.beta=0.05", "algorithm.reward_funcs=[accuracy]"]
    assert main(["train", *common, *grpo]) == 0
    assert len([x for x in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]) == 1
    assert any((tmp_path / "lora" / "final").glob("*.safetensors"))
