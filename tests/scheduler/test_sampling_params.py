"""SamplingParams validates itself: every bad field is a ValueError naming the field."""

from __future__ import annotations

import math

import pytest

from specray.scheduler.messages import StepPlan, encode
from specray.scheduler.sampling_params import INT32_MAX, MAX_STOP_CHARS, MAX_TEMPERATURE, SamplingParams


def test_defaults_are_valid():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop_token_ids, p.ignore_eos) == (
        16, 1.0, 1.0, 0, None, [], False)
    assert not p.greedy
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0).greedy
    # defaults are not shared between instances
    a, b = SamplingParams(), SamplingParams()
    a.stop_token_ids.append(3)
    assert b.stop_token_ids == []


def test_valid_edges_are_accepted():
    p = SamplingParams(max_tokens=1, temperature=0, top_p=1e-9, top_k=0, seed=0,
                       stop_token_ids=(0, 5), ignore_eos=True)
    assert p.stop_token_ids == [0, 5] and isinstance(p.stop_token_ids, list)
    SamplingParams(seed=2**63 - 1, top_p=1, top_k=50, temperature=2.5)


BAD = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 1.0),
    ("max_tokens", "8"),
    ("max_tokens", None),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", -1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("temperature", "0.5"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0000001),
    ("top_p", 2),
    ("top_p", math.nan),
    ("top_p", "1"),
    ("top_p", False),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_k", True),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 2**64),
    ("seed", 1.0),
    ("seed", "7"),
    ("seed", True),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, -5]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", ["2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [None]),
    ("stop_token_ids", 3),
    ("stop_token_ids", "12"),
    ("stop_token_ids", {1, 2}),
    ("ignore_eos", 1),
    ("ignore_eos", 0),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", "3"),
    ("logprobs", True),
    ("logprobs", 2.0),
    ("speculation", "yes"),
    ("speculation", 1),
    ("speculation", None),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_field_raises_value_error_naming_it(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    assert name in str(info.value)


@pytest.mark.parametrize("name,value", BAD[:10], ids=[f"{n}={v!r}" for n, v in BAD[:10]])
def test_from_dict_validates_too(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_dict({name: value})


def test_logprobs_and_speculation_edges():
    assert (SamplingParams().logprobs, SamplingParams().speculation) == (None, True)
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(logprobs=20, speculation=False).speculation is False


@pytest.mark.parametrize("name,value", BAD[-8:], ids=[f"{n}={v!r}" for n, v in BAD[-8:]])
def test_from_dict_validates_logprobs_and_speculation(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_dict({name: value})


def test_from_dict_round_trips_and_rejects_unknown_keys():
    d = dict(max_tokens=5, temperature=0.7, top_p=0.9, top_k=3, seed=11, stop_token_ids=[2], ignore_eos=True,
             logprobs=4, speculation=False)
    assert SamplingParams.from_dict(d) == SamplingParams(**d)
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="max_token"):
        SamplingParams.from_dict({"max_token": 5})
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict({"max_tokens": 5, "beam_width": 2, "n": 3})
    assert "beam_width" in str(info.value) and "'n'" in str(info.value)


@pytest.mark.parametrize("t", [1e-300, 1e-40, 9.9e-6])
def test_temperatures_too_small_for_float32_mean_greedy(t):
    # logits / 1e-40 overflows float32 (NaN probabilities); vLLM treats these as greedy too.
    p = SamplingParams(temperature=t)
    assert p.greedy and p.temperature == 0.0
    assert not SamplingParams(temperature=1e-5).greedy


# What a hostile request carries: values that pass a type check but not the step's packing
# (int32 / float64 arrays) or float arithmetic. Each must be refused here, naming its field.
HOSTILE = [
    ("temperature", 10**400),              # a JSON integer too large for a float
    ("temperature", -10**400),
    ("temperature", MAX_TEMPERATURE * 2),
    ("temperature", 1e308),
    ("top_p", 10**400),
    ("top_p", -10**400),
    ("top_p", math.inf),
    ("top_p", -math.nan),
    ("top_k", 10**12),
    ("top_k", INT32_MAX + 1),
    ("top_k", 10**400),
    ("max_tokens", 10**30),
    ("max_tokens", INT32_MAX + 1),
    ("seed", 2**64),
    ("seed", 10**400),
    ("seed", -10**400),
    ("stop_token_ids", [INT32_MAX + 1]),
    ("stop_token_ids", [0, 10**30]),
    ("logprobs", 10**400),
    ("stop", "x" * (MAX_STOP_CHARS + 1)),
    ("stop", ["ok", "y" * 100_000]),
]


@pytest.mark.parametrize("name,value", HOSTILE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(HOSTILE)])
def test_out_of_range_values_are_refused_naming_the_field(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict({name: value})
    message = str(info.value)
    assert message.startswith(name) or f" {name}" in message, message
    assert len(message) < 200          # a refused value is not echoed back whole


def test_the_largest_accepted_values_pack_into_a_step_plan():
    """What SamplingParams accepts, the step's int32 / float64 arrays hold: the edges
    encode without an OverflowError (an independent check: ``array`` itself)."""
    p = SamplingParams(max_tokens=INT32_MAX, temperature=MAX_TEMPERATURE, top_k=INT32_MAX, top_p=1,
                       seed=2**63 - 1, stop_token_ids=[INT32_MAX], stop=["z" * MAX_STOP_CHARS])
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    plan = StepPlan(seq_ids=[1], num_computed=[0], num_new=[1], token_ids=[p.stop_token_ids[0]], num_slots=[1],
                    proposal_lens=[0], temperature=[p.temperature], top_k=[p.top_k], top_p=[p.top_p],
                    seeds=[p.seed])
    assert encode(plan)


def test_integers_as_floats_are_converted_once():
    p = SamplingParams(temperature=2, top_p=1)
    assert (p.temperature, p.top_p) == (2.0, 1.0) and type(p.temperature) is float and type(p.top_p) is float
