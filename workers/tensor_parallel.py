"""Tensor parallelism for the native executor: Megatron's split, over torch.distributed.

A group of ``size`` ranks runs one model. Each rank holds 1/size of every layer and of the
KV cache; all ranks run every step together (SPMD) and meet in collectives::

    embedding   split by vocabulary: a rank looks up the ids of its slice (zero rows for the
                others), then all-reduce: every rank holds the whole embedding output
    q/k/v       column-parallel: a rank computes its query heads' q and its KV heads' k, v
                (Qwen2's biases split with them; Qwen3's q/k norms act within one head)
    attention   over the rank's own heads and its own KV cache; the KV heads are split,
                or replicated where there are fewer KV heads than ranks
    o_proj      row-parallel: a rank's heads' share of the sum, then all-reduce
    gate/up     column-parallel; down_proj row-parallel, then all-reduce
    lm_head     split by vocabulary; the slices all-gathered: every rank has logits [m, V]

So a layer costs two all-reduces, and between layers the residual stream is whole and the
same on every rank (an EAGLE-3 head beside rank 0 reads its hidden states there).

``RankGroup`` is one rank's handle on its group: on CPU, shared memory between ranks of one
x86-64 host (``shm_collective``) and gloo otherwise and for tensors too large for its slots
(float32 only: gloo has no bfloat16 sum); NCCL on CUDA; and a gloo group for host-side
messages (the plan rank 0 shares each step, ``rank_group``). The groups are built on a ``Store`` of their own, not
torch.distributed's default group, so one process may hold ranks of several groups (the
driver's actor hosts rank 0 of the target's). Every collective is bounded by the group's
timeout: a rank whose peer died raises instead of waiting (30 minutes by default in torch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specray.workers import shm_collective

# A collective waits this long for its peers before it raises (the group is then broken).
DEFAULT_TIMEOUT_S = 60.0
# The shared plan travels in one broadcast when it fits (a longer one takes a second).
_HEAD_BYTES = 16384


def _heads(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def kv_partition(kv_heads: int, size: int) -> list[tuple[int, int]]:
    """(first KV head, KV heads) of each rank. At least as many KV heads as ranks: split as
    evenly as they go (9 query heads over 3 KV heads on 2 ranks: 2 and 1 KV heads, with
    their query heads), so a model whose head count the ranks do not divide still splits.
    Fewer: each KV head replicated on ``size / kv_heads`` consecutive ranks."""
    if kv_heads >= size:
        base, extra = divmod(kv_heads, size)
        counts = [base + (r < extra) for r in range(size)]
        return [(sum(counts[:r]), counts[r]) for r in range(size)]
    per = size // kv_heads
    return [(r // per, 1) for r in range(size)]


def check_split(config, size: int, field: str = "tensor_parallel_size") -> None:
    """Refuses, naming ``field``, a split of ``config``'s model (a transformers config, or
    anything with its attribute names) into ``size`` ranks that its layers do not allow:
    KV heads that neither cover the ranks nor divide them, query heads of one KV head that
    its replicas cannot share evenly, an MLP the ranks do not divide."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{field} must be an int >= 1, got {size!r}")
    if size == 1:
        return
    heads, kv_heads = _heads(config)
    inter = getattr(config, "intermediate_size", None) or 0
    if heads % kv_heads:
        raise ValueError(f"{field}={size}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv_heads}")
    if kv_heads < size and size % kv_heads:
        raise ValueError(f"{field}={size}: num_key_value_heads {kv_heads} is fewer than the ranks and does not "
                         f"divide {size}")
    if kv_heads < size and (heads // kv_heads) % (size // kv_heads):
        raise ValueError(f"{field}={size}: num_attention_heads {heads} cannot be shared by {size} ranks "
                         f"({size // kv_heads} replicas of each of {kv_heads} KV heads)")
    if inter % size:
        raise ValueError(f"{field}={size}: intermediate_size {inter} is not divisible by {size}")


def check_backend(device: torch.device, dtype: torch.dtype, field: str = "dtype") -> None:
    """gloo (tensor parallel on CPU) sums float32 only: refuse half precision there."""
    if device.type == "cpu" and dtype != torch.float32:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"{field}={name}: tensor parallel on CPU all-reduces over gloo, which has no "
                         f"{name} sum; use dtype='float32'")


