"""Step messages: round trips, strict decoding (only ProtocolError escapes), size."""

from __future__ import annotations

import math
import random
from dataclasses import fields

import msgpack
import pytest

from specray.scheduler.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Proposals,
    ProtocolError,
    StepPlan,
    StepResult,
    decode,
    encode,
)

ITEMSIZE = {"i": 4, "q": 8, "d": 8, "f": 4, "B": 1}
INT64_MAX = 2**63 - 1


def make_plan(n: int = 5, k: int = 3, seed: int = 0, with_proposals: bool = True) -> StepPlan:
    rng = random.Random(seed)
    p = StepPlan(step_id=2**31 + 17, width=k, free_seq_ids=[2**40 + 3, 9, INT64_MAX])
    for i in range(n):
        computed = rng.randrange(0, 3000)
        new = rng.randrange(1, 6)
        p.seq_ids.append(2**33 + 1000 * i + rng.randrange(1000))
        p.num_computed.append(computed)
        p.num_new.append(new)
        p.token_ids.extend(rng.randrange(0, 151_936) for _ in range(new))
        p.num_slots.append(computed + new + k + rng.randrange(0, 2))
        p.proposal_lens.append(rng.randrange(0, k + 1))
        p.temperature.append(rng.choice([0.0, 0.7, 1.3, 1e-3]))
        p.top_k.append(rng.choice([0, 1, 50]))
        p.top_p.append(rng.choice([1.0, 0.95, 0.123456789]))
        p.seeds.append(rng.choice([0, INT64_MAX, INT64_MAX - 1, rng.getrandbits(63)]))
        p.logprobs.append(rng.choice([-1, 0, 5, 20]))
    if with_proposals:
        for i in range(n):
            row = [rng.randrange(0, 151_936) for _ in range(p.proposal_lens[i])]
            p.proposal_token_ids.extend(row + [-1] * (k - len(row)))
            p.draft_rows.append(i if p.proposal_lens[i] else -1)
    return p


def make_proposals(n: int = 4, k: int = 4) -> Proposals:
    lens = [k, 0, 2, 1][:n] + [k] * max(0, n - 4)
    toks = []
    for i, m in enumerate(lens):
        toks.extend([100 * i + j for j in range(m)] + [-1] * (k - m))
    return Proposals(step_id=7, width=k, has_probs=True, compute_s=0.0123, seq_ids=[2**35 + i for i in range(n)],
                     proposal_lens=lens, token_ids=toks)


def make_result() -> StepResult:
    return StepResult(step_id=INT64_MAX, compute_s=1e-4, seq_ids=[2**32, 5, 2**62], proposed=[0, 4, 3],
                      num_emitted=[1, 4, 2],
                      token_ids=[0, 151_935, 2**31 - 1, 3, 4, 5, 6])


def make_logprob_result() -> StepResult:
    """Sequence 0 asked for none, 1 for its tokens' own (0 alternatives), 2 for two."""
    r = make_result()
    r.num_top = [-1, 0, 2]
    r.logprobs = [-0.5, -1.25, -3.0, -0.0, -0.125, -2.5]          # 4 + 2 tokens; float32-exact
    r.top_ids = [6, 5, 151_935, 9]
    r.top_logprobs = [-0.125, -1.0, -2.5, -float("inf")]
    return r


VALID = [make_plan(), make_plan(n=1, k=0, with_proposals=False), make_plan(n=0),
         StepPlan(), make_proposals(), Proposals(), make_result(), StepResult(), make_logprob_result()]


def raw(msg) -> list:
    """The decoded-but-unvalidated [version, name, values] form of a message."""
    return msgpack.unpackb(encode(msg), raw=False)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def packed_field(code: str, values) -> bytes:
    import struct
    return struct.pack("<" + code * len(values), *values)


# -- round trips ------------------------------------------------------------------------

@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert decode(data, expected=type(msg)) == msg
    assert decode(bytearray(data)) == msg
    assert decode(memoryview(data)) == msg


