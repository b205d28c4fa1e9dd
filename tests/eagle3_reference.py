"""An EAGLE-3 head written out in plain torch from its checkpoint's tensors, independent of
specray's head (no paged cache, no fused weights, its own RoPE and norms): full causal
attention over every row, recomputed from scratch. The tests read drafts from it, train
tiny heads with it, and save those heads with safetensors directly, in the layout vLLM
and SGLang load (``config.json`` + ``model.safetensors``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

NAMES = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
         "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
         "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
         "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
         "norm.weight", "lm_head.weight")


def head_config(hidden=32, heads=4, kv_heads=2, inter=64, vocab=96, draft_vocab=64, layer_ids=(0, 1, 2),
                rope_theta=5000.0, **extra) -> dict:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-6, "vocab_size": vocab,
           "draft_vocab_size": draft_vocab, "max_position_embeddings": 128, "rope_theta": rope_theta,
           "hidden_act": "silu", "tie_word_embeddings": False}
    if layer_ids is not None:
        cfg["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    cfg.update(extra)
    return cfg


def random_weights(cfg: dict, target_hidden: int, seed: int, n_aux: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    shapes = {"fc.weight": (h, n_aux * target_hidden), "midlayer.self_attn.q_proj.weight": (q, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, q), "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
              "lm_head.weight": (cfg["draft_vocab_size"], h)}
    w = {k: torch.randn(s, generator=g) / math.sqrt(s[1]) for k, s in shapes.items()}
    for k in NAMES:
        if k not in w:
            w[k] = torch.ones(h)
    return w


def save_head(path: Path, cfg: dict, weights: dict[str, torch.Tensor], d2t: torch.Tensor) -> str:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v.detach().float().contiguous() for k, v in weights.items()}
    tensors["d2t"] = d2t.long().contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


class RefHead(torch.nn.Module):
    """``forward(tokens [B, T], hidden [B, T, H], positions [T]) -> prenorm [B, T, H]``;
    ``logits(prenorm) -> [.., draft_vocab]``; rows attend causally in their order."""

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor], embed: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.w = torch.nn.ParameterDict({k.replace(".", "/"): torch.nn.Parameter(weights[k].float().clone())
                                         for k in NAMES})
        self.embed = embed.float()
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = cfg["hidden_size"] // self.heads
        self.theta = cfg.get("rope_theta", 10000.0)
        self.eps = cfg["rms_norm_eps"]

    def p(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "/")]

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.p(name) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux @ self.p("fc.weight").T

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        m = "midlayer."
        x = torch.cat([self.rms(self.embed[tokens], m + "input_layernorm.weight"),
                       self.rms(hidden, m + "hidden_norm.weight")], dim=-1)
        def proj(name, n):
            return (x @ self.p(m + f"self_attn.{name}_proj.weight").T).view(b, t, n, self.d).transpose(1, 2)
        q, k, v = proj("q", self.heads), proj("k", self.kv_heads), proj("v", self.kv_heads)
        inv = 1.0 / (self.theta ** (torch.arange(0, self.d, 2).float() / self.d))
        ang = positions.float()[:, None] * inv[None, :]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        def rot(z):
            return z * cos + torch.cat([-z[..., self.d // 2:], z[..., :self.d // 2]], -1) * sin
        q, k = rot(q), rot(k)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, t, self.heads * self.d)
        r = hidden + o @ self.p(m + "self_attn.o_proj.weight").T
        z = self.rms(r, m + "post_attention_layernorm.weight")
        mlp = F.silu(z @ self.p(m + "mlp.gate_proj.weight").T) * (z @ self.p(m + "mlp.up_proj.weight").T)
        return r + mlp @ self.p(m + "mlp.down_proj.weight").T

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.rms(prenorm, "norm.weight") @ self.p("lm_head.weight").T

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: self.p(k).detach() for k in NAMES}


def target_aux(target, ids: torch.Tensor, inputs: tuple[int, ...]) -> torch.Tensor:
    """The residual stream entering the ``inputs`` layers of the transformers ``target``
    over ``ids`` [B, T] (``hidden_states[i]`` is the input to layer i): [B, T, n * H]."""
    hs = target(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in inputs], dim=-1).float()


@torch.no_grad()
def ref_drafts(ref: RefHead, aux: torch.Tensor, seq: list[int], n: int, target_ids: torch.Tensor) -> list[int]:
    """The head's greedy drafts for the ``n`` tokens after ``seq`` (L tokens), from the
    target's hidden states ``aux`` [L - 1, n_aux * H] of its first L - 1 positions (row q
    carries token q + 1), then each draft fed back with the previous row's prenorm output."""
    hidden = ref.fuse(aux[:len(seq) - 1]).unsqueeze(0)                          # [1, L-1, H]
    tokens = torch.tensor([seq[1:]])
    positions = torch.arange(len(seq) - 1)
    out = []
    for _ in range(n):
        pre = ref(tokens, hidden, positions)
        d = int(target_ids[ref.logits(pre[0, -1]).argmax()])
        out.append(d)
        tokens = torch.cat([tokens, torch.tensor([[d]])], dim=1)
        hidden = torch.cat([hidden, pre[:, -1:]], dim=1)
        positions = torch.cat([positions, positions[-1:] + 1])
    return out


def train_head(target, corpus: torch.Tensor, cfg: dict, inputs: tuple[int, ...], steps: int = 60,
               seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A head fitted (EAGLE-3's first unrolled step: row q predicts token q + 2 from the
    target's hidden states) to ``corpus`` [B, T] of the transformers ``target``; its draft
    vocabulary the ``draft_vocab_size`` most frequent tokens there (as EAGLE's scandata
    picks it). Returns (weights, d2t)."""
    vocab, draft_vocab = cfg["vocab_size"], cfg["draft_vocab_size"]
    used = torch.bincount(corpus.flatten(), minlength=vocab).argsort(descending=True)[:draft_vocab].sort().values
    t2d = torch.full((vocab,), -100)
    t2d[used] = torch.arange(draft_vocab)
    ref = RefHead(cfg, random_weights(cfg, target.config.hidden_size, seed=seed, n_aux=len(inputs)),
                  target.model.embed_tokens.weight.detach())
    with torch.no_grad():
        aux = target_aux(target, corpus[:, :-1], inputs)                      # [B, T-1, n H_t]
    tokens, labels = corpus[:, 1:], t2d[corpus[:, 2:]]
    positions = torch.arange(tokens.shape[1])
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = ref.logits(ref(tokens, ref.fuse(aux), positions))[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, draft_vocab), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ref.weights(), used - torch.arange(draft_vocab)
