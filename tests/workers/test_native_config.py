"""A config read from config.json alone (``native_config``) against transformers' reading
of the same file: every field and every value the executor derives from them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specray.workers import llama_model, model_loader, native_config
from specray.workers.rotary import inverse_frequencies
from specray.workers.tensor_parallel import Split

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)

# Written by transformers' own config classes.
SAVED = {
    "llama": (LlamaConfig, dict(num_key_value_heads=2)),
    "llama_mha_tied": (LlamaConfig, dict(tie_word_embeddings=True, eos_token_id=[1, 5],
                                         rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "mistral_swa": (MistralConfig, dict(num_key_value_heads=2, sliding_window=5)),
    "mistral_no_window": (MistralConfig, dict(num_key_value_heads=4, sliding_window=None)),
    "qwen2": (Qwen2Config, dict(num_key_value_heads=2)),
    "qwen2_swa": (Qwen2Config, dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
                                    max_window_layers=1)),
    "qwen3_swa": (Qwen3Config, dict(num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                                    sliding_window=7, max_window_layers=2)),
}

# Written by hand, as older checkpoints on the hub have them.
HUB = {
    # transformers 4's layout: rope_theta beside the fields, torch_dtype, null KV heads.
    "llama_v4": dict(model_type="llama", **SMALL, num_key_value_heads=None, head_dim=16, hidden_act="silu",
                     max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2,
                     rope_theta=20000.0, rope_scaling=None, torch_dtype="bfloat16"),
    # A window in the file that use_sliding_window switches off.
    "qwen2_window_off": dict(model_type="qwen2", **SMALL, num_key_value_heads=2, head_dim=16, hidden_act="silu",
                             max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             eos_token_id=3, rope_theta=1e6, use_sliding_window=False, sliding_window=64,
                             max_window_layers=1, layer_types=["full_attention", "sliding_attention",
                                                               "sliding_attention"]),
}

HUB["llama_without_head_dim"] = {k: v for k, v in HUB["llama_v4"].items() if k != "head_dim"}
HUB["mistral_null_head_dim"] = dict(HUB["llama_v4"], model_type="mistral", num_key_value_heads=2, head_dim=None,
                                    sliding_window=None)

# Files that need a family default or a scaled rotary type: transformers reads them.
NOT_NATIVE = {
    "qwen3_without_head_dim": {k: v for k, v in dict(HUB["qwen2_window_off"], model_type="qwen3").items()
                               if k != "head_dim"},
    "qwen2_without_layer_types": {k: v for k, v in HUB["qwen2_window_off"].items() if k != "layer_types"},
    "mistral_without_window": dict(HUB["llama_v4"], model_type="mistral", num_key_value_heads=2),
    "llama_without_eos": {k: v for k, v in HUB["llama_v4"].items() if k != "eos_token_id"},
    "llama3_rope": dict(HUB["llama_v4"], rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "partial_rotary": dict(HUB["llama_v4"], partial_rotary_factor=0.5),
    "gpt2": dict(model_type="gpt2", vocab_size=96, n_embd=64, n_layer=2, n_head=4),
}


def _write(tmp_path, name: str, fields: dict) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(fields))
    return str(path)


def _saved(tmp_path, name: str) -> str:
    cls, over = SAVED[name]
    path = str(tmp_path / name)
    cls(**SMALL, **over).save_pretrained(path)
    return path


def _same_reading(native, hf) -> None:
    for field in (*native_config.REQUIRED, "model_type", "head_dim", "sliding_window", "layer_types"):
        assert getattr(native, field, None) == getattr(hf, field, None), field
    # Read with the executor's defaults where a file may leave them out.
    for field, default in (("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1),
                           ("quantization_config", None)):
        assert getattr(native, field, default) == getattr(hf, field, default), field
    assert native.rope_parameters["rope_theta"] == hf.rope_parameters["rope_theta"]
    cuda = torch.device("cuda")             # where the checkpoint's dtype is the default
    assert model_loader.resolve_dtype("auto", cuda, native) == model_loader.resolve_dtype("auto", cuda, hf)
    assert llama_model.supports(native) == llama_model.supports(hf)
    assert llama_model.weight_names(native) == llama_model.weight_names(hf)
    for i in range(hf.num_hidden_layers):
        assert llama_model.layer_window(native, i) == llama_model.layer_window(hf, i)
    (f1, s1), (f2, s2) = inverse_frequencies(native), inverse_frequencies(hf)
    assert torch.equal(f1, f2) and s1 == s2
    assert Split.of(native, 1, 2) == Split.of(hf, 1, 2)
    assert model_loader.eos_token_ids(native) == model_loader.eos_token_ids(hf)


@pytest.mark.parametrize("name, source", [(n, "saved") for n in SAVED] + [(n, "hub") for n in HUB])
def test_a_file_the_executor_can_read_alone_reads_as_transformers_reads_it(name, source, tmp_path):
    """Files transformers' config classes saved, and older layouts as hub checkpoints
    have them."""
    path = _saved(tmp_path, name) if source == "saved" else _write(tmp_path, name, HUB[name])
    native = model_loader.load_config(path)
    assert isinstance(native, native_config.NativeConfig)
    _same_reading(native, AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("name", list(NOT_NATIVE))
def test_a_file_that_leaves_a_field_to_transformers_is_read_by_transformers(name, tmp_path):
    path = _write(tmp_path, name, NOT_NATIVE[name])
    assert native_config.from_json(NOT_NATIVE[name]) is None
    config = model_loader.load_config(path)
    assert not isinstance(config, native_config.NativeConfig)
    assert config.model_type == NOT_NATIVE[name]["model_type"]


def test_the_transformers_path_gets_a_transformers_config(tmp_path):
    """A model the native executor reads but the user sends to transformers' modules
    loads with transformers' own config."""
    from specray_testing import model_runner

    path = _saved(tmp_path, "llama")
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).save_pretrained(path)
    runner = model_runner(path, executor="transformers", block_size=4, num_kv_blocks=8)
    assert runner.executor == "transformers"
    assert not isinstance(runner.config, native_config.NativeConfig)