def test_round_trip_preserves_extremes_exactly():
    p = make_plan()
    p.seeds[0] = INT64_MAX
    p.seq_ids[0] = 2**63 - 2
    p.temperature[0] = 0.1 + 0.2          # not representable in float32
    p.top_p[0] = math.nextafter(1.0, 0.0)
    back = decode(encode(p))
    assert back.seeds[0] == INT64_MAX
    assert back.seq_ids[0] == 2**63 - 2
    assert back.temperature[0] == 0.1 + 0.2
    assert back.top_p[0] == math.nextafter(1.0, 0.0)
    assert all(type(x) is int for x in back.seq_ids + back.seeds + back.token_ids)
    assert all(type(x) is float for x in back.temperature + back.top_p)


def test_packed_fields_are_little_endian_fixed_width():
    p = make_plan(n=3)
    version, name, values = raw(p)
    assert (version, name) == (PROTOCOL_VERSION, "StepPlan")
    for f, v in zip(fields(StepPlan), values):
        code = f.metadata.get("pack")
        if code is None:
            assert v == getattr(p, f.name)
        else:
            assert v == packed_field(code, getattr(p, f.name)), f.name


def test_encode_rejects_non_messages():
    with pytest.raises(TypeError):
        encode({"step_id": 1})
    with pytest.raises(TypeError):
        encode([1, "StepPlan", []])


# -- malformed input: only ProtocolError --------------------------------------------------

def assert_protocol_error(data, *args, match: str | None = None, **kw):
    with pytest.raises(ProtocolError, match=match) as info:
        decode(data, *args, **kw)
    assert isinstance(info.value, ValueError)
    return info.value


def test_protocol_error_is_a_value_error():
    assert issubclass(ProtocolError, ValueError)


@pytest.mark.parametrize("msg", VALID[:1] + VALID[4:5] + VALID[6:7], ids=lambda m: type(m).__name__)
def test_every_truncation_is_rejected(msg):
    data = encode(msg)
    for cut in range(len(data)):
        assert_protocol_error(data[:cut])


def test_trailing_bytes_are_rejected():
    assert_protocol_error(encode(make_result()) + b"\x00")


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, -1, 2**40, str(PROTOCOL_VERSION),
                                     None, True, [PROTOCOL_VERSION], bytes([PROTOCOL_VERSION])])
def test_wrong_protocol_version(version):
    obj = raw(make_result())
    obj[0] = version
    assert_protocol_error(pack(obj), match="version")


def test_float_protocol_version_is_rejected():
    obj = raw(make_result())
    obj[0] = 4.0
    assert_protocol_error(pack(obj), match="version")


@pytest.mark.parametrize("name", ["StepPlanX", "stepplan", "", "ProtocolError", 3, None, b"StepPlan"])
def test_unknown_type_name(name):
    obj = raw(make_result())
    obj[1] = name
    assert_protocol_error(pack(obj), match="type")


@pytest.mark.parametrize("outer", [[], [1], [1, "StepResult"], [1, "StepResult", [], 0],
                                   "StepResult", 1, None, {}])
def test_wrong_outer_shape(outer):
    assert_protocol_error(pack(outer))


@pytest.mark.parametrize("msg", [make_plan(), make_proposals(), make_result()], ids=lambda m: type(m).__name__)
def test_wrong_field_count(msg):
    version, name, values = raw(msg)
    assert_protocol_error(pack([version, name, values[:-1]]), match="fields")
    assert_protocol_error(pack([version, name, values + [b""]]), match="fields")
    assert_protocol_error(pack([version, name, []]), match="fields")
    assert_protocol_error(pack([version, name, b"".join(v for v in values if isinstance(v, bytes))]))


def field_index(cls, name: str) -> int:
    return [f.name for f in fields(cls)].index(name)


