"""The prompt sampler: row indices in a seeded order fixed per epoch, so a resumed run continues exactly."""

from __future__ import annotations

import random


from vlmrl.data.errors import DataError


class PromptSampler:
    """Row indices in a seeded order that is fixed per epoch, so a resumed run continues exactly.

    Epoch e uses a permutation from ``random.Random(f"{seed}:{e}")`` (string seeds are hashed with SHA-512,
    so seeds and epochs never collide and the order does not depend on PYTHONHASHSEED). A batch that
    crosses the end of an epoch continues into the next one, so it can hold the same index twice.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError(f"PromptSampler needs at least one row, got {num_rows}")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self._epoch, self._position = 0, 0
        self._order: list[int] | None = None

    @property
    def epoch(self) -> int:
        """Completed passes over the data (the epoch the next index comes from)."""
        return self._epoch

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(self.num_rows))
            if self.shuffle:
                random.Random(f"vlmrl-sampler:{self.seed}:{self._epoch}").shuffle(order)
            self._order = order
        return self._order

    def next_batch(self, n: int) -> list[int]:
        """The next n indices, crossing into the next epoch when this one runs out."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            order = self._epoch_order()
            take = min(n - len(out), self.num_rows - self._position)
            out += order[self._position : self._position + take]
            self._position += take
            if self._position == self.num_rows:
                self._epoch, self._position, self._order = self._epoch + 1, 0, None
        return out

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self._epoch, "position": self._position, "num_rows": self.num_rows, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; refuses (DataError, a user error) a state saved for different data or a different seed."""
        for key in ("num_rows", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}; "
                    "the data or seed changed since the checkpoint"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_rows:
            raise ValueError(f"invalid sampler state epoch={epoch} position={position} for {self.num_rows} rows")
        self._epoch, self._position, self._order = epoch, position, None
