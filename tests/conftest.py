"""Shared fixtures: tiny random-weight VLM folders of each family, built once per test session."""

import os

import pytest
from family_fixtures import ALL_FAMILY_FIXTURES

# Nothing in the tests may reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_qwen25vl(tmp_path_factory):
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    return build_tiny_qwen25vl(tmp_path_factory.mktemp("tiny-qwen25vl"))


@pytest.fixture(scope="session")
def tiny_qwen2vl(tmp_path_factory):
    from vlmrl.tiny_models.tiny import build_tiny_qwen2vl

    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny-qwen2vl"))


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    from vlmrl.tiny_models.tiny import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tiny_qwen3vl(tmp_path_factory):
    from vlmrl.tiny_models.tiny_families import build_tiny_qwen3vl

    return build_tiny_qwen3vl(tmp_path_factory.mktemp("tiny-qwen3vl"))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    from vlmrl.tiny_models.tiny_families import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tiny_qwen3vl_moe(tmp_path_factory):
    from vlmrl.tiny_models.tiny_families import build_tiny_qwen3vl_moe

    return build_tiny_qwen3vl_moe(tmp_path_factory.mktemp("tiny-qwen3vl-moe"))


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory):
    from vlmrl.tiny_models.tiny_families import build_tiny_qwen35

    return build_tiny_qwen35(tmp_path_factory.mktemp("tiny-qwen35"))


@pytest.fixture(scope="session")
def tiny_qwen35_moe(tmp_path_factory):
    from vlmrl.tiny_models.tiny_families import build_tiny_qwen35_moe

    return build_tiny_qwen35_moe(tmp_path_factory.mktemp("tiny-qwen35-moe"))


@pytest.fixture(scope="session")
def tiny_llava_onevision(tmp_path_factory):
    from vlmrl.tiny_models.tiny_families import build_tiny_llava_onevision

    return build_tiny_llava_onevision(tmp_path_factory.mktemp("tiny-llava-onevision"))


@pytest.fixture(scope="session")
def tiny_internvl(tmp_path_factory):
    from vlmrl.tiny_models.tiny_families import build_tiny_internvl

    return build_tiny_internvl(tmp_path_factory.mktemp("tiny-internvl"))


# Tiers (pytest -m unit | integration | multiproc | slow): a test is `integration` when it builds on a tiny model,
# `multiproc` when it starts several processes (torchrun / gloo), `unit` otherwise; explicit marks win.
TINY_MODEL_FIXTURES = set(ALL_FAMILY_FIXTURES)
TIERS = {"integration", "multiproc", "slow"}


def _traces(item) -> bool:
    """Planner tests that build a real architecture on the meta device and trace it (about a second each)."""
    return item.path.name == "test_planner.py" and ("trace" in item.name or "cli_plan" in item.name)


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        marks = {m.name for m in item.iter_markers()}
        several_processes = "two_process" in item.name or "dead_holder" in item.name or "gloo" in item.name
        if several_processes or (item.path.name == "test_distributed.py" and "setup" in fixtures):
            item.add_marker(pytest.mark.multiproc)
        elif not marks & TIERS and (fixtures & TINY_MODEL_FIXTURES or item.path.name == "test_integration.py" or _traces(item)):
            item.add_marker(pytest.mark.integration)
        if not {m.name for m in item.iter_markers()} & TIERS:
            item.add_marker(pytest.mark.unit)
