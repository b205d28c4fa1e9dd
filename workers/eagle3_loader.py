"""Reading an EAGLE-3 head from its checkpoint, in the layout vLLM and SGLang load.

A head is a directory (or hub id) with a ``config.json`` and its weights in safetensors
(``pytorch_model.bin`` also read)::

    config.json   architectures: LlamaForCausalLMEagle3 (or Eagle3LlamaForCausalLM),
                  num_hidden_layers: 1, hidden_size H, draft_vocab_size, vocab_size,
                  target_hidden_size H_t (default H), the attention/MLP sizes of one Llama
                  layer, its own RoPE settings, and optionally
                  eagle_aux_hidden_state_layer_ids (or eagle_config.eagle_aux_hidden_state_layer_ids)
    fc.weight                               [H, 3 H_t]   fuses the target's three hidden states
    midlayer.input_layernorm.weight         [H]          on the token embedding
    midlayer.hidden_norm.weight             [H]          on the fused hidden state
    midlayer.self_attn.{q,k,v}_proj.weight  [*, 2H]      over [embedding ; hidden]
    midlayer.self_attn.o_proj.weight, midlayer.post_attention_layernorm.weight,
    midlayer.mlp.{gate,up,down}_proj.weight, norm.weight
    lm_head.weight                          [draft_vocab, H]
    d2t                                     [draft_vocab] offsets: target id = draft id + d2t[draft id]
    embed_tokens.weight                     [V, H], optional: the target's embedding where absent

Aux layer ids: a config's ``eagle_aux_hidden_state_layer_ids`` name layers by their
output (SpecForge's and SGLang's reading: id i is the residual stream leaving layer i,
which is the one entering layer i + 1). Without them the head reads the residual stream
entering layers (2, N // 2, N - 3) of an N-layer target (EAGLE's and vLLM's default).
``Eagle3Checkpoint.aux_inputs`` is always in the entering-layer convention, which is
what the native executor captures.

``load_eagle3(path)`` reads and checks a checkpoint on its own; ``fit_target(ckpt,
target_config)`` checks it against the target it will draft for. Both raise ValueError
naming the field that does not fit.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

import torch

from specray.workers.model_files import read_config, resolve_model_path

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

# Every weight a head must have, by name, in the layout above.
REQUIRED = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
            "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
            "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t")


@dataclass
class Eagle3Checkpoint:
    """A head's settings and weights (on the CPU, as stored), checked for consistency."""

    path: str
    config: dict
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    layer_ids: tuple[int, ...] | None      # as the config writes them (output of layer i), or None
    norm_before_residual: bool
    weights: dict[str, torch.Tensor] = field(repr=False)
    aux_inputs: tuple[int, ...] = ()       # set by fit_target: the target layers whose input is read

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id."""
        return torch.arange(self.draft_vocab_size) + self.weights["d2t"].long()


def load_eagle3(path: str) -> Eagle3Checkpoint:
    """The head at ``path`` (a directory or a hub id in the hub's cache), checked on its own."""
    config = read_config(path)
    arch = config.get("architectures") or []
    if not any(a in ARCHITECTURES for a in arch):
        raise ValueError(f"{path}: architectures is {arch!r}, an EAGLE-3 head is one of {', '.join(ARCHITECTURES)}")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path}: num_hidden_layers is {config.get('num_hidden_layers')!r}; specray runs "
                         "one-layer EAGLE-3 heads")
    hidden = _int(config, "hidden_size", path)
    heads = _int(config, "num_attention_heads", path)
    kv_heads = config.get("num_key_value_heads") or heads
    vocab = _int(config, "vocab_size", path)
    ckpt = Eagle3Checkpoint(
        path=path, config=config, hidden_size=hidden,
        target_hidden_size=config.get("target_hidden_size") or hidden, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=config.get("head_dim") or hidden // heads, intermediate_size=_int(config, "intermediate_size", path),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), vocab_size=vocab,
        draft_vocab_size=config.get("draft_vocab_size") or vocab, layer_ids=_layer_ids(config, path),
        norm_before_residual=bool(config.get("norm_before_residual", False)), weights=_read_weights(path))
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{path}: hidden_act {act!r}; an EAGLE-3 head here uses silu")
    _check_shapes(ckpt)
    return ckpt


