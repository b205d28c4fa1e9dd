"""Structured output under speculation, end to end on an in-process driver with the
built-in pair (byte-level tokenizer): greedy answers under a regex and a JSON schema are
the same with every proposer as without speculation, and equal an independent reference
(transformers' logits, masked by a grammar matcher stepped by hand); a choice among
strings that share prefixes, sampled with the draft (and with n-gram and suffix
proposals), has the target's masked distribution (chi-square against probabilities
computed from transformers' logits with the mask written out by hand); JSON-schema
answers validate; the built-in pair answers chat requests."""

from __future__ import annotations

import json
import math

import pytest
import torch
from specray_testing import run_local

from specray import builtin_model
from specray.runtime.config import RuntimeConfig
from specray.scheduler.sampling_params import SamplingParams

TARGET, DRAFT = builtin_model("tiny-target"), builtin_model("tiny-draft")
EOS = 1
REGEX = r"[a-z]{2,6}\((\d|[a-z]), \d\)"
PROMPTS = ["def add(a, b):\n    return ", "import os\nx = ", "    result = self."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "size", "ok"], "additionalProperties": False}
CHOICES = ["cat", "car", "cart", "dog", "do"]
CHOICE_PROMPT = "pets = ['cat', 'car', 'cart', 'dog', 'do']\n    animal = '"
TEMPERATURE = 1.5


def config(proposer: str, **kw) -> RuntimeConfig:
    return RuntimeConfig(target=TARGET, draft=DRAFT if "draft" in proposer else None, proposer=proposer,
                         num_speculative_tokens=4, device="cpu", dtype="float32", max_model_len=256, **kw)


@pytest.fixture(scope="module")
def hf_target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


def ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


