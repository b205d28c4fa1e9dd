#!/usr/bin/env python
"""Train specray's built-in tiny model pair: a byte-level Llama target and draft.

Both models are ``LlamaForCausalLM`` over the same 259-token byte vocabulary
(``transformers.ByT5Tokenizer(extra_ids=0)``: pad=0, eos=1, unk=2, byte b -> b+3),
trained from scratch on the ``.py`` sources of the running Python's standard
library, which are present on every machine (``sysconfig.get_paths()["stdlib"]``).

Everything is fixed for reproducibility: the seed, the step counts (no time
budgets), the sorted file list and the file-level train / held-out split.  The
same Python version therefore gives the same corpus; a different version gives
a slightly different corpus (the stdlib changes between releases).

Usage (from the repository root)::

    python scripts/train_tiny_pair.py --out models

writes ``models/tiny-target/``, ``models/tiny-draft/`` (config.json,
model.safetensors in bfloat16, generation_config.json, tokenizer files) and
``models/README.md`` with the measured numbers.  Training runs at one CPU
thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

# The split lives with the benchmark's prompt source, which must agree with it.
from specray.runtime.bench.stdlib_corpus import (  # noqa: F401 (re-exported for callers and tests)
    EVAL_EVERY,
    SKIP_DIRS,
    SKIP_FILE_PREFIXES,
    default_stdlib_dir,
    list_source_files,
    split_files,
)

# --------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BYTE_OFFSET = 3  # token id = byte value + 3
VOCAB_SIZE = 256 + BYTE_OFFSET  # 259, exactly len(ByT5Tokenizer(extra_ids=0))

SEQ_LEN = 256
BATCH_SIZE = 16

DEFAULT_SEED = 1234
DEFAULT_TARGET_STEPS = 1100
DEFAULT_DRAFT_STEPS = 2000

MODEL_SPECS = {
    "target": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "draft": dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
}

# Optimiser settings (shared by both models).
LR = {"target": 2e-3, "draft": 3e-3}
MIN_LR_FRACTION = 0.1
WARMUP_STEPS = 50
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def _read_concat(files: Sequence[Path]) -> bytes:
    chunks = []
    for path in files:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            data += b"\n"
        chunks.append(data)
    return b"".join(chunks)


def load_corpus(
    stdlib_dir: str | os.PathLike | None = None, eval_every: int = EVAL_EVERY
) -> tuple[bytes, bytes]:
    """Return ``(train_bytes, eval_bytes)``: the concatenated sources of each split."""
    train_files, eval_files = split_files(list_source_files(stdlib_dir), eval_every)
    return _read_concat(train_files), _read_concat(eval_files)


def encode_bytes(data: bytes | bytearray | torch.Tensor) -> torch.Tensor:
    """Bytes -> int64 token ids (byte + 3), matching ``ByT5Tokenizer(extra_ids=0)``."""
    if isinstance(data, torch.Tensor):
        t = data.to(torch.int64)
    else:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    return t + BYTE_OFFSET


def batches(
    data: bytes | torch.Tensor,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
) -> Iterator[torch.Tensor]:
    """Endless stream of ``[batch_size, seq_len]`` int64 token-id windows at random offsets.

    ``data`` is raw bytes (or a tensor of token ids already offset by 3).
    """
    ids = data if isinstance(data, torch.Tensor) else encode_bytes(data)
    if ids.numel() < seq_len:
        raise ValueError(f"data has {ids.numel()} tokens, fewer than seq_len={seq_len}")
    high = ids.numel() - seq_len + 1
    arange = torch.arange(seq_len)
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        yield ids[starts[:, None] + arange[None, :]]


def eval_windows(data: bytes | torch.Tensor, seq_len: int = SEQ_LEN, max_windows: int | None = 256) -> torch.Tensor:
    """Deterministic non-overlapping windows over ``data``, evenly spread if capped."""
    ids = data if isinstance(data, torch.Tensor) else encode_bytes(data)
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError("eval data shorter than one window")
    windows = ids[: n * seq_len].view(n, seq_len)
    if max_windows is not None and n > max_windows:
        idx = torch.linspace(0, n - 1, max_windows).round().long()
        windows = windows[idx]
    return windows


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def model_config(kind: str):
    from transformers import LlamaConfig

    if kind not in MODEL_SPECS:
        raise ValueError(f"kind must be one of {sorted(MODEL_SPECS)}, got {kind!r}")
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
        use_cache=True,
        **MODEL_SPECS[kind],
    )


def build_model(kind: str):
    """A freshly initialised fp32 ``LlamaForCausalLM`` ("target" or "draft")."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(model_config(kind))
    model.generation_config = generation_config()
    return model