def fit_target(ckpt: Eagle3Checkpoint, target) -> Eagle3Checkpoint:
    """Checks that ``ckpt`` drafts for the target whose transformers config is ``target``
    (hidden size, aux layers, vocabulary, embedding) and sets ``ckpt.aux_inputs``."""
    p = ckpt.path
    t_hidden, t_layers, t_vocab = target.hidden_size, target.num_hidden_layers, target.vocab_size
    if ckpt.target_hidden_size != t_hidden:
        raise ValueError(f"{p}: target_hidden_size is {ckpt.target_hidden_size}, the target's hidden_size is "
                         f"{t_hidden}")
    if ckpt.layer_ids is None:
        inputs = (2, t_layers // 2, t_layers - 3)
        if t_layers < 4:
            raise ValueError(f"{p}: eagle_aux_hidden_state_layer_ids is not set and the default layers (2, N//2, "
                             f"N-3) need a target of 4 layers or more, it has {t_layers}")
    else:
        bad = [i for i in ckpt.layer_ids if not 0 <= i < t_layers - 1]
        if bad:
            raise ValueError(f"{p}: eagle_aux_hidden_state_layer_ids {list(ckpt.layer_ids)} names layers outside "
                             f"[0, {t_layers - 1}) of a {t_layers}-layer target (ids count layer outputs)")
        inputs = tuple(i + 1 for i in ckpt.layer_ids)
    fc_in = ckpt.weights["fc.weight"].shape[1]
    if fc_in != len(inputs) * t_hidden:
        raise ValueError(f"{p}: fc.weight takes {fc_in} features, {len(inputs)} aux layers of the target give "
                         f"{len(inputs) * t_hidden} (hidden_size {t_hidden})")
    if ckpt.vocab_size != t_vocab:
        raise ValueError(f"{p}: vocab_size is {ckpt.vocab_size}, the target's is {t_vocab}")
    ids = ckpt.target_ids
    if ids.min() < 0 or ids.max() >= t_vocab:
        raise ValueError(f"{p}: d2t maps draft ids outside the target vocabulary [0, {t_vocab})")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{p}: d2t maps two draft ids to one target id")
    if "embed_tokens.weight" not in ckpt.weights and t_hidden != ckpt.hidden_size:
        raise ValueError(f"{p}: embed_tokens.weight is absent and the target's embedding ({t_hidden} wide) does not "
                         f"fit hidden_size {ckpt.hidden_size}")
    emb = ckpt.weights.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (t_vocab, ckpt.hidden_size):
        raise ValueError(f"{p}: embed_tokens.weight is {tuple(emb.shape)}, expected ({t_vocab}, {ckpt.hidden_size})")
    ckpt.aux_inputs = inputs
    return ckpt


def _int(config: dict, name: str, path: str) -> int:
    v = config.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{path}: {name} must be an int >= 1, got {v!r}")
    return v


def _layer_ids(config: dict, path: str) -> tuple[int, ...] | None:
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {ids!r}")
    return tuple(ids)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, keys normalised to the layout above (a ``model.``
    prefix dropped, ``layers.0.`` read as ``midlayer.``, vLLM's ``draft_id_to_target_id``
    as ``d2t``)."""
    where = resolve_model_path(path)
    if not os.path.isdir(where):
        from huggingface_hub import snapshot_download

        where = snapshot_download(where, allow_patterns=["*.json", "*.safetensors", "*.bin"])
    files = sorted(glob.glob(os.path.join(where, "*.safetensors")))
    raw: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            raw.update(load_file(f))
    elif os.path.isfile(os.path.join(where, "pytorch_model.bin")):
        raw = torch.load(os.path.join(where, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path}: no *.safetensors or pytorch_model.bin next to config.json")
    out = {}
    for key, tensor in raw.items():
        name = key.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        out["d2t" if name == "draft_id_to_target_id" else name] = tensor
    return out


def _check_shapes(c: Eagle3Checkpoint) -> None:
    w, p = c.weights, c.path
    missing = [k for k in REQUIRED if k not in w]
    if missing:
        raise ValueError(f"{p}: the checkpoint lacks {', '.join(missing)}")
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    want = {"midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (c.intermediate_size, h),
            "midlayer.mlp.up_proj.weight": (c.intermediate_size, h),
            "midlayer.mlp.down_proj.weight": (h, c.intermediate_size), "norm.weight": (h,),
            "lm_head.weight": (c.draft_vocab_size, h), "d2t": (c.draft_vocab_size,)}
    for name, shape in want.items():
        if tuple(w[name].shape) != shape:
            what = "draft_vocab_size" if name in ("lm_head.weight", "d2t") else "hidden_size"
            raise ValueError(f"{p}: {name} is {tuple(w[name].shape)}, expected {shape} (from the config's {what} "
                             "and attention sizes)")
    fc = w["fc.weight"]
    if fc.dim() != 2 or fc.shape[0] != h or fc.shape[1] % c.target_hidden_size:
        raise ValueError(f"{p}: fc.weight is {tuple(fc.shape)}, expected ({h}, n * target_hidden_size "
                         f"{c.target_hidden_size})")
    if w["d2t"].is_floating_point():
        raise ValueError(f"{p}: d2t must hold integer offsets, got {w['d2t'].dtype}")
    if c.draft_vocab_size > c.vocab_size:
        raise ValueError(f"{p}: draft_vocab_size {c.draft_vocab_size} exceeds vocab_size {c.vocab_size}")
    if any(k.endswith(".bias") for k in w):
        raise ValueError(f"{p}: the head has biases ({', '.join(k for k in w if k.endswith('.bias'))}); "
                         "EAGLE-3 layers have none")
