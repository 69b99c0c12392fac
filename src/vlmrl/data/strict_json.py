"""JSON rows parsed strictly: a key given twice in one object is an error, not "the last one wins".

`json.loads` keeps the last value of a duplicated key without a word, so a row written as
{"solution": "3", ..., "solution": "5"} trains on 5 while the user reads 3. Data loaders parse rows with
`loads`, which raises DuplicateKeyError (a ValueError) naming the key; the row is then a bad row.
"""

from __future__ import annotations

import json
from typing import Any


class DuplicateKeyError(ValueError):
    """A JSON object names the same key twice."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key {key!r} appears twice in one object (JSON keeps only the last; say which one you mean)")
        out[key] = value
    return out


def loads(text: str) -> Any:
    """json.loads, refusing duplicate keys (DuplicateKeyError)."""
    return json.loads(text, object_pairs_hook=_no_duplicates)