@torch.no_grad()
def masked_greedy(model, prompt: list[int], spec: dict, max_new: int) -> list[int]:
    """Plain constrained greedy decoding: transformers' logits over the whole context each
    step, a fresh llguidance matcher stepped through the emitted tokens, no specray code
    but the grammar vocabulary."""
    import llguidance
    import llguidance.numpy as lnp

    from specray.scheduler.structured_output import StructuredOutput, grammar_text
    from specray.workers.grammar import tokenizer_for

    tok = tokenizer_for(TARGET, 259)
    m = llguidance.LLMatcher(tok.ll, grammar_text(StructuredOutput(**spec)))
    out: list[int] = []
    bm = lnp.allocate_token_bitmask(1, 259)
    while len(out) < max_new:
        logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()
        lnp.fill_next_token_bitmask(m, bm, 0)
        allowed = torch.tensor([(int(bm[0, t // 32]) >> (t % 32)) & 1 for t in range(259)], dtype=torch.bool)
        t = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(t)
        if t == EOS:
            break
        assert m.consume_token(t)
    return out


@pytest.mark.parametrize("spec", [{"regex": REGEX}, {"json": SCHEMA}], ids=["regex", "json"])
def test_greedy_under_a_grammar_is_the_same_with_every_proposer_and_equals_plain_masked_decoding(hf_target, spec):
    params = SamplingParams(max_tokens=48, temperature=0.0, structured_output=spec)
    expected = [masked_greedy(hf_target, ids(p), spec, 48) for p in PROMPTS]
    accepted = {}
    for proposer in ("none", "draft", "ngram", "suffix", "draft+suffix"):
        outs, m = run_local(config(proposer), PROMPTS, params)
        assert [o.token_ids for o in outs] == expected, proposer
        accepted[proposer] = m["num_accepted_tokens"]
        for o in outs:
            if o.finish_reason == "stop":
                if "regex" in spec:
                    import re
                    assert re.fullmatch(REGEX, o.text), o.text
                else:
                    import jsonschema
                    jsonschema.validate(json.loads(o.text), SCHEMA)
    assert accepted["draft"] > 0          # the masked draft's proposals are taken
    if "json" in spec:
        # A pool too small for all of them: sequences are preempted and recomputed, and
        # their matchers follow (a plan brings each one's whole output).
        outs, m = run_local(config("draft", block_size=4, num_kv_blocks=22), PROMPTS * 2, params)
        assert m["num_preemptions"] > 0
        assert [o.token_ids for o in outs] == expected * 2


@torch.no_grad()
def masked_choice_probs(model, prompt: list[int], temperature: float) -> dict[str, float]:
    """The target's distribution over the answers under the choice grammar: per position
    the softmax of its logits / temperature over the bytes some choice continues with
    (and EOS where the prefix is itself a choice), the mask written out by hand."""
    probs = {}
    for c in CHOICES:
        seq, p = ids(c), 1.0
        for j in range(len(seq) + 1):
            prefix = c.encode()[:j]
            allowed = {x.encode()[j] + 3 for x in CHOICES if x.encode()[:j] == prefix and len(x) > j}
            if prefix.decode() in CHOICES:
                allowed.add(EOS)
            logits = model(torch.tensor([prompt + seq[:j]])).logits[0, -1] / temperature
            keep = torch.full_like(logits, float("-inf"))
            keep[list(allowed)] = 0.0
            dist = torch.softmax((logits + keep).double(), dim=-1)
            p *= float(dist[seq[j] if j < len(seq) else EOS])
        probs[c] = p
    assert math.isclose(sum(probs.values()), 1.0, rel_tol=1e-6)
    return probs


@pytest.mark.parametrize("proposer", ["draft", "ngram", "suffix"])
def test_a_sampled_choice_has_the_targets_masked_distribution(hf_target, proposer):
    from scipy.stats import chisquare

    n = 800
    want = masked_choice_probs(hf_target, ids(CHOICE_PROMPT), TEMPERATURE)
    # The prompt lists the choices, so n-gram decoding finds proposals in it (which run on
    # past the answer, into tokens the grammar forbids); suffix decoding learns the answers.
    params = SamplingParams(max_tokens=8, temperature=TEMPERATURE, structured_output={"choice": CHOICES})
    outs, m = run_local(config(proposer, max_num_seqs=400), [CHOICE_PROMPT] * n, params)
    assert all(o.finish_reason == "stop" and o.token_ids[-1] == EOS for o in outs)
    counts = {c: 0 for c in CHOICES}
    for o in outs:
        counts[o.text] += 1                      # a KeyError is an answer outside the grammar
    # Bins expected below 5 join the least likely of the others (a chi-square test needs
    # expected counts of 5 or more).
    big = sorted((c for c in CHOICES if want[c] * n >= 5), key=want.get, reverse=True)
    small = [c for c in CHOICES if c not in big]
    obs = [counts[c] for c in big]
    exp = [want[c] * n for c in big]
    obs[-1] += sum(counts[c] for c in small)
    exp[-1] += sum(want[c] for c in small) * n
    assert len(obs) >= 3, want                   # a distribution with some spread to test
    assert chisquare(obs, exp).pvalue > 1e-3, (counts, want)
    assert m["num_draft_tokens"] > n and m["num_accepted_tokens"] > 0
    if proposer == "draft":
        assert m["acceptance_rate"] > 0.5         # the masked draft wastes nothing on forbidden tokens


def test_sampled_json_schema_answers_validate_and_json_object_answers_parse():
    import jsonschema

    prompts = [p for p in PROMPTS for _ in range(4)]
    so = [SamplingParams(max_tokens=120, temperature=0.8, seed=i, structured_output={"json": SCHEMA})
          for i in range(len(prompts))]
    obj = [SamplingParams(max_tokens=120, temperature=0.8, seed=i, structured_output={"json_object": True})
           for i in range(len(prompts))]
    outs, _ = run_local(config("draft"), prompts + prompts, so + obj)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= len(outs) // 2
    for o in outs[:len(prompts)]:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)
    for o in outs[len(prompts):]:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)


def test_the_built_in_pair_answers_chat_with_its_template():
    from transformers import AutoTokenizer

    from specray.runtime.chat import ChatPrompt
    from specray.runtime.driver.core import DriverCore

    messages = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "A point?"}]
    drv = DriverCore(config("draft").replace(layout="colocated"))
    try:
        reply = drv.submit([ChatPrompt(messages)], [SamplingParams(max_tokens=24, temperature=0.0,
                                                                   structured_output={"json_object": True})])
        assert reply.error is None, reply.error
        (out,) = drv.wait(reply.request_ids, timeout=300)
    finally:
        drv.shutdown()
    tok = AutoTokenizer.from_pretrained(TARGET)
    assert out.prompt_token_ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    assert out.text.startswith("{")


def test_a_resumed_request_re_advances_its_grammar_from_its_tokens():
    """A driver's fail-over resumes a request from the tokens its client held: the new
    sequence's matchers start from those tokens, and the answer is the uninterrupted one."""
    from specray.runtime.driver.core import DriverCore
    from specray.runtime.driver.resume import Resume

    params = SamplingParams(max_tokens=48, temperature=0.0, seed=5, structured_output={"json": SCHEMA})
    drv = DriverCore(config("draft").replace(layout="colocated"))
    try:
        (whole,) = drv.wait(drv.submit([PROMPTS[0]], [params]).request_ids, timeout=300)
        assert whole.finish_reason == "stop" and len(whole.token_ids) > 12
        resume = Resume(prompt_token_ids=list(whole.prompt_token_ids), token_ids=whole.token_ids[:9])
        reply = drv.submit([PROMPTS[0]], [params], resumes=[resume])
        assert reply.error is None, reply.error
        (rest,) = drv.wait(reply.request_ids, timeout=300)
    finally:
        drv.shutdown()
    # Its output counts the held tokens too, as the client's request it is.
    assert rest.token_ids == whole.token_ids and rest.finish_reason == "stop"