@pytest.mark.parametrize("cls,name,value", [
    (StepPlan, "step_id", "1"),          # str where int
    (StepPlan, "width", True),           # bool where int
    (StepPlan, "width", 3.0),            # float where int
    (StepPlan, "step_id", None),
    (StepPlan, "step_id", b"\x01"),
    (StepPlan, "seq_ids", 5),            # int where packed bytes
    (StepPlan, "token_ids", [1, 2, 3]),  # plain list where packed bytes
    (StepPlan, "temperature", "0.5"),
    (StepPlan, "seeds", None),
    (Proposals, "has_probs", 1),         # int where bool
    (Proposals, "has_probs", "true"),
    (Proposals, "width", False),
    (Proposals, "token_ids", 0),
    (StepResult, "step_id", 1.5),
    (StepResult, "compute_s", 1),        # int where float
    (Proposals, "compute_s", None),
    (StepResult, "num_emitted", [1]),
    (StepResult, "token_ids", "abc"),
])
def test_wrong_field_type(cls, name, value):
    msg = {StepPlan: make_plan, Proposals: make_proposals, StepResult: make_result}[cls]()
    obj = raw(msg)
    obj[2][field_index(cls, name)] = value
    assert_protocol_error(pack(obj), match=name)


@pytest.mark.parametrize("cls,name", [(StepPlan, "seq_ids"), (StepPlan, "token_ids"),
                                      (StepPlan, "temperature"), (Proposals, "token_ids"),
                                      (StepResult, "num_emitted")])
@pytest.mark.parametrize("extra", [1, 3, 7])
def test_packed_length_not_a_multiple_of_item_size(cls, name, extra):
    msg = {StepPlan: make_plan, Proposals: make_proposals, StepResult: make_result}[cls]()
    obj = raw(msg)
    i = field_index(cls, name)
    obj[2][i] = obj[2][i] + b"\x00" * extra
    assert_protocol_error(pack(obj), match="multiple")


def with_field(msg, **changes) -> bytes:
    obj = raw(msg)
    for name, values in changes.items():
        f = next(f for f in fields(type(msg)) if f.name == name)
        code = f.metadata.get("pack")
        obj[2][field_index(type(msg), name)] = values if code is None else packed_field(code, values)
    return pack(obj)


def test_inconsistent_plan_lengths():
    p = make_plan(n=4, k=3)
    assert_protocol_error(with_field(p, token_ids=p.token_ids + [1]), match="num_new")
    assert_protocol_error(with_field(p, token_ids=p.token_ids[:-1]), match="num_new")
    assert_protocol_error(with_field(p, proposal_token_ids=p.proposal_token_ids[:-1]), match="proposal_token_ids")
    assert_protocol_error(with_field(p, proposal_token_ids=p.proposal_token_ids + [-1] * 3),
                          match="proposal_token_ids")
    assert_protocol_error(with_field(p, seq_ids=[p.seq_ids[0]] * 4), match="repeats")
    assert_protocol_error(with_field(p, seq_ids=p.seq_ids[:3]))
    assert_protocol_error(with_field(p, draft_rows=p.draft_rows[:3]), match="draft_rows")
    for name in ("num_computed", "num_slots", "proposal_lens", "temperature", "top_k", "top_p", "seeds"):
        assert_protocol_error(with_field(p, **{name: getattr(p, name)[:3]}), match=name)
    assert_protocol_error(with_field(p, width=-1, proposal_token_ids=[]), match="width")
    assert_protocol_error(with_field(p, proposal_lens=[4, 0, 0, 0]), match="proposal_lens")
    assert_protocol_error(with_field(p, proposal_lens=[-1, 0, 0, 0]), match="proposal_lens")
    assert_protocol_error(with_field(p, num_slots=[0] * 4), match="num_slots")
    assert_protocol_error(with_field(p, num_computed=[-1] + p.num_computed[1:]), match="negative")
    neg = list(p.num_new)
    neg[0], neg[1] = -1, neg[1] + neg[0] + 1   # sum unchanged
    assert_protocol_error(with_field(p, num_new=neg), match="negative")


