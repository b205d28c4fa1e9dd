"""Step messages between the driver and its workers, and their msgpack codec.

A step is data in, data out::

    StepPlan (driver -> draft worker)  ->  Proposals (draft -> driver)
    StepPlan (driver -> target worker) ->  StepResult (target -> driver)

Integer and float arrays travel as little-endian packed bytes (int32 for token ids and
counts, int64 for ids and seeds, float64 for sampling knobs, float32 for logprobs, which
the target computes in float32): packing a 64-sequence step
that way costs microseconds, where Python lists cost a hundred. Tensors (draft
probabilities) never go through here. Replies carry the worker's own time on the call,
so the driver can tell messaging from compute. Decoding is strict: the protocol version, the
message type, every field's type and every cross-field length are checked, and anything
else raises ``ProtocolError`` (a ``ValueError``).
"""

from __future__ import annotations

import math
import sys
from array import array
from dataclasses import dataclass, field, fields

import msgpack

from specray.scheduler.sampling_params import MAX_LOGPROBS

PROTOCOL_VERSION = 8
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# A ``StepPlan.draft_rows`` (and ``Proposals.prob_rows``) entry: this sequence's proposals
# are made in the target worker's process, in its verify call, by the proposer that runs
# there (an EAGLE head, ``specray.workers.in_target_head``); the plan carries their
# ``proposal_lens`` and -1 tokens.
IN_TARGET_ROW = -2


class ProtocolError(ValueError):
    """A step message that is malformed, of another version, or too large."""


def _packed(code: str):
    return field(default_factory=list, metadata={"pack": code})


def _scalar(kind: type, default):
    return field(default=default, metadata={"scalar": kind})