def generation_config():
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        do_sample=False,
    )


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------
# Training / evaluation
# --------------------------------------------------------------------------


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats) over a batch of token windows."""
    logits = model(input_ids=batch, use_cache=False).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1)
    )


def make_optimizer(model, lr: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=BETAS,
    )


def lr_at(step: int, total_steps: int, peak_lr: float, warmup: int = WARMUP_STEPS) -> float:
    """Linear warmup then cosine decay to ``MIN_LR_FRACTION * peak_lr``."""
    warmup = min(warmup, max(total_steps // 10, 1))
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(total_steps - warmup, 1)
    progress = min(max(progress, 0.0), 1.0)
    cos = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak_lr * (MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * cos)


def train_step(model, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One optimiser step on ``batch``; returns the loss (nats/byte) before the update."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate_bits_per_byte(
    model,
    data: bytes | torch.Tensor,
    seq_len: int = SEQ_LEN,
    max_windows: int | None = 256,
    batch_size: int = 32,
) -> float:
    """Bits per byte on deterministic held-out windows (every predicted position counted)."""
    was_training = model.training
    model.eval()
    windows = eval_windows(data, seq_len, max_windows)
    total_nats, total_tokens = 0.0, 0
    for i in range(0, windows.size(0), batch_size):
        w = windows[i : i + batch_size]
        logits = model(input_ids=w, use_cache=False).logits.float()
        nll = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1), reduction="sum"
        )
        total_nats += float(nll)
        total_tokens += w[:, 1:].numel()
    if was_training:
        model.train()
    return total_nats / total_tokens / math.log(2)


@torch.no_grad()
def measure_acceptance(
    target,
    draft,
    data: bytes | torch.Tensor,
    seq_len: int = SEQ_LEN,
    max_windows: int | None = 128,
    temperature: float = 0.8,
    batch_size: int = 32,
) -> dict:
    """Teacher-forced draft-vs-target agreement on held-out windows.

    ``greedy``: fraction of positions where argmax(draft) == argmax(target).
    ``sampled``: mean over positions of sum_x min(p(x), q(x)) with p, q the
    target / draft distributions at ``temperature`` (the expected acceptance
    probability of one speculative-sampling step).
    """
    target.eval()
    draft.eval()
    windows = eval_windows(data, seq_len, max_windows)
    greedy_hits, overlap_sum, n = 0, 0.0, 0
    for i in range(0, windows.size(0), batch_size):
        w = windows[i : i + batch_size]
        lt = target(input_ids=w, use_cache=False).logits.float()
        ld = draft(input_ids=w, use_cache=False).logits.float()
        greedy_hits += int((lt.argmax(-1) == ld.argmax(-1)).sum())
        p = torch.softmax(lt / temperature, dim=-1)
        q = torch.softmax(ld / temperature, dim=-1)
        overlap_sum += float(torch.minimum(p, q).sum(-1).sum())
        n += w.numel()
    return {"greedy": greedy_hits / n, "sampled": overlap_sum / n, "temperature": temperature, "positions": n}


def train_model(
    kind: str,
    steps: int,
    train_ids: torch.Tensor,
    seed: int,
    batch_size: int = BATCH_SIZE,
    seq_len: int = SEQ_LEN,
    log_every: int = 50,
    eval_ids: torch.Tensor | None = None,
    eval_every: int = 0,
    log=print,
):
    """Train a fresh ``kind`` model for exactly ``steps`` steps.

    Returns ``(model, wall_seconds, cpu_seconds)``; the CPU time of this process
    is the better measure of cost on a machine shared with other jobs.
    """
    torch.manual_seed(seed)
    model = build_model(kind)
    optimizer = make_optimizer(model, LR[kind])
    gen = torch.Generator().manual_seed(seed + (0 if kind == "target" else 1))
    stream = batches(train_ids, batch_size, seq_len, gen)
    log(f"[{kind}] params={count_parameters(model):,} steps={steps} batch={batch_size}x{seq_len} lr={LR[kind]}")
    t0 = time.perf_counter()
    c0 = time.process_time()
    running = None
    for step in range(steps):
        lr = lr_at(step, steps, LR[kind])
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = train_step(model, optimizer, next(stream))
        running = loss if running is None else 0.98 * running + 0.02 * loss
        if (step + 1) % log_every == 0 or step == 0 or step + 1 == steps:
            el = time.perf_counter() - t0
            cpu = time.process_time() - c0
            log(
                f"[{kind}] step {step + 1}/{steps} loss {loss:.4f} "
                f"(avg {running / math.log(2):.3f} bits/byte) lr {lr:.2e} wall {el:.0f}s cpu {cpu:.0f}s"
            )
        if eval_ids is not None and eval_every and (step + 1) % eval_every == 0:
            bpb = evaluate_bits_per_byte(model, eval_ids, seq_len, max_windows=64)
            log(f"[{kind}] step {step + 1} held-out {bpb:.3f} bits/byte (64 windows)")
    seconds = time.perf_counter() - t0
    cpu_seconds = time.process_time() - c0
    model.eval()
    return model, seconds, cpu_seconds


# --------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------


def make_tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer(extra_ids=0)


def save_model(model, out_dir: str | os.PathLike) -> Path:
    """Save ``model`` in bfloat16 safetensors plus tokenizer and generation config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = generation_config()
    model.save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    for f in out.iterdir():  # safetensors writes 0600; make the shipped files world-readable
        if f.is_file():
            f.chmod(0o644)
    return out


