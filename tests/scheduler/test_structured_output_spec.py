"""SamplingParams.structured_output: each kind accepted, everything else refused with a
ValueError naming the field (an unimplemented schema keyword by name); the key workers
receive keeps a schema's property order; plans carry each constrained sequence's spec and
whole output, and survive the wire."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from specray.scheduler.grammar_plan import add_grammars
from specray.scheduler.messages import StepPlan, decode, encode
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.sequence import Sequence
from specray.scheduler.structured_output import StructuredOutput

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["b", "a"]}


@pytest.mark.parametrize("spec", [{"json": SCHEMA}, {"json": json.dumps(SCHEMA)}, {"json_object": True},
                                  {"regex": r"\d+"}, {"choice": ["a", "ab"]},
                                  {"grammar": 'start: "x" num\nnum: /[0-9]+/'}])
def test_each_kind_is_taken_and_survives_asdict_and_pickle(spec):
    import pickle

    p = SamplingParams(structured_output=spec)
    so = p.structured_output
    assert isinstance(so, StructuredOutput) and so.kind == next(iter(spec))
    again = SamplingParams(**asdict(p))                      # what the driver does with a submit
    assert again.structured_output == so and again.structured_output.key == so.key
    assert pickle.loads(pickle.dumps(p)).structured_output.key == so.key
    assert StructuredOutput.from_key(so.key) == so


def test_the_key_keeps_the_schemas_property_order():
    key = StructuredOutput(json=SCHEMA).key
    assert key.index('"b"') < key.index('"a"')
    assert json.loads(key) == {"json": SCHEMA}


@pytest.mark.parametrize("spec, match", [
    ({"regex": "(a"}, r"(?s)^structured_output\.regex: .*unclosed group"),
    ({"json": {"type": "strnig"}}, r"^structured_output\.json: .*strnig"),
    ({"json": {"type": "object", "if": {}, "then": {}}},
     r'^structured_output\.json: Unimplemented keys: \["if", "then"\]'),
    ({"json": "{"}, r"^structured_output\.json is not valid JSON"),
    ({"json": [1]}, r"^structured_output\.json must be a JSON schema"),
    ({"grammar": "start: foo"}, r"(?s)^structured_output\.grammar: .*foo"),
    ({"choice": []}, r"^structured_output\.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, r"^structured_output\.choice entries"),
    ({"json_object": "yes"}, r"^structured_output\.json_object must be true"),
    ({"regex": "a", "choice": ["b"]}, r"^structured_output needs exactly one of .*; got regex, choice"),
    ({}, r"^structured_output needs exactly one .*got none"),
    ({"ebnf": "x"}, r"^structured_output has unknown key\(s\) \['ebnf'\]"),
    ("json", r"^structured_output must be a dict"),
    ({"regex": "a" * 70_000}, r"^structured_output\.regex is \d+ characters; at most"),
])
def test_bad_specs_are_value_errors_naming_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_output=spec)


def test_ignore_eos_cannot_join_a_grammar():
    with pytest.raises(ValueError, match="structured_output .*ignore_eos"):
        SamplingParams(structured_output={"regex": "a"}, ignore_eos=True)


def test_a_plan_carries_each_constrained_sequences_spec_and_whole_output():
    so = SamplingParams(structured_output={"choice": ["ab", "cd"]})
    seqs = [Sequence(seq_id=1, request_id="a", prompt_len=3, tokens=[5, 6, 7, 100, 101, 102], params=so, seed=0),
            Sequence(seq_id=2, request_id="b", prompt_len=2, tokens=[5, 6, 9], params=SamplingParams(), seed=0),
            Sequence(seq_id=3, request_id="c", prompt_len=1, tokens=[5], params=so, seed=0)]
    for s in seqs:
        s.step_len = s.num_tokens - 1 if s.seq_id == 1 else s.num_tokens   # seq 1's last token: not yet its step's
    plan = StepPlan(seq_ids=[1, 2, 3], num_computed=[0, 0, 0], num_new=[6, 3, 1], token_ids=[0] * 10,
                    num_slots=[6, 3, 1], proposal_lens=[0, 0, 0], temperature=[1.0] * 3, top_k=[0] * 3,
                    top_p=[1.0] * 3, seeds=[0] * 3)
    add_grammars(plan, seqs)
    key = so.structured_output.key.encode()
    assert plan.grammar_lens == [len(key), 0, len(key)] and bytes(plan.grammar_bytes) == key + key
    assert plan.output_lens == [2, 0, 0] and plan.output_token_ids == [100, 101]
    back = decode(encode(plan), StepPlan)
    assert back == plan
    plan.output_lens = [3, 0, 0]
    with pytest.raises(ValueError, match="output_token_ids does not match output_lens"):
        plan.validate()
