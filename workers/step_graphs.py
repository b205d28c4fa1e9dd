"""CUDA graphs of uniform steps: every sequence feeds the same number of tokens ``q`` and
has something cached (decode, the draft's passes, verify windows of one width).

Such a step is padded to a bucket (batch ``B`` from ``batch_buckets``, block-table width
``W`` the next power of two, ``q`` as it is) and each bucket's native forward is captured
once, the first time a step needs it, then replayed. Inside the graph the slot mapping,
positions and mask are derived from two static inputs (block index ``[B * W]`` and
query positions ``[B, q]``), so a replay costs the host one small integer copy and one
copy of the input ids, whatever the model. Padding rows feed positions ``0..q-1`` in the
KV cache's scratch block, which no sequence owns, and their logits are dropped; padding
columns of a table point at block 0 and are hidden by causality, as in the eager path.

Prefill, ragged steps and steps past the largest bucket run eagerly. Graphs share one
memory pool, so a replay's logits are copied out before the next replay (``run`` returns
a fresh tensor). With ``capture=False`` (any device without CUDA graphs) the same padded
forward runs eagerly: that is what the CPU tests exercise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from specray.workers.paged_attention import AttentionMetadata, block_rows, slot_mapping

log = logging.getLogger(__name__)

MAX_QUERY = 32        # tokens per sequence a graphed step may feed (verify windows are k + 1)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, then ``max_num_seqs`` itself: at most 7 padding
    rows past 8 sequences (vLLM's capture sizes have the same shape)."""
    return [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


def available(device: torch.device) -> bool:
    """Whether steps on ``device`` are captured (else the runner keeps its eager path)."""
    return device.type == "cuda"


@dataclass
class _Graph:
    input_ids: torch.Tensor             # [B * q] long
    ints: torch.Tensor                  # [B * W + B * q] long: block index, then query positions
    run: Callable[[], torch.Tensor]     # the replay (or, uncaptured, the forward); -> logits [B * q, V]
    out: torch.Tensor | None = None     # the captured output


class StepGraphs:
    def __init__(self, model, kv, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """``model``: a ``NativeCausalLM``; ``kv``: the runner's ``KVCache`` (its
        ``scratch_block`` takes the padding rows' writes)."""
        self.model, self.kv = model, kv
        self.block_size = kv.block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.max_width = -(-max_model_len // self.block_size)
        self.capture = capture
        self.device = kv.layers[0][0].device
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._pool = None
        self.replays = 0
        self.failed: str | None = None     # why capture failed: every step then runs eagerly

    def shape(self, num_computed: list[int], num_new: list[int]) -> tuple[int, int, int] | None:
        """The bucket ``(B, q, W)`` a step runs in, or None when it runs eagerly."""
        n, q = len(num_new), num_new[0]
        if self.failed or not 0 < q <= MAX_QUERY or min(num_computed) == 0 or any(x != q for x in num_new):
            return None
        b = next((b for b in self.buckets if b >= n), None)
        need = -(-(max(num_computed) + q) // self.block_size)
        w = min(1 << (need - 1).bit_length(), self.max_width)
        if b is None or need > w:
            return None
        return b, q, w

    def run(self, tables: list[list[int]], num_computed: list[int], num_new: list[int], input_ids: torch.Tensor,
            logits_index: torch.Tensor) -> torch.Tensor | None:
        """Logits of ``logits_index`` (packed rows of the unpadded step) from its bucket's
        graph; None when the step is not bucketed (``shape``) or its graph could not be
        captured: the caller runs it eagerly."""
        shape = self.shape(num_computed, num_new)
        if shape is None:
            return None
        b, q, w = shape
        g = self._graphs.get(shape)
        if g is None:
            try:
                g = self._build(shape)
            except Exception as e:  # noqa: BLE001 - a capture failure must not fail the step
                # The warm-up and capture wrote only the scratch block: the eager path is safe.
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("specray: CUDA graph capture of bucket %s failed (%s); steps run eagerly",
                            shape, self.failed)
                return None
        n = len(tables)
        blocks = block_rows(tables, w) + [self.kv.scratch_block] * ((b - n) * w)
        positions: list[int] = []
        for c in num_computed:
            positions += range(c, c + q)
        positions += list(range(q)) * (b - n)
        g.ints.copy_(torch.tensor(blocks + positions, dtype=torch.long), non_blocking=True)
        g.input_ids[:n * q].copy_(input_ids)
        out = g.run()
        self.replays += 1
        return out[:n * q].index_select(0, logits_index)

    def _forward(self, b: int, q: int, w: int, g: _Graph) -> torch.Tensor:
        block_index, q_pos = g.ints.split([b * w, b * q])
        q_pos = q_pos.view(b, q)
        meta = AttentionMetadata(self.kv.layers, self.block_size, slot_mapping(block_index, q_pos, w, self.block_size),
                                 block_index, q_pos, None, None, b, q, prefill=False)
        rows = torch.arange(b * q, device=self.device)
        return self.model.forward(g.input_ids, q_pos.view(-1), meta, rows)

    def _build(self, shape: tuple[int, int, int]) -> _Graph:
        b, q, w = shape
        dev = self.device
        # Until the first real step fills them, the inputs address the scratch block only:
        # the warm-up and capture runs write nowhere a sequence owns.
        ints = torch.tensor([self.kv.scratch_block] * (b * w) + list(range(q)) * b, dtype=torch.long, device=dev)
        g = _Graph(torch.zeros(b * q, dtype=torch.long, device=dev), ints, run=lambda: None)
        if not self.capture:
            g.run = lambda: self._forward(b, q, w, g)
        else:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):          # kernels choose their algorithms before capture
                    self._forward(b, q, w, g)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                g.out = self._forward(b, q, w, g)
            self._pool = graph.pool()

            def replay() -> torch.Tensor:
                graph.replay()
                return g.out

            g.run = replay
        self._graphs[shape] = g
        return g
