"""Helpers shared by the test modules: tiny model pairs, the transformers reference,
an in-process serving run, and starting/stopping test Ray heads by pid."""

from __future__ import annotations

import os
import random
from pathlib import Path

from specray.scheduler.messages import StepPlan

ROOT = Path(__file__).resolve().parent.parent


def worker_configs(target: str, draft: str | None = None, *, block_size: int = 4, num_kv_blocks: int | None = 64,
                   max_num_seqs: int = 256, **model):
    """The (ModelConfig, CacheConfig) a worker is built from, for the worker tests: float32
    on the CPU, a small pool, unless told otherwise."""
    from specray.scheduler.config import CacheConfig
    from specray.workers.config import ModelConfig
    from specray.workers.model_files import settle_windows

    model = {"dtype": "float32", "device": "cpu", **model}
    return (settle_windows(ModelConfig(target=target, draft=draft, **model)),
            CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs))


def model_runner(path: str, **kw):
    """A ModelRunner of one checkpoint, built through the workers' own path."""
    from specray.workers.model_runner import ModelRunner

    model, cache = worker_configs(path, **kw)
    return ModelRunner(path, model, cache, model.max_model_len)


def make_pair(out_dir: Path, arch: str = "llama", vocab: int = 97, hidden: int = 64, layers: int = 2,
              heads: int = 4, kv_heads: int = 2, max_len: int = 256, draft_max_len: int | None = None,
              seed: int = 0, draft_noise: float = 0.0, draft_vocab: int | None = None, tokenizer: bool = False):
    """A target and a draft sharing its embedding, first layer and head (so the draft
    agrees with the target often but not always); returns their directories.

    ``draft_vocab``: the draft's vocabulary, padded differently from the target's: fewer
    rows (the target's first ones; the target's others are then damped, as padding rows
    are seldom emitted), or more, whose head rows are twice some shared ones (so a draft
    that proposed past the target's vocabulary would often do so).
    ``tokenizer``: save one word tokenizer (``word_tokenizer``) for the ids both share
    next to both models."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]

    def config(n_layers, max_pos):
        return cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_pos, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None, tie_word_embeddings=False)

    torch.manual_seed(seed)
    target = model_cls(config(layers, max_len))
    with torch.no_grad():
        # Sharper logits than the default init make greedy choices robust to float noise.
        target.lm_head.weight.mul_(8.0)
        # Damp the layers the draft lacks, so it agrees with the target most of the time.
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
    dcfg = config(1, draft_max_len or max_len)
    dv = draft_vocab or vocab
    if dv < vocab:
        with torch.no_grad():
            target.lm_head.weight[dv:].mul_(0.2)
    dcfg.vocab_size = dv
    draft = model_cls(dcfg)
    sd = {k: v for k, v in target.state_dict().items()
          if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = sd[name]
        if dv < vocab:
            sd[name] = w[:dv].clone()
        elif dv > vocab:
            extra = torch.arange(dv - vocab) % vocab
            sd[name] = torch.cat([w, w[extra] * (2.0 if name == "lm_head.weight" else 1.0)])
    draft.load_state_dict(sd)
    if draft_noise:
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn_like(p) * draft_noise)
    t_dir, d_dir = out_dir / f"{arch}-target", out_dir / f"{arch}-draft"
    target.save_pretrained(t_dir)
    draft.save_pretrained(d_dir)
    if tokenizer:
        for d in (t_dir, d_dir):
            word_tokenizer(min(vocab, dv)).save_pretrained(d)
    return str(t_dir), str(d_dir)


def word_tokenizer(size: int, bos: str | None = None, eos_after: bool = False, prefix: str = "w"):
    """A fast tokenizer built offline: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, then the words
    ``{prefix}3`` .. ``{prefix}{size-1}``, split on whitespace. ``bos``: None, ``"post"``
    (its post-processor puts ``<s>`` first, as Gemma 3's and Llama 3's do) or ``"flag"``
    (``add_bos_token=True``); ``eos_after``: the post-processor appends ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"{prefix}{i}": i for i in range(3, size)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    single = ("<s> " if bos == "post" else "") + "$A" + (" </s>" if eos_after else "")
    if single != "$A":
        tk.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    flag = {"add_bos_token": True} if bos == "flag" else {}
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>", **flag)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The reference: transformers' own generate(do_sample=False), one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        outs.append(out[0, len(p):].tolist())
    return outs


_GIVEN_PORTS: set[int] = set()
_PORT_RNG = random.Random()      # its own: tests that seed the global one must not make ports repeat


def free_port() -> int:
    """A port free now, for a process started later. Not one the kernel picks: those come
    from the ephemeral range (32768-60999 here), where any outgoing connection may take
    the port before the slow-starting process binds it (seen: a head's client server died
    on "Address already in use" six seconds after start). Below Ray's default worker
    ports (10002-19999) are its fixed defaults; 20000-32767 is clear of both."""
    import socket

    for _ in range(1000):
        port = _PORT_RNG.randint(20000, 32767)
        if port in _GIVEN_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN_PORTS.add(port)
        return port
    raise RuntimeError("no free port in 20000-32767")


def ray_pids(sid: int, tmp: str) -> list[int]:
    """Processes of one test cluster: those in the head's session (the head was started
    with start_new_session, and Ray never leaves the session, although it puts each worker
    process in a process group of its own) or carrying the cluster's RAY_TMPDIR."""
    needle = f"RAY_TMPDIR={tmp}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue    # already dead, not yet reaped
            if os.getsid(pid) == sid:
                pids.append(pid)
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(pid)
        except OSError:
            pass
    return pids


