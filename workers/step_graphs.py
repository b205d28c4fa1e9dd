"""CUDA graphs of uniform steps: every sequence feeds the same number of tokens ``q`` and
has something cached (decode, the draft's passes, verify windows of one width).

Buckets. A step is padded to a bucket ``(B, q, W)``: batch ``B`` from ``batch_buckets``
(at most ``MAX_BATCH``: past it a step is compute-bound and eager costs little more),
``q`` one of ``query_lens`` (the runtime's uniform steps: 1 for decode and draft passes,
2 for the draft's catch-up after a fully accepted window, k + 1 for verify windows), and
block-table width ``W`` the next power of two (or the window's own width). Other steps
(prefill, ragged, larger) run eagerly.

Start-up. ``capture_all`` captures every bucket before the worker reports ready, largest
first, in one memory pool (as nano-vllm's ``capture_cudagraph``): no timed step pays for
a capture, and a failure is known before anything is served. On a failure the capturer
restores a clean eager process (``graph_capture``), no bucket is left captured, and
``capture_all`` raises ``GraphCaptureError``: the runner serves eagerly.

Buffers. Every graph reads and writes slices of the same static buffers: input ids
``[Bmax * qmax]``, integers ``[max(B * W + B * q)]`` (block index, then query positions)
and the final hidden states ``[Bmax * qmax, D]``. Inside the graph the slot mapping,
positions and mask are derived from the integers, so a replay costs the host one small
integer copy and one copy of the input ids. The vocabulary projection runs eagerly on the
wanted rows only: a graph ending in ``[B * q, V]`` logits would keep V / D times more
memory, per graph. Padding rows feed positions ``0..q-1`` in the KV cache's scratch block,
which no sequence owns; padding columns of a table point at block 0 and are hidden by
causality, as in the eager path.

With ``Uncaptured`` (any device without CUDA graphs) the same padded forward runs
eagerly through the same buffers: that is what the CPU tests exercise.
"""

from __future__ import annotations

import logging

import torch

from specray.scheduler.block_manager import blocks_needed
from specray.workers.host_copy import host_tensor
from specray.workers.paged_attention import AttentionMetadata, block_rows, slot_mapping

log = logging.getLogger(__name__)

MAX_QUERY = 32        # tokens per sequence a graphed step may feed (verify windows are k + 1)
MAX_BATCH = 64        # sequences a graphed step may hold


