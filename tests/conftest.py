"""Shared fixtures: tiny random-weight VLM folders of each family, built once per test session."""

import os

import pytest

# Nothing in the tests may reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_qwen25vl(tmp_path_factory):
    from vlmrl.tiny import build_tiny_qwen25vl

    return build_tiny_qwen25vl(tmp_path_factory.mktemp("tiny-qwen25vl"))


@pytest.fixture(scope="session")
def tiny_qwen2vl(tmp_path_factory):
    from vlmrl.tiny import build_tiny_qwen2vl

    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny-qwen2vl"))


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    from vlmrl.tiny import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
