"""``specray batch``: generate for every line of a JSONL file and write one JSON line per
accepted input line, in input order.

Input, one JSON object a line (blank lines are skipped)::

    {"prompt": "text" | [token ids], "id": <anything>, <any SamplingParams field>: ...}
    {"messages": [{"role": "user", "content": "..."}, ...], ...}   (the chat template applied)

Output, one line per accepted input line::

    {"line": N, "id": ..., "prompt_token_ids": [...], "token_ids": [...], "text": "...",
     "finish_reason": "stop" | "length", "num_draft_tokens": d, "num_accepted_tokens": a}

and, where the line set ``"logprobs": n``, one entry per token id::

    "logprobs": [{"token_id": t, "logprob": x, "top": [[id, x], ...]}, ...]

A malformed line is reported on stderr as ``line N: <reason>``. Most reasons are found
here (JSON, fields, SamplingParams values); a token id outside the vocabulary, a prompt
that fills ``max_model_len`` or a string prompt without a tokenizer are found by the
driver, which refuses a whole call naming its first bad request (``request i: ...``): that
request's line is dropped and the rest of its chunk resubmitted. ``--on-error fail`` checks
every line against the driver's limits (``SpecRuntime.info``) before generating anything
and exits with status 2 if any line is malformed.

``--input`` and ``--output`` are local paths or URIs (``batch_files``). Runs unchanged
inside ``ray job submit --working-dir . -- specray batch ...``: there ``RAY_ADDRESS`` is
set and the runtime joins that cluster; a relative ``--output`` is refused there, and the
last lines say where the output went.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable

from specray.runtime.chat import ChatPrompt, check_messages
from specray.runtime.entrypoints.batch.files import Location, Output, check_output_place, locate, read_bytes, where
from specray.runtime.entrypoints.cli_args import add_model_args, runtime_config, sampling_default
from specray.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specray.runtime.driver.replies import DriverInfo

PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))
LINE_FIELDS = ("prompt", "messages", "id") + PARAM_FIELDS
_NO_ID = object()


@dataclass
class Item:
    """One accepted input line."""

    line: int                       # 1-based line number in the input file
    prompt: str | list[int] | ChatPrompt
    params: SamplingParams
    id: object = _NO_ID


# -- reading -------------------------------------------------------------------------
def parse_line(text: str, line: int, defaults: dict) -> Item:
    """One non-blank input line; ValueError names what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"bad JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {_json_type(obj)}")
    unknown = [k for k in obj if k not in LINE_FIELDS]
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(json.dumps, unknown))}; "
                         f"allowed: {', '.join(LINE_FIELDS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError('give "prompt" or "messages"' if "prompt" in obj else 'missing "prompt" (or "messages")')
    prompt = obj.get("prompt")
    if "messages" in obj:
        prompt = ChatPrompt(check_messages(obj["messages"]))
    elif isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
    elif isinstance(prompt, list):
        if not prompt:
            raise ValueError("prompt is empty")
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be ints, got {_json_type(bad)}")
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, got {_json_type(prompt)}")
    params = SamplingParams(**{**defaults, **{k: v for k, v in obj.items() if k in PARAM_FIELDS}})
    return Item(line, prompt, params, obj.get("id", _NO_ID))


