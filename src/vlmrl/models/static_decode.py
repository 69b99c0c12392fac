"""Static-shape decode step of the continuous decoder (rollout.decode_step=static / cuda_graph).

The dynamic step (`ContinuousDecoder.decode`) runs the n active rows over the columns seen so far: its shapes change
every step, so each step launches every kernel anew (on a GPU, at 3B scale and small batches, decode is launch- and
bandwidth-bound, not compute-bound). This step runs a fixed batch bucket B >= n (powers of two up to the slot count
S, and S) over every cache column C = P + max_new_tokens, so all steps of one bucket have the same shapes:

- rows n..B-1 are padding in free slots: token 0, written at column P, visible only to themselves (a finite
  attention row: a row with nothing visible would give NaN, and a NaN key left in the cache would poison every
  later row of that slot through the masked scores); their logits are dropped. A row that later joins the slot
  overwrites its prefix columns and writes column P before it reads it.
- `graphs=True` (CUDA only): the first step of a bucket runs eagerly on a side stream (its logits are used, and it
  warms up cuBLAS / the allocator) and is then captured as a CUDA graph over static input buffers; later steps of
  that bucket copy their inputs into the buffers and replay it. The capture records kernels without running them,
  so state updated in place (K/V written at a column, linear-attention states) advances once per step. Autocast's
  weight cache is off while capturing (cached casts would be freed under the graph).

A row's logits equal the dynamic step's up to the batch-size dependence of the matmul kernels (the extra columns
are masked out), so the sampled tokens are the same (equality-tested on CPU: tests/test_static_decode.py).
"""

from __future__ import annotations

import logging

import torch


def buckets(slots: int) -> list[int]:
    """The batch sizes a static step runs at: powers of two below `slots`, then `slots` (e.g. 12 -> [1, 2, 4, 8, 12])."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


def bucket_for(n: int, slots: int) -> int:
    """The smallest bucket holding n active rows."""
    return next(b for b in buckets(slots) if b >= n)


class StaticStep:
    """Per rollout call: the static inputs of each bucket, and with graphs=True its captured CUDA graph."""

    def __init__(self, decoder, graphs: bool):
        if graphs and decoder.device.type != "cuda":
            raise ValueError(f"rollout.decode_step=cuda_graph needs the model on a CUDA device; it is on {decoder.device} (use static)")
        self.graphs = graphs
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.replays = 0  # steps served by a graph replay (the suite reports it)

    def inputs(self, dec, tokens: torch.Tensor, cols: torch.Tensor, size: int) -> dict:
        """Bucket-sized inputs: tokens [B, 1], the rows' columns [B], visible columns [B, 1, 1, C], positions."""
        n, r, device = dec.cache.n, dec.rows, dec.device
        tok = torch.zeros(size, 1, dtype=torch.long, device=device)
        tok[:n, 0] = tokens
        col = torch.full((size,), dec.P, dtype=torch.long, device=device)
        col[:n] = cols
        visible = r.valid[:size, None, None, :].clone()
        visible[n:] = False
        visible[torch.arange(n, size, device=device), 0, 0, dec.P] = True
        pos = torch.zeros(size, dtype=torch.long, device=device)
        pos[:n] = (r.next_pos[:n] + r.t[:n]).to(device)
        return dict(tokens=tok, cols=col, visible=visible, qwen_pos=pos)

    def run(self, dec, x: dict) -> torch.Tensor:
        """The step's forward on bucket inputs `x` -> float32 logits [B, V] (what a graph captures)."""
        cache = dec.cache
        cache.step_rows, cache.write_col, cache.length = x["tokens"].shape[0], x["cols"], cache.columns
        return dec.forward(x["tokens"], dec.masks(x["visible"], x["cols"]), dec.positions(x["qwen_pos"], x["cols"]))

    def step(self, dec, tokens: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of the n active rows (tokens [n], their columns [n], on the device)."""
        n = dec.cache.n
        size = bucket_for(n, dec.S)
        x = self.inputs(dec, tokens, cols, size)
        if not self.graphs:
            return self.run(dec, x)[:n]
        if size in self.captured:
            graph, buffers, logits = self.captured[size]
            for name, value in x.items():
                buffers[name].copy_(value)
            dec.cache.write_col = buffers["cols"]
            graph.replay()
            self.replays += 1
            return logits[:n].clone()
        return self.capture(dec, x, size)[:n]

    def capture(self, dec, x: dict, size: int) -> torch.Tensor:
        """Run this step eagerly on a side stream (its logits are returned), then capture the same step over `x` (kept
        as the bucket's static buffers) as a CUDA graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.run(dec, x).clone()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with _no_autocast_cache(), torch.cuda.graph(graph, pool=self.pool):
                out = self.run(dec, x)
        except RuntimeError as err:  # an op of this model that cannot be captured: keep the static step, say why once
            logging.getLogger("vlmrl").warning("rollout.decode_step=cuda_graph: capture failed (%s); using the static step without graphs", err)
            self.graphs = False
            return logits
        self.captured[size] = (graph, x, out)
        return logits


class _no_autocast_cache:
    """Autocast as it is, with its weight-cast cache off (a cached cast made under capture is freed after it)."""

    def __enter__(self):
        self.ctx = None
        if torch.is_autocast_enabled("cuda"):
            self.ctx = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
            self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
        return False