def save_pair(out_dir: str | os.PathLike, target=None, draft=None) -> tuple[Path, Path]:
    """Write ``<out_dir>/tiny-target`` and ``<out_dir>/tiny-draft``.

    Without models given, freshly initialised ones are saved (useful for tests).
    """
    out = Path(out_dir)
    target = target if target is not None else build_model("target")
    draft = draft if draft is not None else build_model("draft")
    return save_model(target, out / "tiny-target"), save_model(draft, out / "tiny-draft")


def load_saved(model_dir: str | os.PathLike):
    """Load a saved model upcast to fp32 (for evaluation on CPU)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


# --------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------


def _dir_size(path: Path) -> int:
    return (path / "model.safetensors").stat().st_size


def write_readme(out: Path, stats: dict) -> Path:
    t, d = stats["target"], stats["draft"]
    acc = stats["acceptance"]
    corpus = stats["corpus"]
    text = f"""# Built-in tiny model pair

`tiny-target/` and `tiny-draft/` are byte-level `LlamaForCausalLM` models
trained from scratch by `scripts/train_tiny_pair.py` on the `.py` sources of
the Python standard library.  They exist so that speculative decoding can be
exercised end to end without downloading anything; they are far too small to
be useful language models.

Both use the same tokenizer, `transformers.ByT5Tokenizer(extra_ids=0)`
(pad=0, eos=1, unk=2, byte b -> id b+3, vocabulary 259; the tokenizer appends
eos by default, pass `add_special_tokens=False` for plain bytes), saved next to
each model, and the same `vocab_size` = {VOCAB_SIZE}.  Weights are stored in
bfloat16 (`model.safetensors`); configs set `eos_token_id=1`, `pad_token_id=0`,
`bos_token_id=null`, `max_position_embeddings=2048`.

## How they were made

```
{stats["command"]}
```

- Corpus: `sysconfig.get_paths()["stdlib"]` of Python {corpus["python"]}, all
  `.py` files sorted by relative path, skipping the directories
  {", ".join(f"`{s}`" for s in sorted(SKIP_DIRS))} (and `config-*`) and files starting with
  {", ".join(f"`{s}`" for s in SKIP_FILE_PREFIXES)}.
  {corpus["files"]} files; every {EVAL_EVERY}th file (sorted order) is held out:
  {corpus["train_files"]} train files / {corpus["train_bytes"]:,} bytes,
  {corpus["eval_files"]} eval files / {corpus["eval_bytes"]:,} bytes.
  A different Python version yields a slightly different corpus.
- Training: seed {stats["seed"]}, random {SEQ_LEN}-byte windows, batch {BATCH_SIZE},
  AdamW (betas {BETAS}, weight decay {WEIGHT_DECAY} on matrices), {WARMUP_STEPS}-step linear
  warmup then cosine decay to {MIN_LR_FRACTION:g}x peak, grad clip {GRAD_CLIP}, fp32,
  {stats["threads"]} CPU thread{"s" if stats["threads"] != 1 else ""} ({stats["machine"]}, torch {stats["torch"]}, transformers {stats["transformers"]}).
  Final weights are rounded to bfloat16.

| model | layers x hidden (heads / kv heads, mlp) | parameters | bf16 file | peak lr | steps | train CPU time | train wall time | held-out bits/byte |
|---|---|---|---|---|---|---|---|---|
| tiny-target | {t["spec"]} | {t["params"]:,} | {t["file_bytes"] / 1e6:.2f} MB | {LR["target"]} | {t["steps"]} | {t["cpu_seconds"] / 60:.1f} min | {t["seconds"] / 60:.1f} min | {t["bpb"]:.3f} |
| tiny-draft | {d["spec"]} | {d["params"]:,} | {d["file_bytes"] / 1e6:.2f} MB | {LR["draft"]} | {d["steps"]} | {d["cpu_seconds"] / 60:.1f} min | {d["seconds"] / 60:.1f} min | {d["bpb"]:.3f} |