def read_input(path: str | Location, defaults: dict) -> tuple[list[Item], list[tuple[int, str]]]:
    """Accepted items and (line, reason) for the malformed lines of a local path or URI.
    Lines are split on b"\\n" only: JSON strings may hold U+2028 and friends, which
    str.splitlines would split on."""
    items, errors = [], []
    loc = path if isinstance(path, Location) else locate(path, "--input")
    data = read_bytes(loc)
    if data:
        for line, raw in enumerate(data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n"),
                                   start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append((line, f"not valid UTF-8 at byte {e.start}"))
                continue
            if not text.strip():
                continue
            try:
                items.append(parse_line(text, line, defaults))
            except ValueError as e:
                errors.append((line, str(e)))
    return items, errors


def check_against(info: DriverInfo, item: Item) -> str | None:
    """The driver's own checks, from ``SpecRuntime.info``, so ``--on-error fail`` can report
    them before anything is generated. A string prompt's length is only known once the
    driver has tokenized it."""
    if isinstance(item.prompt, ChatPrompt):
        if not info.has_chat_template:
            return "messages need a chat template, and the target's tokenizer has none"
    elif isinstance(item.prompt, str):
        if not info.has_tokenizer:
            return "prompt is a string but the target has no tokenizer; pass token ids"
    else:
        vocab = info.vocab_size
        bad = next((t for t in item.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            return f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
        if len(item.prompt) >= info.max_model_len:
            return (f"prompt has {len(item.prompt)} tokens; max_model_len {info.max_model_len} "
                    "leaves no room to generate")
    bad = next((t for t in item.params.stop_token_ids if t >= info.vocab_size), None)
    if bad is not None:
        return f"stop_token_ids entry {bad} is outside the vocabulary"
    return None


# -- generating ----------------------------------------------------------------------
def generate_chunk(rt, items: list[Item], reject: Callable[[int, str], None]) -> list[tuple[Item, object]]:
    """Generate for ``items``. The runtime admits a call whole or not at all and names its
    first bad request: drop that line, report it, and resubmit the rest."""
    from specray.runtime.driver.replies import REQUEST_ERROR, Overloaded

    pending = list(items)
    backoff = 0.05
    while pending:
        try:
            outs = rt.generate([it.prompt for it in pending], [it.params for it in pending])
        except Overloaded:
            # Other callers filled the driver's queue: wait for room rather than fail the file.
            time.sleep(backoff)
            backoff = min(2 * backoff, 2.0)
            continue
        except ValueError as e:
            m = REQUEST_ERROR.fullmatch(str(e))
            if m is None or int(m[1]) >= len(pending):
                raise
            bad = pending.pop(int(m[1]))
            reject(bad.line, m[2])
            continue
        return list(zip(pending, outs))
    return []


def output_record(item: Item, out) -> dict:
    rec = {"line": item.line}
    if item.id is not _NO_ID:
        rec["id"] = item.id
    rec.update(prompt_token_ids=out.prompt_token_ids, token_ids=out.token_ids, text=out.text,
               finish_reason=out.finish_reason, num_draft_tokens=out.num_draft_tokens,
               num_accepted_tokens=out.num_accepted_tokens)
    if out.logprobs is not None:
        rec["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                           for lp in out.logprobs]
    return rec


# -- the command ---------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True,
                   help="JSONL file, one request per line: a path or a file://, s3://, gs:// URI")
    p.add_argument("--output", required=True,
                   help="JSONL file to write (put in place whole at the end): a path, a file://, s3://, gs:// URI, "
                        "or - for stdout. Inside `ray job submit --working-dir` a relative path is refused: it "
                        "would land in the job's temporary copy of the directory")
    add_model_args(p)
    d = p.add_argument_group("sampling defaults", "for lines that do not set the field themselves")
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--temperature", type=float, default=sampling_default("temperature"),
                   help="0 for greedy (default: SamplingParams', %(default)s)")
    d.add_argument("--top-p", type=float, default=sampling_default("top_p"))
    d.add_argument("--top-k", type=int, default=sampling_default("top_k"))
    d.add_argument("--sample-seed", type=int, default=None,
                   help="seed for lines without one (default: each draws its own from --seed)")
    d.add_argument("--stop-token-ids", type=_int_list, default=[], help="comma-separated token ids")
    d.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--on-error", choices=["skip", "fail"], default="skip",
                   help="skip: report malformed lines and go on; fail: report them all and exit 2 "
                        "before generating")
    p.add_argument("--chunk-size", type=int, default=64, help="requests per generate call")
    p.add_argument("--chunks-in-flight", type=int, default=4, help="generate calls running at once")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("batch", help="generate for every line of a JSONL file")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def open_checkpoint(out: Output, items: list[Item], config):
    """The checkpoint of this job, reporting what it set aside; None where it keeps none."""
    from specray.runtime.entrypoints.batch.checkpoint import Checkpoint, checkpoint_path, model_identity

    path = checkpoint_path(out.location)
    if path is None or not items:
        return None
    try:
        checkpoint = Checkpoint(path, items, model_identity(config))
    except OSError as e:
        raise ValueError(f"cannot keep the checkpoint {path}: {e.strerror or e}") from None
    if checkpoint.started_over:
        print(f"specray batch: starting over: the checkpoint {path} was replaced ({checkpoint.started_over})",
              file=sys.stderr)
    for why in checkpoint.ignored:
        print(f"specray batch: ignored a checkpoint record ({why}); its line runs again", file=sys.stderr)
    return checkpoint


class _Refused(Exception):
    """``--on-error fail``: the driver refused a line while others were generating."""


def generate_all(rt, items: list[Item], out: Output, reject: Callable[[int, str], None], chunk_size: int,
                 in_flight: int, progress: bool, checkpoint=None) -> tuple[int, int]:
    """Run ``items`` in chunks, ``in_flight`` generate calls at a time (so the driver's batch
    stays full while a chunk waits for its longest request), and write the outputs in input
    order. ``checkpoint`` (``batch_checkpoint.Checkpoint``): each chunk's records go to it
    as the chunk finishes; its earlier records are written in their places among the new
    ones. Returns (requests done, tokens generated)."""
    from tqdm import tqdm

    chunks = iter([items[i:i + chunk_size] for i in range(0, len(items), chunk_size)])
    bar = tqdm(total=len(items), unit="req", file=sys.stderr, disable=not progress or not items, dynamic_ncols=True,
               mininterval=0.1 if sys.stderr.isatty() else 10.0)    # in a job's log: a line now and then
    pool = ThreadPoolExecutor(in_flight, thread_name_prefix="specray-batch")
    running: deque = deque()
    done = tokens = 0
    earlier = deque(sorted(checkpoint.records.items())) if checkpoint is not None else deque()

    def write_earlier(before: float) -> None:
        nonlocal done, tokens
        while earlier and earlier[0][0] < before:
            rec = earlier.popleft()[1]
            out.write(rec)
            done += 1
            tokens += len(rec["token_ids"])
    try:
        for chunk in chunks:
            running.append((chunk, pool.submit(generate_chunk, rt, chunk, reject)))
            if len(running) == in_flight:
                break
        while running:
            chunk, future = running.popleft()
            records = [(item, output_record(item, o)) for item, o in future.result()]
            if checkpoint is not None:
                checkpoint.add([rec for _, rec in records])
            for item, rec in records:
                write_earlier(item.line)
                out.write(rec)
                done += 1
                tokens += len(rec["token_ids"])
            nxt = next(chunks, None)
            if nxt is not None:
                running.append((nxt, pool.submit(generate_chunk, rt, nxt, reject)))
            bar.update(len(chunk))
            bar.set_postfix(tokens=tokens, refresh=False)
        write_earlier(float("inf"))
    finally:
        bar.close()
        pool.shutdown(wait=False, cancel_futures=True)   # calls still running end with the runtime
    return done, tokens


def run(args) -> int:
    from tqdm import tqdm

    from specray import SpecRuntime

    if args.chunk_size < 1 or args.chunks_in_flight < 1:
        raise ValueError("--chunk-size and --chunks-in-flight must be >= 1")
    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.sample_seed, stop_token_ids=args.stop_token_ids,
                    ignore_eos=args.ignore_eos)
    SamplingParams(**defaults)                       # bad flags fail here, naming the field
    check_output_place(args.output)                  # before anything starts: a job's temp dir
    config = runtime_config(args)
    try:
        items, errors = read_input(args.input, defaults)
    except OSError as e:
        raise ValueError(f"cannot read --input: {e}") from None
    fail = args.on_error == "fail"
    rejected: list[tuple[int, str]] = []

    def reject(line: int, reason: str) -> None:
        rejected.append((line, reason))
        tqdm.write(f"line {line}: {reason}", file=sys.stderr)

    def refuse(line: int, reason: str) -> None:
        reject(line, reason)
        raise _Refused

    try:
        out = Output(args.output)
    except OSError as e:
        raise ValueError(f"cannot write --output {args.output}: {e.strerror or e}") from None
    for line, reason in errors:
        reject(line, reason)
    checkpoint = rt = None
    try:
        checkpoint = open_checkpoint(out, items, config)
        if checkpoint is not None and checkpoint.records:
            print(f"specray batch: resuming: {len(checkpoint.records)} line(s) done by an earlier run "
                  f"({checkpoint.path})", file=sys.stderr)
            items = [it for it in items if it.line not in checkpoint.records]
        t0 = time.perf_counter()
        rt = SpecRuntime(config) if items else None
        t1 = time.perf_counter()
        if fail:
            for item in items:      # rt exists: items is not empty
                if why := check_against(rt.info, item):
                    reject(item.line, why)
            if rejected:
                print(f"specray batch: {len(rejected)} malformed line(s); nothing generated (--on-error fail)",
                      file=sys.stderr)
                return 2
        try:
            done, tokens = generate_all(rt, items, out, refuse if fail else reject, args.chunk_size,
                                        args.chunks_in_flight, not args.no_progress, checkpoint)
        except _Refused:                            # a tokenized string prompt was too long
            print("specray batch: a malformed line; output not written (--on-error fail)", file=sys.stderr)
            return 2
        wall = time.perf_counter() - t1
        m = rt.metrics() if rt is not None else {}
        out.commit()
        if checkpoint is not None:
            checkpoint.remove()
    finally:
        if checkpoint is not None:
            checkpoint.close()
        out.discard()
        if rt is not None:
            rt.shutdown()
    shown = "stdout" if args.output == "-" else where(out.location)
    print(f"specray batch: wrote {done} line(s) to {shown}", file=sys.stderr)
    rate = m.get("acceptance_rate")
    print(f"specray batch: {done} done, {len(rejected)} skipped, {tokens} tokens in {wall:.2f}s "
          f"({tokens / wall if wall > 0 else 0.0:.1f} tokens/s; startup {t1 - t0:.1f}s), "
          f"acceptance_rate={'n/a' if rate is None else f'{rate:.3f}'}, "
          f"mean_accepted_length={m.get('mean_accepted_length', 0.0):.2f}", file=sys.stderr)
    return 0


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _json_type(value) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
             type(None): "null"}
    return names.get(type(value), type(value).__name__)


def main(argv: list[str] | None = None) -> int:
    """``python -m specray.runtime.entrypoints.batch.job ...``: the same as ``specray batch ...``."""
    parser = argparse.ArgumentParser(prog="specray batch", description="Generate for every line of a JSONL file")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"specray: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
