"""docs/failures.md names a test for every failure kind: each named test exists (a test function, or a
parametrized one, defined at the top level of that file)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def named_tests():
    text = (ROOT / "docs" / "failures.md").read_text(encoding="utf-8")
    return re.findall(r"\|\s*(tests/[\w/]+\.py)::(test_\w+)\s*\|\s*$", text, flags=re.M)


def test_every_row_of_the_failure_table_names_a_test_that_exists():
    rows = [line for line in (ROOT / "docs" / "failures.md").read_text().splitlines() if line.startswith("| ") and not line.startswith("| failure")]
    named = named_tests()
    assert len(named) == len(rows) >= 20  # every row ends with a test
    for file, name in named:
        tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
        functions = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert name in functions, f"docs/failures.md names {file}::{name}, which does not exist"
