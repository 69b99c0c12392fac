"""Print the README's families x features table (markdown) from docs/families_matrix.json.

A cell backed by tests reads "yes" (or the family's label for it, e.g. "presets" for a planner that has preset
counts but no trace); "no: ..." and "fallback: ..." cells print their first word, with the reason as a numbered note. tests/test_families.py checks
that every test named in the matrix is collected by pytest, so the table cannot claim an untested "yes".

    python scripts/families_table.py            # print the table
"""

import json
import sys
from pathlib import Path

MATRIX = Path(__file__).parents[1] / "docs" / "families_matrix.json"


def render(matrix: dict) -> str:
    features = matrix["features"]
    lines = ["| family | " + " | ".join(features) + " |", "|---" * (len(features) + 1) + "|"]
    notes: list[str] = []
    for family, entry in matrix["families"].items():
        cells = []
        for feature in features:
            cell = entry["cells"][feature]
            if isinstance(cell, list):
                cells.append(entry.get("labels", {}).get(feature, "yes"))
                continue
            word, _, reason = cell.partition(":")
            if reason.strip() not in notes:
                notes.append(reason.strip())
            cells.append(f"{word} ({notes.index(reason.strip()) + 1})")
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"({i}) {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(json.loads(MATRIX.read_text())))
