"""Model types live in one place: no string literal naming a registered model type outside src/vlmrl/families/.

tiny_models/, plan/presets.py and processors/ are left out on purpose: the tiny builders, the real-size presets and the
processor stand-ins write configs *of* those model types (the Family points at its builder and stand-in); they choose
nothing per family for the rest of vlmrl."""

import ast
import pathlib

import pytest

from vlmrl.families import model_types

pytestmark = pytest.mark.unit

SRC = pathlib.Path(__file__).parents[1] / "src" / "vlmrl"
OWNERS = ("families", "tiny_models", "processors")
OWNER_FILES = {"plan/presets.py"}
# (file, value) pairs that name something else: "llava" there is the LLaVA-Instruct data format, not a model type.
NOT_MODEL_TYPES = {("data/formats.py", "llava")}


def model_type_literals(source: str, types: set[str]) -> list[tuple[int, str]]:
    """(line, value) of every string constant in `source` that equals one of `types`."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in types
    ]


def test_finder_finds_a_planted_tuple():
    source = 'X = ("qwen2_vl", "gemma3")\nY = "a qwen2_vl model"\nif t == "gemma3":\n    pass\n'
    assert model_type_literals(source, {"qwen2_vl", "gemma3"}) == [(1, "qwen2_vl"), (1, "gemma3"), (3, "gemma3")]


def test_no_model_type_string_outside_families():
    types = set(model_types())
    assert {"qwen2_vl", "qwen3_5_moe", "gemma3", "internvl", "smolvlm"} <= types  # the list comes from the registry
    found = [
        f"{path.relative_to(SRC)}:{line}: {value!r}"
        for path in sorted(SRC.rglob("*.py"))
        if path.relative_to(SRC).parts[0] not in OWNERS and str(path.relative_to(SRC)) not in OWNER_FILES
        for line, value in model_type_literals(path.read_text(), types)
        if (str(path.relative_to(SRC)), value) not in NOT_MODEL_TYPES
    ]
    assert not found, "model types belong in a Family (src/vlmrl/families/), not here:\n" + "\n".join(found)