def test_inconsistent_logprob_fields():
    p = make_plan(n=4, k=3)
    assert_protocol_error(with_field(p, logprobs=p.logprobs[:3]), match="logprobs")
    assert_protocol_error(with_field(p, logprobs=[-2, 0, 0, 0]), match="logprobs")
    assert_protocol_error(with_field(p, logprobs=[21, 0, 0, 0]), match="logprobs")
    assert decode(with_field(p, logprobs=[]), StepPlan).logprobs == []      # nobody asked
    r = make_logprob_result()
    assert_protocol_error(with_field(r, num_top=[-1, 0]), match="num_top")
    assert_protocol_error(with_field(r, num_top=[-1, 0, 21]), match="num_top")
    assert_protocol_error(with_field(r, num_top=[0, 0, 2]), match="logprobs")       # sequence 0's token too
    assert_protocol_error(with_field(r, logprobs=r.logprobs[:-1]), match="logprobs")
    assert_protocol_error(with_field(r, top_ids=r.top_ids + [1]), match="top_ids")
    assert_protocol_error(with_field(r, top_logprobs=r.top_logprobs[:-1]), match="top_logprobs")
    assert_protocol_error(with_field(r, top_ids=[-1, 5, 6, 9]), match="top_ids")
    assert_protocol_error(with_field(r, num_top=[], logprobs=[], top_ids=[]), match="top_logprobs")
    assert_protocol_error(with_field(r, top_logprobs=[-1.0, math.nan, -2.0, -3.0]), match="NaN")


def test_negative_proposals_width_is_rejected():
    assert_protocol_error(with_field(Proposals(), width=-1), match="width")


def test_inconsistent_proposals_and_result_lengths():
    q = make_proposals()
    assert_protocol_error(with_field(q, token_ids=q.token_ids[:-1]), match="token_ids")
    assert_protocol_error(with_field(q, proposal_lens=q.proposal_lens[:-1]), match="proposal_lens")
    assert_protocol_error(with_field(q, proposal_lens=[5, 0, 0, 0]), match="proposal_lens")
    assert_protocol_error(with_field(q, width=3), match="token_ids")
    r = make_result()
    assert_protocol_error(with_field(r, token_ids=r.token_ids[:-1]), match="num_emitted")
    assert_protocol_error(with_field(r, num_emitted=[1, 4]), match="num_emitted")
    assert_protocol_error(with_field(r, num_emitted=[0, 5, 2]), match="num_emitted")
    assert_protocol_error(with_field(r, proposed=[0, 4]), match="StepResult.proposed")
    # more emitted than proposed + 1: the target cannot accept what was not proposed
    assert_protocol_error(with_field(r, proposed=[0, 2, 3]), match=r"proposed \+ 1")
    for bad in (-1.0, float("inf"), float("nan")):
        assert_protocol_error(with_field(r, compute_s=bad), match="compute_s")
        assert_protocol_error(with_field(q, compute_s=bad), match="compute_s")


def test_decode_without_validation_skips_only_the_cross_field_checks():
    """Workers decode plans this way and validate them themselves, once."""
    p = make_plan(n=4, k=3)
    inconsistent = with_field(p, seq_ids=[p.seq_ids[0]] * 4)
    assert decode(inconsistent, StepPlan, validate=False).seq_ids == [p.seq_ids[0]] * 4
    assert_protocol_error(inconsistent, expected=StepPlan, match="repeats")
    obj = raw(p)
    obj[2][field_index(StepPlan, "width")] = "3"
    with pytest.raises(ProtocolError, match="width"):
        decode(pack(obj), StepPlan, validate=False)


@pytest.mark.parametrize("msg", [make_plan(), make_proposals(), make_result()], ids=lambda m: type(m).__name__)
def test_decode_with_another_expected_type(msg):
    data = encode(msg)
    for other in (StepPlan, Proposals, StepResult):
        if other is not type(msg):
            assert_protocol_error(data, expected=other, match=other.__name__)


def test_oversize_is_rejected_before_parsing():
    data = encode(make_plan(n=20))
    assert decode(data, max_bytes=len(data)) == make_plan(n=20)
    assert_protocol_error(data, max_bytes=len(data) - 1, match="exceeds")
    assert_protocol_error(data, max_bytes=16, match="exceeds")
    assert_protocol_error(bytes(MAX_MESSAGE_BYTES + 1), match="exceeds")   # calloc: cheap


