"""Train an EAGLE-3 head for a target on the target's own generations, and write it in the
layout vLLM, SGLang and specray load (``config.json`` + ``model.safetensors``: ``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t``; the target's embedding is not saved).

Recipe (EAGLE-3 / SpecForge, scaled to a CPU):

1. Prompts: windows of the Python standard library's sources (the built-in pair's corpus,
   ``train_tiny_pair.load_corpus``; held-out files for evaluation), tokenized with the
   target's tokenizer; each continued by the target itself (a share greedily, the rest
   sampled at ``--temperature``), so the head learns the distribution it will draft for.
2. Features, once: the target's residual stream entering its aux layers (default: the
   distinct of 2, N // 2, N - 3) and its next-token distribution at every position.
3. Draft vocabulary: the ``--draft-vocab-size`` most frequent tokens of the generations
   (``d2t[i] = id_i - i``); the loss is a soft cross-entropy against the target's
   distribution restricted to it.
4. Training-time test: ``--ttt`` draft steps unrolled. Step 0 reads the target's features
   (row q carries token q + 1, predicts token q + 2); step i feeds step i - 1's prenorm
   output back at RoPE position q + i and attends to the target-feature keys up to q and
   to its own row's keys of steps 1..i (what drafting from anchor q computes). Step i's
   loss is weighted ``--decay ** i``.

Per-position accuracy (how often step i's argmax is the target's) is measured on
held-out generations and printed as JSON (and written to ``train_stats.json`` beside
the head); ``models/README.md`` records the built-in head's. The built-in ``tiny-eagle3``::

    python scripts/train_eagle3.py --out models/tiny-eagle3 --steps 1100 --batch 12 --gen-len 96 \
        --num-prompts 320 --corpus-windows 1600 --intermediate-size 512
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent


class RMSNorm(torch.nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _linear(i: int, o: int) -> torch.nn.Linear:
    return torch.nn.Linear(i, o, bias=False)


class Head(torch.nn.Module):
    """The head; its state_dict keys are the published layout's."""

    def __init__(self, hidden: int, target_hidden: int, n_aux: int, heads: int, kv_heads: int, inter: int,
                 draft_vocab: int, eps: float, theta: float) -> None:
        super().__init__()
        self.fc = _linear(n_aux * target_hidden, hidden)
        self.midlayer = torch.nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        m.post_attention_layernorm = RMSNorm(hidden, eps)
        self.d = hidden // heads
        m.self_attn = torch.nn.Module()
        a = m.self_attn
        a.q_proj, a.k_proj = _linear(2 * hidden, heads * self.d), _linear(2 * hidden, kv_heads * self.d)
        a.v_proj, a.o_proj = _linear(2 * hidden, kv_heads * self.d), _linear(heads * self.d, hidden)
        m.mlp = torch.nn.Module()
        m.mlp.gate_proj, m.mlp.up_proj, m.mlp.down_proj = _linear(hidden, inter), _linear(hidden, inter), \
            _linear(inter, hidden)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = _linear(hidden, draft_vocab)
        self.heads, self.kv_heads, self.theta = heads, kv_heads, theta

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.d, 2, device=x.device).float() / self.d))
        ang = pos.float()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        return x * cos + torch.cat([-x[..., self.d // 2:], x[..., :self.d // 2]], -1) * sin

    def unroll(self, embed: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """embed [B, S, T, H] (step s row q: token q + 1 + s), aux [B, T, n H_t] ->
        draft logits of each step [B, T, Vd] (rows past the sequence are garbage)."""
        b, _, t, _ = embed.shape
        m, a = self.midlayer, self.midlayer.self_attn
        h = self.fc(aux)
        rows = torch.arange(t)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        keys, values, out = [], [], []
        rep = self.heads // self.kv_heads
        for s in range(steps):
            x = torch.cat([m.input_layernorm(embed[:, s]), m.hidden_norm(h)], -1)
            pos = rows + s
            q = self.rope(a.q_proj(x).view(b, t, self.heads, self.d).transpose(1, 2), pos)
            k = self.rope(a.k_proj(x).view(b, t, self.kv_heads, self.d).transpose(1, 2), pos)
            v = a.v_proj(x).view(b, t, self.kv_heads, self.d).transpose(1, 2)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            keys.append(k)
            values.append(v)
            scale = 1 / math.sqrt(self.d)
            # Step-0 keys up to the row, then the row's own key of each step 1..s.
            s0 = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
            diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]
            p = torch.cat([s0] + diag, -1).softmax(-1)
            o = p[..., :t] @ values[0]
            for j, vv in enumerate(values[1:]):
                o = o + p[..., t + j:t + j + 1] * vv
            r = h + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            z = m.post_attention_layernorm(r)
            h = r + m.mlp.down_proj(F.silu(m.mlp.gate_proj(z)) * m.mlp.up_proj(z))
            out.append(self.lm_head(self.norm(h)))
        return out


def aux_inputs(n_layers: int, ids: list[int] | None) -> list[int]:
    """Entering-layer indices of the states the head reads (config ids count outputs)."""
    if ids is not None:
        return [i + 1 for i in ids]
    default = sorted({2, n_layers // 2, n_layers - 3} & set(range(1, n_layers)))
    return default if len(default) == 3 else [round(1 + i * (n_layers - 2) / 2) for i in range(3)]


@torch.no_grad()
def generate(target, tokenizer, texts: list[str], prompt_len: int, gen_len: int, greedy_share: float,
             temperature: float, batch: int, seed: int) -> torch.Tensor:
    """[N, prompt_len + gen_len]: each prompt continued by the target."""
    torch.manual_seed(seed)
    prompts = torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"][:prompt_len] for t in texts])
    out = []
    n_greedy = round(greedy_share * len(prompts))
    for i in range(0, len(prompts), batch):
        p = prompts[i:i + batch]
        sample = i >= n_greedy
        kw = dict(do_sample=True, temperature=temperature, top_k=0) if sample else dict(do_sample=False)
        out.append(target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=gen_len, min_new_tokens=gen_len,
                                   pad_token_id=0, eos_token_id=None, **kw))
    return torch.cat(out)


@torch.no_grad()
def features(target, seqs: torch.Tensor, inputs: list[int], used: torch.Tensor, batch: int = 16):
    """The target's aux states [N, T, n H_t] and its next-token distribution restricted to
    the draft vocabulary [N, T, Vd] (float16 to keep them small)."""
    aux, probs, top = [], [], []
    for i in range(0, len(seqs), batch):
        out = target(input_ids=seqs[i:i + batch], output_hidden_states=True)
        aux.append(torch.cat([out.hidden_states[j] for j in inputs], -1).half())
        logits = out.logits.float()
        probs.append(logits[..., used].softmax(-1).half())
        top.append(logits.argmax(-1))
    return torch.cat(aux), torch.cat(probs), torch.cat(top)


def step_inputs(seqs: torch.Tensor, embed: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps, T, H]: step s row q embeds token q + 1 + s (past the end: the last)."""
    t = seqs.shape[1] - 1
    idx = (torch.arange(t)[None, :] + 1 + torch.arange(steps)[:, None]).clamp(max=t)
    return embed[seqs[:, idx]]


def losses(head: Head, embed, seqs, aux, probs, top, used_mask, steps: int):
    """Per step: soft cross-entropy against the target (rows whose target argmax the draft
    vocabulary holds) and the argmax accuracy."""
    t = seqs.shape[1] - 1
    logits = head.unroll(step_inputs(seqs, embed, steps), aux[:, :t].float(), steps)
    out = []
    for s, lg in enumerate(logits):
        n = t - 1 - s                      # rows whose teacher (position q + 1 + s) exists
        teacher = probs[:, 1 + s:1 + s + n].float()
        keep = used_mask[top[:, 1 + s:1 + s + n]]
        lp = lg[:, :n].log_softmax(-1)
        loss = -(teacher * lp).sum(-1)[keep].mean()
        acc = (lg[:, :n].argmax(-1) == head.t2d[top[:, 1 + s:1 + s + n]])[keep].float().mean()
        out.append((loss, acc))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(ROOT / "models" / "tiny-target"))
    p.add_argument("--out", default=str(ROOT / "models" / "tiny-eagle3"))
    p.add_argument("--num-prompts", type=int, default=192)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=96)
    p.add_argument("--corpus-windows", type=int, default=0,
                   help="also train on this many windows of the corpus itself (the target's distribution over real "
                        "text as the teacher: more data at the cost of one target forward, no generation)")
    p.add_argument("--greedy-share", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--layer-ids", type=int, nargs="*", default=None, help="aux layers, counted as layer outputs")
    p.add_argument("--ttt", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--decay", type=float, default=0.8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stdlib", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from safetensors.torch import save_file
    from train_tiny_pair import load_corpus
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.target)
    cfg = target.config
    train_text, eval_text = (b.decode("utf-8", "replace") for b in load_corpus(args.stdlib))
    g = torch.Generator().manual_seed(args.seed)

    def windows(text: str, n: int) -> list[str]:
        # Each window has room for prompt_len tokens of a BPE tokenizer too (code runs to
        # 4-6 characters a token); it is cut to prompt_len tokens when tokenized.
        starts = torch.randint(0, len(text) - 4 * args.prompt_len, (n,), generator=g).tolist()
        return [text[s:s + 16 * args.prompt_len] for s in starts]

    seqs = generate(target, tok, windows(train_text, args.num_prompts), args.prompt_len, args.gen_len,
                    args.greedy_share, args.temperature, 32, args.seed)
    held = generate(target, tok, windows(eval_text, args.eval_prompts), args.prompt_len, args.gen_len,
                    args.greedy_share, args.temperature, 32, args.seed + 1)
    if args.corpus_windows:
        n = seqs.shape[1]
        real = [tok(t, add_special_tokens=False)["input_ids"] for t in windows(train_text, args.corpus_windows)]
        seqs = torch.cat([seqs, torch.tensor([r[:n] for r in real if len(r) >= n])])
    vocab = cfg.vocab_size
    dv = min(args.draft_vocab_size, vocab)
    used = torch.bincount(seqs.flatten(), minlength=vocab).argsort(descending=True)[:dv].sort().values
    inputs = aux_inputs(cfg.num_hidden_layers, args.layer_ids)
    aux, probs, top = features(target, seqs, inputs, used)
    h_aux, h_probs, h_top = features(target, held, inputs, used)
    log = {"features_s": round(time.time() - t0, 1)}
    heads = cfg.num_attention_heads
    theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 1e4)))
    torch.manual_seed(args.seed)
    head = Head(cfg.hidden_size, cfg.hidden_size, len(inputs), heads, cfg.num_key_value_heads,
                args.intermediate_size or cfg.intermediate_size, dv, cfg.rms_norm_eps, theta)
    head.t2d = torch.full((vocab,), -1)
    head.t2d[used] = torch.arange(dv)
    used_mask = head.t2d >= 0
    embed = target.model.embed_tokens.weight.detach().float()
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = [args.decay ** s for s in range(args.ttt)]
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(seqs), (args.batch,), generator=g)
        parts = losses(head, embed, seqs[idx], aux[idx], probs[idx], top[idx], used_mask, args.ttt)
        loss = sum(w * lo for w, (lo, _) in zip(weights, parts))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            accs = " ".join(f"{a.item():.3f}" for _, a in parts)
            print(f"step {step} {time.time() - t0:.0f}s loss {loss.item():.3f} acc {accs}", flush=True)
    with torch.no_grad():
        accs = [[] for _ in range(args.ttt)]
        for i in range(0, len(held), 16):
            for s, (_, a) in enumerate(losses(head, embed, held[i:i + 16], h_aux[i:i + 16], h_probs[i:i + 16],
                                             h_top[i:i + 16], used_mask, args.ttt)):
                accs[s].append(a.item())
    log.update(train_s=round(time.time() - t0, 1), held_out_accuracy=[round(sum(a) / len(a), 3) for a in accs],
               draft_vocab_size=dv, aux_layer_ids=[i - 1 for i in inputs], num_sequences=len(seqs),
               seq_len=seqs.shape[1], steps=args.steps, ttt=args.ttt)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": cfg.hidden_size, "target_hidden_size": cfg.hidden_size,
              "intermediate_size": head.midlayer.mlp.gate_proj.out_features, "num_attention_heads": heads,
              "num_key_value_heads": cfg.num_key_value_heads, "rms_norm_eps": cfg.rms_norm_eps,
              "vocab_size": vocab, "draft_vocab_size": dv, "max_position_embeddings": cfg.max_position_embeddings,
              "rope_theta": theta, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": log["aux_layer_ids"]}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    tensors["d2t"] = (used - torch.arange(dv)).long()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "train_stats.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log))
    return log


if __name__ == "__main__":
    main()