Total training time {(t["cpu_seconds"] + d["cpu_seconds"]) / 60:.1f} CPU-minutes at one thread
({(t["seconds"] + d["seconds"]) / 60:.1f} min wall clock; the wall time is inflated when the
machine is shared with other jobs, the CPU time of the training process is not).
Bits per byte are measured on
the saved bfloat16 weights (computed in fp32) over {stats["eval_windows"]} evenly spaced,
non-overlapping {SEQ_LEN}-byte windows of the held-out split (every next-byte
prediction within a window counts).

## Draft vs. target agreement (held-out, teacher-forced)

Over {acc["positions"]:,} positions ({stats["acc_windows"]} held-out windows of {SEQ_LEN} bytes):

- greedy: argmax(draft) == argmax(target) at **{acc["greedy"]:.3f}** of positions;
- temperature {acc["temperature"]}: mean sum_x min(p(x), q(x)) = **{acc["sampled"]:.3f}**
  (expected per-token acceptance probability of speculative sampling).

Greedy decoding from models this small soon falls into loops (typically a
run of spaces after a newline); sample (e.g. temperature 0.8) to see varied,
Python-looking text.

The run's numbers are also in `train_stats.json` and its console output in
`train.log`.  Regenerate with the command above; the numbers are reproduced
from the same seed and step counts (up to floating-point differences across
machines and Python versions).
"""
    path = out / "README.md"
    path.write_text(text)
    return path


def _spec_str(kind: str) -> str:
    s = MODEL_SPECS[kind]
    return (
        f"{s['num_hidden_layers']} x {s['hidden_size']} "
        f"({s['num_attention_heads']} / {s['num_key_value_heads']}, {s['intermediate_size']})"
    )


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="models", help="output directory (default: models)")
    p.add_argument("--target-steps", type=int, default=DEFAULT_TARGET_STEPS)
    p.add_argument("--draft-steps", type=int, default=DEFAULT_DRAFT_STEPS)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    p.add_argument("--stdlib", default=None, help="stdlib directory (default: this Python's)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows for bits/byte")
    p.add_argument("--acc-windows", type=int, default=128, help="held-out windows for acceptance")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--no-readme", action="store_true", help="do not write <out>/README.md")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()

    def log(msg):
        print(msg, flush=True)

    files = list_source_files(args.stdlib)
    train_files, eval_files = split_files(files)
    train_bytes, eval_bytes = _read_concat(train_files), _read_concat(eval_files)
    log(
        f"corpus: {len(files)} files, train {len(train_files)} files / {len(train_bytes):,} bytes, "
        f"eval {len(eval_files)} files / {len(eval_bytes):,} bytes"
    )
    train_ids, eval_ids = encode_bytes(train_bytes), encode_bytes(eval_bytes)

    out = Path(args.out)
    stats: dict = {
        "seed": args.seed,
        "threads": args.threads,
        "eval_windows": args.eval_windows,
        "acc_windows": args.acc_windows,
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}".strip(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": (
            f"python scripts/train_tiny_pair.py --out {args.out} --target-steps {args.target_steps} "
            f"--draft-steps {args.draft_steps} --seed {args.seed}"
        ),
        "corpus": {
            "python": platform.python_version(),
            "files": len(files),
            "train_files": len(train_files),
            "eval_files": len(eval_files),
            "train_bytes": len(train_bytes),
            "eval_bytes": len(eval_bytes),
        },
    }

    for kind, steps in (("target", args.target_steps), ("draft", args.draft_steps)):
        model, seconds, cpu_seconds = train_model(
            kind, steps, train_ids, args.seed, log_every=args.log_every, log=log
        )
        fp32_bpb = evaluate_bits_per_byte(model, eval_ids, max_windows=args.eval_windows)
        log(
            f"[{kind}] trained in {seconds:.0f}s wall / {cpu_seconds:.0f}s CPU; "
            f"fp32 held-out {fp32_bpb:.4f} bits/byte"
        )
        path = save_model(model, out / f"tiny-{kind}")
        del model
        stats[kind] = {
            "steps": steps,
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "fp32_bpb": fp32_bpb,
            "spec": _spec_str(kind),
            "file_bytes": _dir_size(path),
        }

    target, draft = load_saved(out / "tiny-target"), load_saved(out / "tiny-draft")
    for kind, model in (("target", target), ("draft", draft)):
        stats[kind]["params"] = count_parameters(model)
        stats[kind]["bpb"] = evaluate_bits_per_byte(model, eval_ids, max_windows=args.eval_windows)
        log(f"[{kind}] saved bf16 weights: held-out {stats[kind]['bpb']:.4f} bits/byte")
    stats["acceptance"] = measure_acceptance(target, draft, eval_ids, max_windows=args.acc_windows)
    log(f"acceptance: {json.dumps(stats['acceptance'])}")
    if not args.no_readme:
        log(f"wrote {write_readme(out, stats)}")
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2, default=str) + "\n")
    return stats


if __name__ == "__main__":
    main()
