"""All-reduce and all-gather through shared memory, for the ranks of a group on one host.

gloo reaches a peer on the same machine through loopback TCP, a round of system calls and
copies for every collective; a layer makes two. Ranks that share a host can instead meet in
one mapped segment::

    counters   one int64 a rank, each on a cache line of its own: the sequence number of
               the last collective whose input the rank has written
    buffers    two (by the parity of the sequence number), each ``size`` slots of
               ``capacity`` bytes: slot r holds rank r's input

Collective ``s``: rank r copies its tensor into its slot of buffer ``s % 2``, publishes
``s``, waits until every counter reaches ``s``, then reads every slot in rank order (a sum,
the same on every rank, or a concatenation). Buffer ``s % 2`` is written again only at
``s + 2``, after its writer saw every peer publish ``s + 1``, which each did after reading
``s``: one wait a collective, no second barrier.

The stores are plain memory writes ordered by the CPU; x86's total store order keeps a
rank's data before its counter, so the segment is used on x86-64 only (elsewhere ``connect``
answers None and the group stays on gloo).

A dead peer does not leave a rank waiting out the timeout: every rank holds an exclusive
``flock`` on a file of its own for its whole life, and the kernel drops it when the process
dies; a rank that has waited a while tries a shared lock on each peer's file, and taking
one means that peer is gone. ``connect`` is called by every rank at once; the files are
unlinked once all have opened them, so nothing is left behind whatever ends the processes.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import tempfile
import time
import uuid

import torch

# Bytes of one rank's slot. Larger tensors (a long prompt's hidden states) go through gloo;
# a verify step's all fit.
DEFAULT_CAPACITY = 4 << 20
_LINE = 64                      # bytes: one counter a cache line, so ranks do not share one
_MAGIC = 0x5350454352415931     # written at the head of the segment by rank 0, read by the others
# A waiting rank spins this many times before it yields its core (and the GIL) each turn,
# and looks at its peers' locks and the clock every _CHECK_EVERY turns after that.
_SPINS = 2000
_CHECK_EVERY = 256


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def supported() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


class ShmCollective:
    """One rank's view of the segment; built by ``connect``."""

    def __init__(self, rank: int, size: int, capacity: int, mm: mmap.mmap, peer_locks: dict[int, int],
                 own_lock: int, timeout_s: float) -> None:
        self.rank, self.size, self.capacity, self.timeout_s = rank, size, capacity, timeout_s
        self._mm, self._peer_locks, self._own_lock = mm, peer_locks, own_lock
        self._counters = memoryview(mm).cast("q")
        self._data = torch.frombuffer(mm, dtype=torch.uint8)
        self._head = _head_bytes(size)
        self._seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.capacity

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place; the same bits on every rank."""
        slots = self._exchange(x)
        if self.size == 2:
            x.add_(slots[1 - self.rank])         # a + b == b + a exactly: both ranks agree
        else:
            acc = slots[0] + slots[1]
            for s in slots[2:]:
                acc += s
            x.copy_(acc)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[m, c] from every rank -> [m, size * c], rank order along the last dimension."""
        return torch.cat(self._exchange(x), dim=-1)

    def _slot(self, buffer: int, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = self._head + (buffer * self.size + rank) * self.capacity
        n = x.numel() * x.element_size()
        return self._data[start:start + n].view(x.dtype).view(x.shape)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._seq += 1
        seq, buffer = self._seq, self._seq % 2
        self._slot(buffer, self.rank, x).copy_(x)
        self._counters[(self.rank + 1) * _LINE // 8] = seq
        self._await(seq)
        return [self._slot(buffer, r, x) for r in range(self.size)]

    def _await(self, seq: int) -> None:
        counters, turns, deadline = self._counters, 0, None
        for peer in range(self.size):
            index = (peer + 1) * _LINE // 8
            while counters[index] < seq:
                turns += 1
                if turns < _SPINS:
                    continue
                time.sleep(0)
                if turns % _CHECK_EVERY:
                    continue
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                self._check_peers(seq)
                if now > deadline:
                    raise RuntimeError(f"tensor-parallel rank {self.rank}: rank {peer} did not reach collective "
                                       f"{seq} within {self.timeout_s:.0f} s")

    def _check_peers(self, seq: int) -> None:
        for peer, fd in self._peer_locks.items():
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                continue                         # still held: the peer lives
            fcntl.flock(fd, fcntl.LOCK_UN)
            raise RuntimeError(f"tensor-parallel rank {self.rank}: rank {peer} died before collective {seq}")

    def close(self) -> None:
        self._data = None
        self._counters.release()
        try:
            self._mm.close()
        except BufferError:
            pass                                 # a caller still holds a slot view: the mapping goes with it
        for fd in (*self._peer_locks.values(), self._own_lock):
            os.close(fd)


def _head_bytes(size: int) -> int:
    # The magic word, then one counter line a rank; data starts on a line of its own.
    return _LINE * (size + 1)


def _all_agree(store, step: str, rank: int, size: int, ok: bool) -> bool:
    """Publishes this rank's ``ok`` for ``step`` and waits for every rank's: True only if
    all said yes."""
    store.set(f"{step}/{rank}", b"1" if ok else b"0")
    return all(store.get(f"{step}/{r}") == b"1" for r in range(size)) and ok


def connect(store, rank: int, size: int, timeout_s: float, capacity: int = DEFAULT_CAPACITY) -> ShmCollective | None:
    """This rank's ``ShmCollective``, or None on every rank when any rank cannot map the
    segment rank 0 made (another host, another ``/dev/shm``) or the machine is not x86-64.
    Called by every rank of the group at once; ``store`` is the group's rendezvous."""
    ok = supported()
    directory = _directory()
    if rank == 0:
        name = os.path.join(directory, f"specray-tp-{uuid.uuid4().hex}") if ok else ""
        if ok:
            try:
                fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    # Reserved now, not on first touch: a tmpfs that runs out under a
                    # sparse file kills the process touching it (SIGBUS); here it is an
                    # OSError, and the group takes gloo.
                    os.posix_fallocate(fd, 0, _head_bytes(size) + 2 * size * capacity)
                    with mmap.mmap(fd, _LINE) as head:
                        head[:8] = _MAGIC.to_bytes(8, "little")
                finally:
                    os.close(fd)
            except OSError:
                if os.path.exists(name):
                    os.unlink(name)
                name = ""
        store.set("name", name)
    else:
        name = store.get("name").decode()
    ok = ok and bool(name)
    own_lock, mm, peer_locks = -1, None, {}
    try:
        if ok:
            try:
                own_lock = os.open(f"{name}.{rank}", os.O_CREAT | os.O_RDWR, 0o600)
                fcntl.flock(own_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fd = os.open(name, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, 0)
                finally:
                    os.close(fd)
                ok = int.from_bytes(mm[:8], "little") == _MAGIC
            except OSError:
                ok = False
        ok = _all_agree(store, "locked", rank, size, ok)
        if ok:
            try:
                peer_locks = {r: os.open(f"{name}.{r}", os.O_RDWR) for r in range(size) if r != rank}
            except OSError:
                ok = False
        ok = _all_agree(store, "ready", rank, size, ok)
    except BaseException:
        ok = False                        # a peer that never voted: the store's wait raised
        raise
    finally:
        # Every rank has opened what it needs, given up, or failed: the names can go.
        if name:
            for path in ([f"{name}.{rank}"] + ([name] if rank == 0 else [])):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if not ok:
            for fd in (*peer_locks.values(), own_lock):
                if fd >= 0:
                    os.close(fd)
            if mm is not None:
                mm.close()
    if not ok:
        return None
    return ShmCollective(rank, size, capacity, mm, peer_locks, own_lock, timeout_s)