class GraphCaptureError(RuntimeError):
    """A bucket could not be captured; nothing is captured and the process is clean."""


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, then ``max_num_seqs`` itself: at most 7 padding
    rows past 8 sequences (vLLM's capture sizes have the same shape)."""
    return [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


def table_widths(max_width: int) -> list[int]:
    """Powers of two below ``max_width``, then ``max_width``: the widths ``shape`` picks."""
    return [1 << i for i in range(max(max_width - 1, 0).bit_length()) if 1 << i < max_width] + [max_width]


def available(device: torch.device) -> bool:
    """Whether steps on ``device`` are captured (else the runner keeps its eager path)."""
    return device.type == "cuda"


class StepGraphs:
    def __init__(self, model, kv, max_num_seqs: int, max_model_len: int, query_lens, capturer) -> None:
        """``model``: a ``NativeCausalLM``; ``kv``: the runner's ``KVCache`` (its
        ``scratch_block`` takes the padding rows' writes); ``capturer``: see
        ``graph_capture`` (``Uncaptured`` off CUDA)."""
        self.model, self.kv, self.capturer = model, kv, capturer
        self.block_size = kv.block_size
        self.device = kv.layers[0][0].device
        self.max_width = blocks_needed(max_model_len, self.block_size)
        self.batches = batch_buckets(min(max_num_seqs, MAX_BATCH))
        self.query_lens = sorted({q for q in query_lens if 0 < q <= MAX_QUERY})
        self.widths = table_widths(self.max_width)
        # Largest first: the first capture sizes the shared pool, the others reuse it.
        self.buckets = sorted(((b, q, w) for b in self.batches for q in self.query_lens for w in self.widths),
                              reverse=True)
        rows = self.batches[-1] * self.query_lens[-1] if self.query_lens else 0
        ints = max((b * w + b * q for b, q, w in self.buckets), default=0)
        hidden = model.embed.shape[1]
        self._ids = torch.zeros(rows, dtype=torch.long, device=self.device)                 # [Bmax * qmax]
        self._ints = torch.zeros(ints, dtype=torch.long, device=self.device)                # [B*W + B*q]
        self._hidden = torch.zeros(rows, hidden, dtype=model.embed.dtype, device=self.device)  # [Bmax * qmax, D]
        self._replay: dict[tuple[int, int, int], object] = {}
        self.replays = 0

    @property
    def captured(self) -> int:
        return len(self._replay)

    def shape(self, num_computed: list[int], num_new: list[int]) -> tuple[int, int, int] | None:
        """The captured bucket ``(B, q, W)`` a step runs in, or None when it runs eagerly."""
        n, q = len(num_new), num_new[0]
        if not self._replay or q not in self.query_lens or min(num_computed) == 0 or any(x != q for x in num_new):
            return None
        b = next((b for b in self.batches if b >= n), None)
        need = blocks_needed(max(num_computed) + q, self.block_size)
        w = min(1 << (need - 1).bit_length(), self.max_width)
        if b is None or need > w:
            return None
        return (b, q, w) if (b, q, w) in self._replay else None

    def capture_all(self) -> None:
        """Capture every bucket (``buckets`` order); on any failure leave none captured and
        raise GraphCaptureError (the capturer has cleaned up)."""
        try:
            for shape in self.buckets:
                self._replay[shape] = self.capturer.capture(self._prepared(shape))
        except Exception as e:  # noqa: BLE001 - whatever failed, the remedy is the same: serve eagerly
            self._replay.clear()
            self.capturer.abandon()        # raises itself when the device is gone
            raise GraphCaptureError(f"{type(e).__name__}: {e}") from e

    def run_once(self, shape: tuple[int, int, int]) -> None:
        """One uncaptured forward of a bucket over the scratch block (memory profiling)."""
        self._prepared(shape)()

    def run(self, tables: list[list[int]], num_computed: list[int], num_new: list[int], input_ids: torch.Tensor,
            logits_index: torch.Tensor) -> torch.Tensor | None:
        """The final hidden states [m, D] of ``logits_index`` (packed rows of the unpadded
        step) from its bucket's graph, as a fresh tensor; None when the step has no bucket
        (``shape``): the caller runs it eagerly."""
        shape = self.shape(num_computed, num_new)
        if shape is None:
            return None
        b, q, w = shape
        n = len(tables)
        blocks = block_rows(tables, w) + [self.kv.scratch_block] * ((b - n) * w)
        positions: list[int] = []
        for c in num_computed:
            positions += range(c, c + q)
        positions += list(range(q)) * (b - n)
        self._ints[:b * w + b * q].copy_(host_tensor(blocks + positions, self.device), non_blocking=True)
        self._ids[:n * q].copy_(input_ids)
        self._replay[shape]()
        self.replays += 1
        return self._hidden[:n * q].index_select(0, logits_index)

    def _prepared(self, shape: tuple[int, int, int]):
        """The bucket's forward, its integers set to address the scratch block only, so
        warm-up, capture and profiling runs write nowhere a sequence owns."""
        b, q, w = shape
        self._ints[:b * w].fill_(self.kv.scratch_block)
        self._ints[b * w:b * w + b * q].copy_(torch.arange(q, device=self.device).repeat(b))
        return lambda: self._forward(b, q, w)

    def _forward(self, b: int, q: int, w: int) -> None:
        block_index, q_pos = self._ints[:b * w + b * q].split([b * w, b * q])
        q_pos = q_pos.view(b, q)
        meta = AttentionMetadata(self.kv.layers, self.block_size, slot_mapping(block_index, q_pos, w, self.block_size),
                                 block_index, q_pos, None, None, b, q, prefill=False)
        rows = torch.arange(b * q, device=self.device)
        self._hidden[:b * q].copy_(self.model.hidden_states(self._ids[:b * q], q_pos.view(-1), meta, rows))
