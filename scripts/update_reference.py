"""Regenerate the README's config reference from the config's field docs."""

import re
from pathlib import Path

from vlmrl.config import reference_markdown

readme = Path(__file__).parents[1] / "README.md"
text = readme.read_text()
text = re.sub(r"<!-- config-reference:start -->\n.*<!-- config-reference:end -->",
              lambda _: "<!-- config-reference:start -->\n" + reference_markdown() + "<!-- config-reference:end -->", text, flags=re.S)
readme.write_text(text)