@dataclass
class StepPlan:
    """One step's work for one worker, per sequence in batch order (the words are
    ``specray.scheduler``'s glossary).

    ``token_ids`` holds, back to back, the ``num_new[i]`` tokens each sequence feeds
    (``tokens[num_computed:]``). ``num_slots[i]`` is the KV slot count the worker's pool
    must hold for the sequence after this step, exactly as the driver's mirror of that
    pool reserved it. ``proposal_lens[i]``: what the sequence proposes this step (a draft
    plan: how many to make; a target plan: how many ``proposal_token_ids`` to verify).
    For the target, ``proposal_token_ids`` is ``[n, width]`` flattened with ``-1`` padding
    past ``proposal_lens[i]``, and ``draft_rows[i]`` is the sequence's row in the draft
    probabilities (``-1``: a deterministic proposal, e.g. n-gram; ``IN_TARGET_ROW``: made in
    the target worker's verify call). ``logprobs[i]`` (target
    plans; empty: no sequence asked): ``-1`` for none, else how many top alternatives each
    emitted token's logprob comes with (``SamplingParams.logprobs``).

    Structured output (empty lists: no sequence of the plan is constrained):
    ``grammar_lens[i]`` bytes of ``grammar_bytes`` hold sequence i's
    ``StructuredOutput.key`` (UTF-8; 0: unconstrained), and ``output_lens[i]`` tokens of
    ``output_token_ids`` its output so far (``tokens[prompt_len:step_len]``; 0 where
    unconstrained): what the worker's matcher for it must have consumed before this step
    (``specray.workers.grammar``), whatever the worker held before.
    """

    step_id: int = _scalar(int, 0)
    width: int = _scalar(int, 0)
    seq_ids: list[int] = _packed("q")
    num_computed: list[int] = _packed("i")
    num_new: list[int] = _packed("i")
    token_ids: list[int] = _packed("i")
    num_slots: list[int] = _packed("i")
    proposal_lens: list[int] = _packed("i")
    proposal_token_ids: list[int] = _packed("i")
    draft_rows: list[int] = _packed("i")
    temperature: list[float] = _packed("d")
    top_k: list[int] = _packed("i")
    top_p: list[float] = _packed("d")
    seeds: list[int] = _packed("q")
    logprobs: list[int] = _packed("i")
    free_seq_ids: list[int] = _packed("q")
    grammar_lens: list[int] = _packed("i")
    grammar_bytes: list[int] = _packed("B")
    output_lens: list[int] = _packed("i")
    output_token_ids: list[int] = _packed("i")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    def validate(self) -> None:
        n = len(self.seq_ids)
        for name in ("num_computed", "num_new", "num_slots", "proposal_lens",
                     "temperature", "top_k", "top_p", "seeds"):
            _expect(len(getattr(self, name)) == n,
                    f"StepPlan.{name} has {len(getattr(self, name))} entries for {n} sequences")
        _expect(self.width >= 0, f"StepPlan.width must be >= 0, got {self.width}")
        _expect(sum(self.num_new) == len(self.token_ids),
                f"StepPlan.token_ids has {len(self.token_ids)} tokens, num_new sums to {sum(self.num_new)}")
        _expect(len(set(self.seq_ids)) == n, "StepPlan.seq_ids repeats a sequence")
        _expect(all(c >= 0 for c in self.num_computed), "StepPlan.num_computed is negative")
        _expect(all(c >= 0 for c in self.num_new), "StepPlan.num_new is negative")
        _expect(all(0 <= x <= self.width for x in self.proposal_lens), "StepPlan.proposal_lens outside [0, width]")
        if self.proposal_token_ids or self.draft_rows:
            _expect(len(self.proposal_token_ids) == n * self.width,
                    f"StepPlan.proposal_token_ids has {len(self.proposal_token_ids)} entries, "
                    f"expected {n * self.width}")
            _expect(len(self.draft_rows) == n, "StepPlan.draft_rows does not match seq_ids")
        for i in range(n):
            _expect(self.num_slots[i] >= self.num_computed[i] + self.num_new[i],
                    f"StepPlan.num_slots[{i}] cannot hold the fed tokens")
        _expect(all(0.0 <= t < float("inf") for t in self.temperature), "StepPlan.temperature must be finite and >= 0")
        _expect(all(0.0 < p <= 1.0 for p in self.top_p), "StepPlan.top_p must be in (0, 1]")
        _expect(all(x >= 0 for x in self.top_k), "StepPlan.top_k must be >= 0")
        _expect(all(r >= IN_TARGET_ROW for r in self.draft_rows), f"StepPlan.draft_rows must be >= {IN_TARGET_ROW}")
        _expect(len(self.logprobs) in (0, n), "StepPlan.logprobs does not match seq_ids")
        _expect(all(-1 <= x <= MAX_LOGPROBS for x in self.logprobs),
                f"StepPlan.logprobs must be in [-1, {MAX_LOGPROBS}]")
        _expect(len(self.grammar_lens) in (0, n), "StepPlan.grammar_lens does not match seq_ids")
        _expect(len(self.output_lens) == len(self.grammar_lens), "StepPlan.output_lens does not match grammar_lens")
        _expect(all(x >= 0 for x in self.grammar_lens) and sum(self.grammar_lens) == len(self.grammar_bytes),
                "StepPlan.grammar_bytes does not match grammar_lens")
        _expect(all(x >= 0 for x in self.output_lens) and sum(self.output_lens) == len(self.output_token_ids),
                "StepPlan.output_token_ids does not match output_lens")


@dataclass
class Proposals:
    """Draft tokens for the sequences of one draft plan: ``token_ids`` is ``[n, width]``
    flattened, ``-1`` past ``proposal_lens[i]`` (which may be shorter than planned where a
    proposer finds nothing to propose). ``scores`` (empty: not stated) is, per sequence,
    how many of its proposals the proposer expects to be accepted (suffix decoding's path
    chances; ``specray.scheduler.proposal_choice``)."""

    step_id: int = _scalar(int, 0)
    width: int = _scalar(int, 0)
    has_probs: bool = _scalar(bool, False)
    compute_s: float = _scalar(float, 0.0)   # the worker's own time on the call
    seq_ids: list[int] = _packed("q")
    proposal_lens: list[int] = _packed("i")
    token_ids: list[int] = _packed("i")
    # Where each sequence's draft probabilities sit in the probabilities sent with these
    # proposals (empty: row i is sequence i's) and how many rows those hold (0: n): a
    # window taken from a pre-draft points into the pre-draft's rows; -1: this row's
    # proposal has none (one-hot: another proposer's, chosen in a merge); IN_TARGET_ROW:
    # the target makes it.
    prob_rows: list[int] = _packed("i")
    num_prob_rows: int = _scalar(int, 0)
    scores: list[float] = _packed("d")
    mask_s: float = _scalar(float, 0.0)      # of compute_s: structured output's masks on the host

    def validate(self) -> None:
        n = len(self.seq_ids)
        _expect(self.width >= 0, f"Proposals.width must be >= 0, got {self.width}")
        _expect(len(self.prob_rows) in (0, n), "Proposals.prob_rows does not match seq_ids")
        _expect(all(IN_TARGET_ROW <= r < max(self.num_prob_rows, n) for r in self.prob_rows),
                "Proposals.prob_rows outside the probabilities' rows")
        _expect(len(self.proposal_lens) == n, "Proposals.proposal_lens does not match seq_ids")
        _expect(len(self.token_ids) == n * self.width,
                f"Proposals.token_ids has {len(self.token_ids)} entries, expected {n * self.width}")
        _expect(all(0 <= x <= self.width for x in self.proposal_lens), "Proposals.proposal_lens outside [0, width]")
        _expect(0.0 <= self.compute_s < float("inf"), "Proposals.compute_s must be finite and >= 0")
        _expect(len(self.scores) in (0, n), "Proposals.scores does not match seq_ids")
        _expect(all(0.0 <= x < float("inf") for x in self.scores), "Proposals.scores must be finite and >= 0")