def stop_ray_head(proc, tmp: str) -> list[int]:
    """Stop a head started with ``ray start --head --block`` (start_new_session=True) and
    everything of its cluster, by pid; returns what could not be stopped. The head, GCS,
    raylets and monitor share its process group, worker processes have groups of their
    own within its session; ``ray start --block``, the GCS and the monitor outlive SIGTERM."""
    import signal
    import time

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    time.sleep(2)
    deadline = time.time() + 30
    while True:     # until nothing is left (a raylet may start a worker meanwhile)
        pids = ray_pids(proc.pid, tmp)
        if not pids or time.time() > deadline:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    proc.wait(timeout=30)
    return pids


def run_local(cfg, prompts, params):
    """Serve one batch on an in-process driver (the whole path but Ray); checks the pools
    are consistent and empty afterwards. ``params``: one SamplingParams or one per prompt."""
    from specray.runtime.driver.core import DriverCore

    drv = DriverCore(cfg.replace(layout="colocated"))
    try:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reply = drv.submit(prompts, plist)
        assert reply.error is None, reply.error
        outs = drv.wait(reply.request_ids, timeout=600)
        assert outs is not None
        drv.scheduler.check_integrity()
        assert all(p.num_used_blocks == 0 for p in drv.scheduler.target_pools + drv.scheduler.draft_pools)
        return outs, drv.metrics()
    finally:
        drv.shutdown()



def disagreeing_pair(out_dir: Path) -> tuple[str, str]:
    """A target and a draft of one vocabulary size whose tokenizers name other tokens by
    the same ids: a pair the driver refuses."""
    t, d = make_pair(out_dir, tokenizer=True)
    word_tokenizer(97, prefix="v").save_pretrained(d)
    return t, d


def make_plan(seq_ids, num_computed, num_new, token_ids, num_slots, *, width=0, proposal_lens=None,
              proposal_token_ids=None, draft_rows=None, temperature=None, top_k=None, top_p=None,
              seeds=None, logprobs=None, free_seq_ids=(), step_id=0) -> StepPlan:
    """A StepPlan the way the driver fills it; per-sequence knobs default to greedy/off."""
    n = len(seq_ids)
    plan = StepPlan(step_id=step_id, width=width, seq_ids=list(seq_ids), num_computed=list(num_computed),
                    num_new=list(num_new), token_ids=list(token_ids), num_slots=list(num_slots),
                    proposal_lens=list(proposal_lens) if proposal_lens is not None else [0] * n,
                    proposal_token_ids=list(proposal_token_ids or []),
                    draft_rows=list(draft_rows) if draft_rows is not None else ([-1] * n if proposal_token_ids else []),
                    temperature=list(temperature) if temperature is not None else [0.0] * n,
                    top_k=list(top_k) if top_k is not None else [0] * n,
                    top_p=list(top_p) if top_p is not None else [1.0] * n,
                    seeds=list(seeds) if seeds is not None else [0] * n,
                    logprobs=list(logprobs) if logprobs is not None else [],
                    free_seq_ids=list(free_seq_ids))
    plan.validate()
    return plan


MARK = 13      # a top_k that, here, breaks any step carrying it (as 10**12 broke the plan's packing)


def break_steps_of(call, when=lambda plan: MARK in plan.top_k) -> list[int]:
    """Make this worker call raise, as a worker does on input it cannot take, for every
    plan ``when`` holds of; returns a list counting the calls that raised."""
    raised, submit = [], call.submit

    def faulty(plan, *args):
        if plan.seq_ids and when(plan):
            raised.append(plan.step_id)
            raise OverflowError("Python int too large to convert to C int")
        return submit(plan, *args)

    call.submit = faulty
    return raised


def kill_mid_stream(rt, victim: int, prompts: list[list[int]], params) -> list[list[int]]:
    """Stream ``prompts[0]`` and generate the rest beside it; SIGKILL ``victim`` (a pid) as
    soon as the stream yields its first tokens, with the batch in flight. Every request's
    tokens, the streamed one first."""
    import signal
    import threading

    batch: list = []
    failed: list[BaseException] = []

    def rest():
        try:
            batch.extend(rt.generate(prompts[1:], params))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            failed.append(e)

    others = threading.Thread(target=rest)
    others.start()
    streamed: list[int] = []
    for delta in rt.stream(prompts[0], params):
        if not streamed and delta.token_ids:
            os.kill(victim, signal.SIGKILL)
        streamed += delta.token_ids
    others.join(timeout=300)
    if failed:
        raise failed[0]
    return [streamed] + [o.token_ids for o in batch]


def poll_stream(drv, prompt, params, resume=None, upto=None) -> tuple[list, int]:
    """One request submitted to a ``DriverCore`` and its deltas polled (all, or until
    ``upto`` tokens, then aborted); returns them and the request's seed."""
    reply = drv.submit([prompt], [params], [resume] if resume else None)
    assert reply.error is None, reply.error
    (rid,) = reply.request_ids
    deltas = []
    while not deltas or not deltas[-1].finished:
        d = drv.poll(rid, timeout=30)
        if d is not None:
            deltas.append(d)
        if upto is not None and sum(len(x.token_ids) for x in deltas) >= upto:
            drv.abort([rid])
            break
    return deltas, reply.seeds[0]
