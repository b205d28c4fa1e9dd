"""specray's own executor for the Llama family: Llama (Llama 3 rope scaling included),
Mistral (sliding window), Qwen2 (qkv bias, per-layer windows) and Qwen3 (q/k RMSNorm).

Weights come by their checkpoint names (``model.layers.0.self_attn.q_proj.weight``, ...):
from the checkpoint's safetensors as the loader read them (``model_loader.load_weights``,
which imports no transformers modeling code), or from a transformers model's state dict;
then they are fused: q/k/v into one projection, gate/up into another. What transformers
derives from the config (each layer's window, the attention scaling, the rotary
frequencies) is derived here the same way, and checked against its modules by the tests. A
forward is a flat loop of tensor ops over the packed batch: no per-module Python calls,
no transformers masks or caches. Attention is specray's paged attention
(``paged_attention.attend``) over the same ``AttentionMetadata``.

``supports(config)`` says whether a model can run here (``None``, else the reason);
``NativeCausalLM.from_weights(config, weights, max_len)`` builds it (``from_hf`` from a
loaded transformers model), and
``forward(input_ids [T], positions [T], meta, logits_index [m], tail=None)`` returns
logits [m, V] in the model's dtype, equal in math to transformers' forward; it is
``logits(hidden_states(...))``, split so that a CUDA graph can stop before the head.

Tensor parallel: built with a ``RankGroup`` (``tensor_parallel``), the model holds this
rank's part only (its query and KV heads, its MLP rows, its vocabulary slice) and its
forward meets the other ranks in three collectives (embedding, o_proj, down_proj) and a
gather at the head; ``heads`` and ``kv_heads`` are then this rank's. Every rank returns the
same logits [m, V], and the hidden states between layers are whole on every rank.

``hidden_states(..., aux=AuxCapture(layers))`` also keeps, for every fed row, the residual
stream entering each of ``layers`` (what an EAGLE-3 head reads); without it the loop
does nothing more than before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specray.workers import transformers_import
from specray.workers.paged_attention import AttentionMetadata, QueryTail, attend, write_kv
from specray.workers.rotary import STATIC_ROPE_TYPES, RotaryTable, apply_rotary, rope_type
from specray.workers.tensor_parallel import RankGroup, Split

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def supports(config) -> str | None:
    """None when the native executor can run the model of ``config`` (a transformers
    config), else why not."""
    mt = getattr(config, "model_type", None)
    if mt not in MODEL_TYPES:
        return f"model_type {mt!r} is not one of {', '.join(MODEL_TYPES)}"
    rt = rope_type(config)
    if rt not in STATIC_ROPE_TYPES:
        return f"rope_type {rt!r} changes with the sequence length"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(config, "quantization_config", None):
        return "a quantized checkpoint"
    if mt != "qwen2" and getattr(config, "attention_bias", False):
        return "attention_bias (an o_proj bias)"
    return None


def weight_names(config) -> list[str]:
    """Every tensor the executor takes from a checkpoint of ``config``'s model (optional
    ones, the Qwen2 biases and the Qwen3 norms, only where the family has them)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not getattr(config, "tie_word_embeddings", False):
        names.append("lm_head.weight")
    mt = config.model_type
    for i in range(config.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        names += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
        names += [a + p + ".weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [m + p + ".weight" for p in ("gate_proj", "up_proj", "down_proj")]
        if mt == "qwen2":
            names += [a + p + ".bias" for p in ("q_proj", "k_proj", "v_proj")]
        if mt == "qwen3":
            names += [a + "q_norm.weight", a + "k_norm.weight"]
    return names


def layer_window(config, i: int) -> int | None:
    """Layer ``i``'s sliding window, as transformers' attention modules take it: Qwen2 and
    Qwen3 per layer from ``layer_types``; Mistral (and any family whose config names one)
    for every layer."""
    if config.model_type in ("qwen2", "qwen3"):
        types = getattr(config, "layer_types", None)
        return config.sliding_window if types is not None and types[i] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def _activation(name: str):
    # The plain function where it is one: a module call costs more than SiLU itself at batch 1.
    if name in ("silu", "swish"):
        return F.silu
    return transformers_import.attr("transformers.activations", "ACT2FN")[name]


def _t(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> contiguous [in, out], copied once at load: on CPU ``x @ w_t`` is faster than
    ``F.linear(x, w)``, which multiplies by a transposed view (docs/executor.md)."""
    return w.detach().t().contiguous()


def _mm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.matmul(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: float32 statistics, weight applied in the input dtype
    (``weight`` broadcasts over x's last dimension: [D], or [heads, D] for per-head norms)."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class _Shard:
    """This rank's part of each weight ([out, in], as transformers holds it); the whole
    weight without a split. Column-parallel projections keep their rows, row-parallel ones
    their columns."""

    def __init__(self, split: Split | None, head_dim: int) -> None:
        self.split, self.head_dim = split, head_dim

    def _range(self, what: str) -> tuple[int, int]:
        s, d = self.split, self.head_dim
        if what == "heads":
            return s.q_first * d, s.heads * d
        if what == "kv_heads":
            return s.kv_first * d, s.kv_heads * d
        return s.rank * s.inter, s.inter                                    # "inter"

    def rows(self, w: torch.Tensor, what: str) -> torch.Tensor:
        if self.split is None:
            return w.detach()
        first, count = self._range(what)
        return w.detach()[first:first + count].clone()

    def columns(self, w: torch.Tensor, what: str) -> torch.Tensor:
        if self.split is None:
            return w.detach()
        first, count = self._range(what)
        return w.detach()[:, first:first + count].clone()

    def qkv(self, parts: list) -> list:
        """[q, k, v] weights or biases (None stays None)."""
        if self.split is None or parts[0] is None:
            return parts
        return [self.rows(parts[0], "heads"), self.rows(parts[1], "kv_heads"), self.rows(parts[2], "kv_heads")]

    def vocab(self, w: torch.Tensor) -> torch.Tensor:
        return w.detach() if self.split is None else self.split.vocab_rows(w)


@dataclass
class AuxCapture:
    """The residual stream entering some layers, for every fed row: ``layers`` (entering-
    layer indices, in the order their states are concatenated; repeats allowed) is what
    the caller asks, ``states`` what the forward filled ({layer: [T, D]})."""

    layers: tuple[int, ...]
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    def concat(self) -> torch.Tensor:
        """[T, len(layers) * D], in ``layers`` order."""
        return torch.cat([self.states[i] for i in self.layers], dim=-1)


class _Layer:
    __slots__ = ("idx", "ln1", "qkv_w", "qkv_b", "o_w", "qk_norm", "ln2", "gate_up_w", "down_w",
                 "window", "scaling")


class NativeCausalLM:
    def __init__(self) -> None:
        raise TypeError("use NativeCausalLM.from_hf")

    @classmethod
    def from_hf(cls, hf_model, max_len: int, release: bool = False,
                group: RankGroup | None = None) -> "NativeCausalLM":
        """From a loaded transformers model. ``release``: empty each of ``hf_model``'s
        layers once its weights are fused, so the build holds the model plus one layer's
        copies at its peak, not the model twice (the caller drops ``hf_model``)."""
        weights = hf_model.state_dict()
        inner = hf_model.model

        def done(i: int) -> None:
            if release:
                inner.layers[i] = torch.nn.Identity()

        return cls.from_weights(hf_model.config, weights, max_len, group, done)

    @classmethod
    def from_weights(cls, config, weights: dict[str, torch.Tensor], max_len: int, group: RankGroup | None = None,
                     layer_done=None) -> "NativeCausalLM":
        """From ``weights`` by checkpoint name (``weight_names(config)``; each layer's are
        popped once fused, and ``layer_done(i)`` called, so the build holds one layer's
        copies beyond the checkpoint). ``group``: keep this rank's part of a
        tensor-parallel split (every rank of the group builds at once)."""
        why = supports(config)
        if why:
            raise ValueError(f"native executor cannot run this model: {why}")
        missing = [n for n in weight_names(config) if n not in weights]
        if missing:
            raise ValueError(f"native executor: the checkpoint has no {missing[0]} "
                             f"({len(missing)} tensors missing)")
        self = object.__new__(cls)
        self.config = config
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.vocab_size = config.vocab_size
        self.tp = group if group is not None and group.size > 1 else None
        split = Split.of(config, group.rank, group.size, group.field) if self.tp is not None else None
        shard = _Shard(split, self.head_dim)
        if split is not None:
            self.heads, self.kv_heads = split.heads, split.kv_heads
        self.act = _activation(config.hidden_act)
        embed = weights["model.embed_tokens.weight"]
        self.embed = shard.vocab(embed)
        self.vocab_first = split.rank * split.vocab if split is not None else 0
        self.norm = weights["model.norm.weight"].detach()
        head = embed if getattr(config, "tie_word_embeddings", False) else weights["lm_head.weight"]
        self.lm_head = _t(shard.vocab(head))                    # a transposed copy, tied or not
        w = self.embed
        self.rotary = RotaryTable(config, max_len + 1, w.dtype, w.device)
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            L = _Layer()
            L.idx = i
            L.ln1 = weights[p + "input_layernorm.weight"].detach()
            L.ln2 = weights[p + "post_attention_layernorm.weight"].detach()
            L.qkv_w = _t(torch.cat(shard.qkv([weights[a + n + "_proj.weight"] for n in "qkv"])))
            biases = [weights.get(a + n + "_proj.bias") for n in "qkv"]
            L.qkv_b = torch.cat(shard.qkv(biases)).detach() if biases[0] is not None else None
            L.o_w = _t(shard.columns(weights[a + "o_proj.weight"], "heads"))
            if weights.get(a + "o_proj.bias") is not None:
                raise ValueError("native executor cannot run this model: o_proj bias")
            # Qwen3's per-head q and k norms as one [heads + kv_heads, D] weight: q and k are
            # adjacent in the qkv output, so both are normalized (and rotated) in one pass.
            L.qk_norm = torch.cat([weights[a + "q_norm.weight"].detach().expand(self.heads, -1),
                                   weights[a + "k_norm.weight"].detach().expand(self.kv_heads, -1)]) \
                if a + "q_norm.weight" in weights else None
            L.gate_up_w = _t(torch.cat([shard.rows(weights[m + n + "_proj.weight"], "inter") for n in ("gate", "up")]))
            L.down_w = _t(shard.columns(weights[m + "down_proj.weight"], "inter"))
            L.window = layer_window(config, i)
            L.scaling = self.head_dim ** -0.5
            self.layers.append(L)
            # The norms' weights are shared, not copied: L holds them.
            for name in [n for n in weights if n.startswith(p)]:
                del weights[name]
            if layer_done is not None:
                layer_done(i)
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.inter = self.layers[0].gate_up_w.shape[1] // 2 if self.layers else 0
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_index: torch.Tensor, tail: QueryTail | None = None,
                aux: AuxCapture | None = None) -> torch.Tensor:
        """``tail``: the rows ``logits_index`` draws from, when they are few (a prefill
        wants one row per sequence): the last layer writes every row's K/V, then attends,
        projects and runs its MLP for those rows alone; no other row's output is read.
        ``aux``: as for ``hidden_states``."""
        return self.logits(self.hidden_states(input_ids, positions, meta, logits_index, tail, aux))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [m, D] (normed) -> logits [m, V]."""
        if self.tp is None:
            return _mm(hidden, self.lm_head)
        return self.tp.all_gather(_mm(hidden, self.lm_head))[:, :self.vocab_size]   # [m, size * V/size] -> [m, V]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, D]; split by vocabulary, each rank adds the rows it holds."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_first
        outside = (local < 0) | (local >= self.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      logits_index: torch.Tensor, tail: QueryTail | None = None,
                      aux: AuxCapture | None = None) -> torch.Tensor:
        """The normed final hidden states [m, D] of ``logits_index``: what ``logits`` projects.
        A CUDA graph captures this much and leaves the vocabulary projection out, so its
        output is [rows, D], not [rows, V] (``step_graphs``). ``aux``: filled with the
        residual stream entering its layers, every fed row (taken before ``tail`` cuts the
        last layer's rows)."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        t = h.shape[0]
        residual = None
        last = self.layers[-1] if self.layers else None
        for L in self.layers:
            if residual is None:
                residual = h
            else:
                residual = residual + h
            if aux is not None and L.idx in aux.layers:
                aux.states[L.idx] = residual                                # [T, D], entering layer L
            x = rms_norm(residual, L.ln1, self.eps)
            qkv = _mm(x, L.qkv_w, L.qkv_b)
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.heads + self.kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(t, self.kv_heads, self.head_dim)
            if L.qk_norm is not None:
                qk = rms_norm(qk, L.qk_norm, self.eps)
            qk = apply_rotary(qk, cos, sin)
            written = tail is not None and L is last
            if written:
                write_kv(L.idx, qk[:, self.heads:], v, meta)
                qk, v, residual = qk[tail.rows], v[tail.rows], residual[tail.rows]
                meta, logits_index, t = tail.meta, tail.logits_index, tail.rows.shape[0]
            o = attend(L.idx, qk[:, :self.heads], qk[:, self.heads:], v, meta, L.scaling, L.window,
                       write=not written)
            h = _mm(o.reshape(t, self.q_size), L.o_w)
            if self.tp is not None:
                h = self.tp.all_reduce(h)                # row-parallel: each rank's heads' share
            residual = residual + h
            x = rms_norm(residual, L.ln2, self.eps)
            gu = _mm(x, L.gate_up_w)
            h = _mm(self.act(gu[:, :self.inter]) * gu[:, self.inter:], L.down_w)
            if self.tp is not None:
                h = self.tp.all_reduce(h)
        h = residual + h
        h = h.index_select(0, logits_index)
        return rms_norm(h, self.norm, self.eps)