@dataclass
class StepResult:
    """What the target verified and emitted this step, per sequence: ``proposed[i]``
    proposals verified, ``num_emitted[i]`` = accepted + 1 tokens emitted, back to back in
    ``token_ids``.

    Logprobs, for the sequences whose plan asked (``StepPlan.logprobs``): ``num_top[i]``
    is ``-1`` where sequence i has none (empty: none has), else how many alternatives each
    of its emitted tokens comes with. ``logprobs`` holds one figure per emitted token of
    those sequences, back to back in ``token_ids`` order; ``top_ids`` / ``top_logprobs``
    hold ``num_top[i]`` alternatives per such token, most likely first."""

    step_id: int = _scalar(int, 0)
    compute_s: float = _scalar(float, 0.0)   # the worker's own time on the call
    seq_ids: list[int] = _packed("q")
    proposed: list[int] = _packed("i")
    num_emitted: list[int] = _packed("i")
    token_ids: list[int] = _packed("i")
    num_top: list[int] = _packed("i")
    logprobs: list[float] = _packed("f")
    top_ids: list[int] = _packed("i")
    top_logprobs: list[float] = _packed("f")
    mask_s: float = _scalar(float, 0.0)      # of compute_s: structured output's masks on the host

    def validate(self) -> None:
        _expect(len(self.num_emitted) == len(self.seq_ids), "StepResult.num_emitted does not match seq_ids")
        _expect(len(self.proposed) == len(self.seq_ids), "StepResult.proposed does not match seq_ids")
        _expect(all(x >= 1 for x in self.num_emitted), "StepResult.num_emitted must be >= 1")
        _expect(all(1 <= e <= p + 1 for p, e in zip(self.proposed, self.num_emitted)),
                "StepResult.num_emitted must be in [1, proposed + 1]")
        _expect(sum(self.num_emitted) == len(self.token_ids), "StepResult.token_ids does not match num_emitted")
        _expect(0.0 <= self.compute_s < float("inf"), "StepResult.compute_s must be finite and >= 0")
        _expect(len(self.num_top) in (0, len(self.seq_ids)), "StepResult.num_top does not match seq_ids")
        _expect(all(-1 <= x <= MAX_LOGPROBS for x in self.num_top),
                f"StepResult.num_top must be in [-1, {MAX_LOGPROBS}]")
        tokens = sum(e for e, x in zip(self.num_emitted, self.num_top) if x >= 0)
        top = sum(e * x for e, x in zip(self.num_emitted, self.num_top) if x >= 0)
        _expect(len(self.logprobs) == tokens,
                f"StepResult.logprobs has {len(self.logprobs)} entries, num_top and num_emitted say {tokens}")
        _expect(len(self.top_ids) == top, f"StepResult.top_ids has {len(self.top_ids)} entries, expected {top}")
        _expect(len(self.top_logprobs) == top,
                f"StepResult.top_logprobs has {len(self.top_logprobs)} entries, expected {top}")
        _expect(all(t >= 0 for t in self.top_ids), "StepResult.top_ids must be >= 0")
        _expect(not any(map(math.isnan, self.logprobs)) and not any(map(math.isnan, self.top_logprobs)),
                "StepResult.logprobs and top_logprobs must not be NaN")


