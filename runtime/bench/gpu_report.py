"""What ``benchmarks/gpu_check.py`` concludes from its figures: output agreement, and
which findings are failures.

Exactness is gated in float32 only. In bf16 specray's greedy output need not equal
transformers' token for token: the reference decodes one row at a time through other
kernels (flash attention, other matmul shapes), and where two candidates' logits lie
within bf16 rounding of each other another kernel may flip the argmax, after which the
continuations part. So bf16 is reported, not gated: per prompt the first position where
the outputs differ, over all the share of positions that agree, beside the same figures
for transformers against itself at another batch size (its own bf16 noise).

A summary's parts (``exactness``, ``precision``, ``forward``, ``bench``) each carry a
``status`` ("ok", "error" or "timeout": the part overran its time budget); ``failures``
lists what makes the check fail: a part that did not finish, a float32 mismatch, a
layout that did not start, on CUDA a layout whose CUDA graphs failed to capture or never
replayed, the forward check's failures, a bench whose greedy outputs differ.
"""

from __future__ import annotations


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (one ending early counts), or None."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None and len(a) != len(b):
        n = min(len(a), len(b))
    return n


def agreement(got: list[list[int]], ref: list[list[int]]) -> dict:
    """Per prompt, the first divergence; over all, the share of positions (of the longer
    output) holding the same token."""
    if len(got) != len(ref):
        raise ValueError(f"{len(got)} outputs against {len(ref)} references")
    positions = sum(max(len(g), len(r)) for g, r in zip(got, ref))
    equal = sum(sum(x == y for x, y in zip(g, r)) for g, r in zip(got, ref))
    firsts = [first_divergence(g, r) for g, r in zip(got, ref)]
    return {"exact": all(f is None for f in firsts),
            "equal_token_share": round(equal / positions, 4) if positions else 1.0,
            "first_divergence": firsts}


def precision_report(specray: list[list[int]], reference: list[list[int]], reference_batched: list[list[int]],
                     batch_size: int) -> dict:
    """specray against transformers (batch 1), and transformers at ``batch_size`` against
    itself at batch 1."""
    return {"specray_vs_transformers": agreement(specray, reference),
            f"transformers_batch{batch_size}_vs_batch1": agreement(reference_batched, reference)}


def failures(summary: dict) -> list[str]:
    out = []
    cuda = summary.get("device") == "cuda"
    for name, part in summary.get("parts", {}).items():
        status = part.get("status")
        if status != "ok":
            out.append(f"{name}: {status}" + (f" ({part['error']})" if part.get("error") else ""))
    for item in summary.get("parts", {}).get("exactness", {}).get("items", []):
        label = f"exactness {item['layout']}/{item['proposer']}"
        if item.get("error"):
            out.append(f"{label}: {item['error']}")
        elif not item.get("exact"):
            out.append(f"{label}: float32 output differs from transformers' generate")
        elif cuda and item.get("cuda_graphs"):
            g = item.get("graphs", {})
            if g.get("graph_capture_failures"):
                out.append(f"{label}: CUDA graph capture failed on {g['graph_capture_failures']} worker(s)")
            elif not g.get("graph_replays"):
                out.append(f"{label}: no step replayed a CUDA graph")
    for item in summary.get("parts", {}).get("tensor_parallel", {}).get("items", []):
        label = f"tensor_parallel {item['proposer']}"
        if item.get("error"):
            out.append(f"{label}: {item['error']}")
        elif not item.get("exact"):
            out.append(f"{label}: float32 output at tensor_parallel_size=2 differs from transformers' generate")
    forward = summary.get("parts", {}).get("forward", {})
    out += [f"forward: {f}" for f in forward.get("failures", [])]
    for layout, bench in summary.get("parts", {}).get("bench", {}).get("layouts", {}).items():
        if bench.get("error"):
            out.append(f"bench {layout}: {bench['error']}")
        elif not bench.get("greedy_outputs_equal"):
            out.append(f"bench {layout}: greedy outputs differ: {bench.get('mismatches', [])[:3]}")
    return out