@pytest.mark.parametrize("data", [None, "abc", 3, [1, "StepResult", []], {"a": 1}, encode(make_result()).hex()])
def test_non_bytes_input(data):
    assert_protocol_error(data, match="bytes")


def test_other_msgpack_types_are_rejected():
    obj = raw(make_result())
    for bad in ({"a": 1}, msgpack.ExtType(1, b"x"), [0] * 100, "x" * 100):
        o = [obj[0], obj[1], list(obj[2])]
        o[2][0] = bad
        assert_protocol_error(pack(o))


def test_fuzz_only_protocol_error_escapes():
    rng = random.Random(1234)
    seeds = [encode(m) for m in VALID]
    outcomes = {"ok": 0, "error": 0}
    for case in range(3000):
        kind = case % 3
        if kind == 0:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 80)))
        else:
            base = bytearray(rng.choice(seeds))
            if not base:
                continue
            for _ in range(1 if kind == 1 else rng.randrange(2, 5)):
                base[rng.randrange(len(base))] = rng.getrandbits(8)
            data = bytes(base)
        try:
            msg = decode(data)
        except ProtocolError:
            outcomes["error"] += 1
        else:
            # whatever gets through is a well-formed message that re-encodes to itself
            assert decode(encode(msg)) == msg
            outcomes["ok"] += 1
    assert outcomes["error"] > 1500


# -- size ---------------------------------------------------------------------------------

def big_plan(n: int = 64, k: int = 4) -> StepPlan:
    rng = random.Random(5)
    p = StepPlan(step_id=1, width=k)
    for i in range(n):
        p.seq_ids.append(2**40 + i)
        p.num_computed.append(0)
        p.num_new.append(1)
        p.token_ids.append(rng.randrange(151_936))
        p.num_slots.append(1 + k)
        p.proposal_lens.append(k)
        p.temperature.append(0.7)
        p.top_k.append(0)
        p.top_p.append(0.95)
        p.seeds.append(rng.getrandbits(63) | 2**62)
    p.proposal_token_ids = [rng.randrange(151_936) for _ in range(n * k)]
    p.draft_rows = list(range(n))
    return p


def test_packed_encoding_has_no_per_item_overhead():
    p = big_plan()
    payload = 0
    fixed = []
    for f in fields(StepPlan):
        code = f.metadata.get("pack")
        if code is None:
            fixed.append(getattr(p, f.name))
        else:
            nbytes = ITEMSIZE[code] * len(getattr(p, f.name))
            payload += nbytes
            fixed.append(b"\x00" * nbytes)
    # exactly the fixed-width payload plus msgpack's framing of the fields (a few bytes each)
    assert len(encode(p)) == len(pack([PROTOCOL_VERSION, "StepPlan", fixed]))
    assert len(encode(p)) - payload < 4 * len(fields(StepPlan))


def test_packed_encoding_beats_plain_lists_for_64bit_fields():
    """int64 ids/seeds and float64 knobs cost 8 bytes packed, 9 as msgpack scalars.
    (For small int32 fields msgpack's variable-width ints are smaller than packed int32:
    the packing buys encode/decode speed there, not size.)"""
    p = big_plan()
    values = dict(zip([f.name for f in fields(StepPlan)], raw(p)[2]))
    wide = [f.name for f in fields(StepPlan) if f.metadata.get("pack") in ("q", "d")]
    assert sorted(wide) == ["free_seq_ids", "seeds", "seq_ids", "temperature", "top_p"]
    packed = sum(len(pack(values[name])) for name in wide)
    lists = sum(len(pack(getattr(p, name))) for name in wide)
    items = sum(len(getattr(p, name)) for name in wide)
    assert items == 4 * 64
    assert packed == 8 * items + 3 * 4 + 2 * 1  # bin16 headers for 512-byte fields, bin8 for the empty one
    assert lists == 9 * items + 3 * 4 + 1 * 1   # array16 headers, fixarray for empty
    assert packed < lists
