"""What travels on a worker link (``worker_link``) once it is open, and the bounds a reader
holds it to before it allocates anything.

A call is one frame, ``[op, data, arg, specs]`` in msgpack, then each tensor's raw bytes;
a reply is one frame, ``[status, message, *spec]``, then its tensor's bytes. A frame is a
u64 length and that many bytes::

    | len (8, little-endian) | msgpack header (len bytes) | tensor 0 | tensor 1 | ...

A frame is at most the control-message limit (``MAX_MESSAGE_BYTES``); a tensor's spec
``[dtype, shape, nbytes]`` names a dtype on the allowlist (the dtypes probabilities
travel in), its shape times the element size is its byte count, and one frame's tensors
hold at most ``MAX_TENSOR_BYTES``. A reader that finds any of these broken raises
``LinkProtocolError`` before reading on; the sender checks the same bounds first, so a
call that would break them fails on its own with that error (a ``ValueError``) and the
link stays open.
"""

from __future__ import annotations

import math
import socket
import struct

import msgpack

from specray.scheduler.messages import MAX_MESSAGE_BYTES

_LEN = struct.Struct("<Q")
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
# Draft probabilities are [n, k, V] float32: 256 sequences, k 8 and a 262144-token
# vocabulary (the largest in use) make 2 GiB. Four times that leaves room for larger
# batches and still refuses a length no step can have.
MAX_TENSOR_BYTES = 8 << 30
MAX_TENSORS = 1024
MAX_NDIM = 8
# Element sizes of the dtypes probabilities travel in; nothing else is ever sent.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class LinkLost(Exception):
    """The worker behind a link died, or answered from an empty restart."""


class LinkProtocolError(ValueError):
    """A frame or a tensor spec outside the link's bounds, or a header that does not decode."""


def recv_exact(sock: socket.socket, buf) -> None:
    """Fills ``buf`` from ``sock``; ``LinkLost`` if the peer closes first."""
    view, got = memoryview(buf), 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise LinkLost("the peer closed the link")
        got += n


def recv_frame(sock: socket.socket) -> bytes:
    head = bytearray(_LEN.size)
    recv_exact(sock, head)
    size = _LEN.unpack(head)[0]
    if size > MAX_FRAME_BYTES:
        raise LinkProtocolError(f"a frame of {size} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    body = bytearray(size)
    recv_exact(sock, body)
    return bytes(body)


def pack_frame(header: list) -> bytes:
    """``header`` as a frame, length first; ``LinkProtocolError`` if it is over the limit."""
    payload = msgpack.packb(header, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise LinkProtocolError(f"a frame of {len(payload)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    return _LEN.pack(len(payload)) + payload


def unpack_header(frame: bytes) -> list:
    """A frame's header: a msgpack list, nothing after it, no maps or extension types."""
    try:
        header = msgpack.unpackb(frame, raw=False, use_list=True, max_map_len=0, max_ext_len=0)
    except Exception as e:   # noqa: BLE001 - msgpack raises several unrelated types for bad input
        raise LinkProtocolError(f"undecodable header: {type(e).__name__}: {e}") from None
    if not isinstance(header, list):
        raise LinkProtocolError(f"a header must be a list, got {type(header).__name__}")
    return header


def spec(t) -> list:
    """What a tensor's header says of it, checked against the bounds: dtype, shape, bytes."""
    return check_spec([str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()])


def check_spec(s) -> list:
    """``s`` as ``[dtype, shape, nbytes]`` within the bounds, or ``LinkProtocolError``."""
    if not (isinstance(s, list) and len(s) == 3):
        raise LinkProtocolError(f"a tensor spec must be [dtype, shape, nbytes], got {s!r:.80}")
    dtype, shape, nbytes = s
    if dtype not in DTYPE_BYTES:
        raise LinkProtocolError(f"tensor dtype {dtype!r:.40} is not one of {sorted(DTYPE_BYTES)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape)):
        raise LinkProtocolError(f"tensor shape must be at most {MAX_NDIM} sizes >= 0, got {shape!r:.80}")
    # Sizes past a zero count too: torch cannot lay out an empty tensor whose strides overflow.
    extent = math.prod(max(d, 1) for d in shape) * DTYPE_BYTES[dtype]
    if extent > MAX_TENSOR_BYTES:
        raise LinkProtocolError(f"a {dtype} tensor of shape {shape!r:.80} exceeds the limit of "
                                f"{MAX_TENSOR_BYTES} bytes")
    size = math.prod(shape) * DTYPE_BYTES[dtype]
    if type(nbytes) is not int or nbytes != size:
        raise LinkProtocolError(f"a {dtype} tensor of shape {shape} is {size} bytes, the spec says {nbytes!r:.40}")
    return s


def check_specs(specs) -> list:
    """A frame's tensor specs, each within the bounds and together at most ``MAX_TENSOR_BYTES``."""
    if not (isinstance(specs, list) and len(specs) <= MAX_TENSORS):
        raise LinkProtocolError(f"tensor specs must be a list of at most {MAX_TENSORS}")
    total = sum(check_spec(s)[2] for s in specs)
    if total > MAX_TENSOR_BYTES:
        raise LinkProtocolError(f"tensors of {total} bytes in one frame exceed the limit of {MAX_TENSOR_BYTES}")
    return specs


def tensor_bytes(t) -> memoryview:
    """The tensor's memory as bytes, whatever its dtype (bfloat16 has no numpy view)."""
    import torch

    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def send_tensors(sock: socket.socket, tensors) -> None:
    for t in tensors:
        if t.numel():
            sock.sendall(tensor_bytes(t))


def recv_tensor(sock: socket.socket, s: list):
    """The tensor ``s`` (a spec ``check_spec`` passed) describes, read straight into its memory."""
    import torch

    dtype, shape, nbytes = s
    if not nbytes:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    buf = bytearray(nbytes)
    recv_exact(sock, buf)
    return torch.frombuffer(buf, dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)