@dataclass(frozen=True)
class Split:
    """What rank ``rank`` of ``size`` holds of a model (``check_split`` passed)."""

    rank: int
    size: int
    heads: int          # its query heads
    q_first: int        # the model's index of its first query head
    kv_heads: int       # its KV heads (``kv_partition``)
    kv_first: int       # the model's index of its first KV head
    inter: int          # its rows of the MLP's intermediate size
    vocab: int          # rows per vocabulary slice: ceil(V / size), the last one zero-padded

    @classmethod
    def of(cls, config, rank: int, size: int, field: str = "tensor_parallel_size") -> "Split":
        check_split(config, size, field)
        heads, kv_heads = _heads(config)
        group = heads // kv_heads                        # query heads per KV head
        kv_first, local_kv = kv_partition(kv_heads, size)[rank]
        if kv_heads >= size:
            q_first, local_q = kv_first * group, local_kv * group
        else:
            # Replicas of one KV head share its query heads.
            local_q = group // (size // kv_heads)
            q_first = rank * local_q
        vocab = -(-config.vocab_size // size)
        return cls(rank, size, local_q, q_first, local_kv, kv_first, config.intermediate_size // size, vocab)

    def vocab_rows(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a [V, D] embedding or head, zero rows past V."""
        first = self.rank * self.vocab
        part = w.detach()[first:first + self.vocab]
        if part.shape[0] < self.vocab:
            part = torch.cat([part, part.new_zeros(self.vocab - part.shape[0], *part.shape[1:])])
        return part.clone()


def local_kv_heads(kv_heads: int, size: int, rank: int) -> int:
    """KV heads the cache of rank ``rank`` holds."""
    return kv_partition(kv_heads, size)[rank][1]


class RankGroup:
    """One rank's handle on its tensor-parallel group. Built by every rank at once (the
    constructor waits for all ``size`` on ``store``); ``comm_s`` adds up the seconds this
    rank spent in the model's collectives (what the scaling benchmark reports). ``field``:
    the setting that asked for the group, named where its split is refused.
    ``shared_memory=False`` keeps a CPU group on gloo (the scaling benchmark's comparison);
    ``transport`` says which the model's collectives use."""

    def __init__(self, store, rank: int, size: int, device: torch.device,
                 timeout_s: float = DEFAULT_TIMEOUT_S, field: str = "tensor_parallel_size",
                 shared_memory: bool = True) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of {size}")
        self.rank, self.size, self.device, self.field = rank, size, device, field
        self.timeout = timedelta(seconds=timeout_s)
        self.host = dist.ProcessGroupGloo(dist.PrefixStore("host/", store), rank, size, self.timeout)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
        else:
            self.dev = self.host
        self.shm = None
        if device.type == "cpu" and shared_memory:
            self.shm = shm_collective.connect(dist.PrefixStore("shm/", store), rank, size, timeout_s)
        self.transport = "nccl" if device.type == "cuda" else "shm" if self.shm else "gloo"
        self.comm_s = 0.0
        self.broken = False

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except Exception:
            self.broken = True              # a collective that failed leaves the ranks out of step
            raise

    def _wait(self, work) -> None:
        self._guarded(work.wait, self.timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (any shape), in place."""
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.fits(x):
            self._guarded(self.shm.all_reduce, x)
        else:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            self._wait(self.dev.allreduce([x], opts))
        self.comm_s += time.perf_counter() - t0
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[m, c] from every rank -> [m, size * c], rank order along the last dimension."""
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.fits(x):
            out = self._guarded(self.shm.all_gather, x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self._wait(self.dev.allgather([parts], [x.contiguous()]))
            out = torch.cat(parts, dim=-1)
        self.comm_s += time.perf_counter() - t0
        return out

    def min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (KV blocks: each rank sized its own)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait(self.host.allreduce([t], opts))
        return int(t.item())

    def broadcast(self, data: bytes | None = None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None). One broadcast of a fixed
        head carries a short message whole; a longer one sends its rest in a second."""
        head = torch.zeros(_HEAD_BYTES + 8, dtype=torch.uint8)
        if self.rank == 0:
            if data is None:
                raise ValueError("rank 0 broadcasts bytes")
            head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            first = data[:_HEAD_BYTES]
            if first:
                head[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self._broadcast(head)
        n = int(head[:8].view(torch.int64).item())
        if n <= _HEAD_BYTES:
            return data if self.rank == 0 else bytes(head[8:8 + n].numpy())
        rest = torch.empty(n - _HEAD_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            rest.copy_(torch.frombuffer(bytearray(data[_HEAD_BYTES:]), dtype=torch.uint8))
        self._broadcast(rest)
        return data if self.rank == 0 else bytes(head[8:].numpy()) + bytes(rest.numpy())

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.host.broadcast([t], opts))

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        for pg in {id(self.host): self.host, id(self.dev): self.dev}.values():
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - a broken group may refuse an orderly shutdown
                pass