@dataclass
class Predraft:
    """Windows a draft worker drafted ahead, while the target verified the window it had
    just proposed: one branch per likely outcome of that verification. Branch ``b`` is for
    sequence ``seq_ids[b]`` and holds if the sequence's next draft plan has
    ``num_computed == num_computed[b]`` and feeds exactly its ``fed_lens[b]`` tokens of
    ``fed_token_ids`` (the accepted proposals' tail and a guess of the target's next token);
    its ``proposal_lens[b]`` proposals are then the ones the draft would make there
    (``token_ids``: ``[B, width]`` flattened, -1 padded). When ``has_probs``, the draft
    probabilities travel beside it as one ``[B, width, V]`` tensor."""

    step_id: int = _scalar(int, 0)
    width: int = _scalar(int, 0)
    has_probs: bool = _scalar(bool, False)
    compute_s: float = _scalar(float, 0.0)
    seq_ids: list[int] = _packed("q")
    num_computed: list[int] = _packed("i")
    fed_lens: list[int] = _packed("i")
    fed_token_ids: list[int] = _packed("i")
    proposal_lens: list[int] = _packed("i")
    token_ids: list[int] = _packed("i")

    @property
    def num_branches(self) -> int:
        return len(self.seq_ids)

    def validate(self) -> None:
        b = len(self.seq_ids)
        _expect(self.width >= 0, f"Predraft.width must be >= 0, got {self.width}")
        for name in ("num_computed", "fed_lens", "proposal_lens"):
            _expect(len(getattr(self, name)) == b, f"Predraft.{name} has {len(getattr(self, name))} entries for {b}")
        _expect(all(x >= 1 for x in self.fed_lens), "Predraft.fed_lens must be >= 1")
        _expect(sum(self.fed_lens) == len(self.fed_token_ids), "Predraft.fed_token_ids does not match fed_lens")
        _expect(all(x >= 0 for x in self.num_computed), "Predraft.num_computed is negative")
        _expect(all(0 <= x <= self.width for x in self.proposal_lens), "Predraft.proposal_lens outside [0, width]")
        _expect(len(self.token_ids) == b * self.width, f"Predraft.token_ids has {len(self.token_ids)} entries, "
                                                       f"expected {b * self.width}")
        _expect(0.0 <= self.compute_s < float("inf"), "Predraft.compute_s must be finite and >= 0")


MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in (StepPlan, Proposals, StepResult, Predraft)}
_LITTLE = sys.byteorder == "little"


def encode(msg) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGE_TYPES:
        raise TypeError(f"not a step message: {name}")
    values = []
    for f in fields(msg):
        value = getattr(msg, f.name)
        code = f.metadata.get("pack")
        if code is None:
            values.append(value)
            continue
        arr = array(code, value)
        if not _LITTLE:
            arr.byteswap()
        values.append(arr.tobytes())
    return msgpack.packb([PROTOCOL_VERSION, name, values], use_bin_type=True)


def decode(data: bytes, expected: type | None = None, max_bytes: int = MAX_MESSAGE_BYTES,
           validate: bool = True):
    """Decode and validate one message; only ``ProtocolError`` escapes. ``validate=False``
    skips only the cross-field checks, for a receiver that runs them itself."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True,
            max_bin_len=max_bytes, max_str_len=64,
            max_array_len=64, max_map_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ProtocolError("message must be [version, type, fields]")
    version, name, values = obj
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {name!r}")
    if expected is not None and cls is not expected:
        raise ProtocolError(f"expected {expected.__name__}, got {name}")
    fs = fields(cls)
    if not isinstance(values, list) or len(values) != len(fs):
        raise ProtocolError(f"{name} needs {len(fs)} fields")
    kwargs = {}
    for f, value in zip(fs, values):
        code = f.metadata.get("pack")
        if code is None:
            kind = f.metadata["scalar"]
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if not ok:
                raise ProtocolError(f"{name}.{f.name} must be {kind.__name__}, got {type(value).__name__}")
            kwargs[f.name] = value
            continue
        if not isinstance(value, bytes):
            raise ProtocolError(f"{name}.{f.name} must be packed bytes, got {type(value).__name__}")
        arr = array(code)
        if len(value) % arr.itemsize:
            raise ProtocolError(f"{name}.{f.name} is {len(value)} bytes, not a multiple of {arr.itemsize}")
        arr.frombytes(value)
        if not _LITTLE:
            arr.byteswap()
        kwargs[f.name] = arr.tolist()
    msg = cls(**kwargs)
    if validate:
        msg.validate()
    return msg


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError(what)
