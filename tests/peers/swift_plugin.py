"""An ms-swift reward plugin written the documented way: an ORM subclass whose __call__(completions, **kwargs) gets
string completions and the dataset columns, registered in `orms` under the name --reward_funcs uses. Written for
vlmrl's tests; not ms-swift's code."""

import re
from typing import List

from swift.plugin import ORM, orms


class CountAccuracy(ORM):
    instances = 0

    def __init__(self):
        CountAccuracy.instances += 1

    def __call__(self, completions, solution, **kwargs) -> List[float]:
        out = []
        for content, sol in zip(completions, solution):
            assert isinstance(content, str)
            got = re.search(r"<answer>(.*?)</answer>", content)
            want = re.search(r"<answer>(.*?)</answer>", sol)
            out.append(1.0 if got and want and got.group(1).strip() == want.group(1).strip() else 0.0)
        return out


orms["external_count_acc"] = CountAccuracy
