"""Compares the two grammar engines specray could build structured output on, llguidance
and xgrammar, on the tokenizers it serves: the built-in pair's byte-level one and
SmolLM2's (a Hugging Face fast tokenizer, ``specray models fetch smollm2``).

For each engine, tokenizer and grammar it reports the one-off costs (wrapping the
tokenizer, compiling the grammar) and the per-token cost of a mask (fill one bitmask row,
then consume the token a fixed answer continues with), over a whole valid answer.

    python benchmarks/grammar_engines.py [--repeats 3]

xgrammar is optional here (specray does not depend on it): install it beside specray
(``pip install xgrammar``, or ``--no-deps xgrammar apache-tvm-ffi`` to skip triton) to
include it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "kind": {"enum": ["person", "robot", "other"]}},
    "required": ["name", "age", "tags", "kind"], "additionalProperties": False}
ANSWER = '{"name": "Ada", "age": 36, "tags": ["math", "engines"], "kind": "person"}'
REGEX = r"\d{3}-\d{4} [a-z]+"
REGEX_ANSWER = "555-0199 hello"


def byte_tokens():
    """The built-in pair's vocabulary: pad, eos, unk, then the 256 bytes."""
    return [b"<pad>", b"</s>", b"<unk>"] + [bytes([b]) for b in range(256)]


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_llguidance(tokenizer_name: str, hf_tok, repeats: int) -> list[dict]:
    import llguidance
    import llguidance.numpy as lnp

    from specray.workers.grammar import GrammarTokenizer

    t0 = time.perf_counter()
    gt = GrammarTokenizer.build(hf_tok, len(hf_tok))
    wrap_s = time.perf_counter() - t0
    rows = []
    for kind, spec, answer in (("json", json.dumps(SCHEMA), ANSWER), ("regex", REGEX, REGEX_ANSWER)):
        grammar = llguidance.grammar_from("json_schema" if kind == "json" else "regex", spec)
        compile_s = timed(lambda: llguidance.LLMatcher(gt.ll, grammar), repeats)   # noqa: B023
        ids = gt.encode(answer)
        bm = lnp.allocate_token_bitmask(1, gt.vocab_size)
        per = []
        for _ in range(repeats):
            m = llguidance.LLMatcher(gt.ll, grammar)
            t0 = time.perf_counter()
            for t in ids:
                lnp.fill_next_token_bitmask(m, bm, 0)
                assert (bm[0, t // 32] >> (t % 32)) & 1, "the answer must be allowed"
                m.consume_token(t)
            per.append((time.perf_counter() - t0) / len(ids))
        rows.append({"engine": f"llguidance {llguidance.__version__}", "tokenizer": tokenizer_name, "grammar": kind,
                     "tokenizer_s": wrap_s, "compile_s": compile_s, "mask_us_per_token": 1e6 * min(per),
                     "tokens": len(ids)})
    return rows


def run_xgrammar(tokenizer_name: str, hf_tok, repeats: int) -> list[dict]:
    try:
        import xgrammar as xgr
    except ImportError:
        return []

    t0 = time.perf_counter()
    if getattr(hf_tok, "backend_tokenizer", None) is None:       # the built-in ByT5 bytes
        info = xgr.TokenizerInfo(byte_tokens(), vocab_type=xgr.VocabType.RAW, vocab_size=259, stop_token_ids=[1])
        encode = lambda s: [b + 3 for b in s.encode()]   # noqa: E731
    else:
        info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok))
        encode = lambda s: hf_tok(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    wrap_s = time.perf_counter() - t0
    rows = []
    for kind, spec, answer in (("json", json.dumps(SCHEMA), ANSWER), ("regex", REGEX, REGEX_ANSWER)):
        def compile_once():
            comp = xgr.GrammarCompiler(info, cache_enabled=False)   # a fresh one: no cache hit
            return comp.compile_json_schema(spec) if kind == "json" else comp.compile_regex(spec)   # noqa: B023
        compile_s = timed(compile_once, repeats)
        compiled = compile_once()
        ids = encode(answer)
        bm = xgr.allocate_token_bitmask(1, info.vocab_size)
        per = []
        for _ in range(repeats):
            m = xgr.GrammarMatcher(compiled)
            t0 = time.perf_counter()
            for t in ids:
                m.fill_next_token_bitmask(bm, 0)
                assert (int(bm[0, t // 32]) >> (t % 32)) & 1, "the answer must be allowed"
                m.accept_token(t)
            per.append((time.perf_counter() - t0) / len(ids))
        rows.append({"engine": "xgrammar 0.2.9", "tokenizer": tokenizer_name, "grammar": kind, "tokenizer_s": wrap_s,
                     "compile_s": compile_s, "mask_us_per_token": 1e6 * min(per), "tokens": len(ids)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from specray import builtin_model
    from specray.runtime import model_store
    tokenizers = [("built-in bytes (259)", AutoTokenizer.from_pretrained(builtin_model("tiny-target")))]
    path = model_store.cached_path("smollm2")
    if path:
        tokenizers.append(("SmolLM2 (49152)", AutoTokenizer.from_pretrained(path)))
    else:
        print("SmolLM2 is not fetched (specray models fetch smollm2): the byte-level tokenizer only")
    rows = []
    for name, tok in tokenizers:
        rows += run_llguidance(name, tok, args.repeats) + run_xgrammar(name, tok, args.repeats)
    print(f"{'engine':16} {'tokenizer':22} {'grammar':7} {'tokenizer s':>11} {'compile ms':>10} {'mask us/token':>13}")
    for r in rows:
        print(f"{r['engine']:16} {r['tokenizer']:22} {r['grammar']:7} {r['tokenizer_s']:11.3f} "
              f"{1e3 * r['compile_s']:10.2f} {r['mask_us_per_token']:13.1f}")
    print(f"median mask us/token: {statistics.median(r['mask_us_per_token'] for r in rows):.1f}")


if __name__ == "__main__":
    main()
