"""The bench's statistics: ratios within repeats with their 95 % intervals, the better
configuration of several, and the analytic speedup bound."""

from __future__ import annotations

import math
import statistics

from specray.runtime.bench.settings import SPECULATING, Run


def analytic_speedup(alpha: float, c: float, k: int) -> float:
    """Expected speedup of speculative decoding: (1 - a^(k+1)) / ((1 - a)(c k + 1))."""
    if alpha >= 1.0:
        return (k + 1) / (c * k + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (c * k + 1))


# (numerator, denominator) at batch 1, greedy: what prompt lookup buys in each system, and
# specray against Hugging Face.
BATCH1_RATIOS = {
    "specray ngram / specray none": (("specray", "ngram"), ("specray", "none")),
    "hf lookup / hf none": (("hf", "lookup"), ("hf", "none")),
    "specray ngram / hf none": (("specray", "ngram"), ("hf", "none")),
    "specray ngram / hf lookup": (("specray", "ngram"), ("hf", "lookup")),
    "specray none / hf none": (("specray", "none"), ("hf", "none")),
}


def batch1_ratios(runs: dict) -> dict:
    """``BATCH1_RATIOS`` within each repeat (``within_repeats``)."""
    def samples(system: str, proposer: str) -> list[float]:
        return runs[(system, proposer, 1, "greedy", "static", None)].samples

    out = {name: within_repeats(samples(*a), samples(*b)) for name, (a, b) in BATCH1_RATIOS.items()}
    # Overlap against the serial draft and against assisted generation, where both ran.
    keys = {"draft": ("specray", "draft", 1, "greedy", "static", None),
            "draft+overlap": ("specray", "draft", 1, "greedy", "static+overlap", None),
            "hf assisted": ("hf", "assisted", 1, "greedy", "static", None)}
    for a, b in (("draft+overlap", "draft"), ("draft+overlap", "hf assisted"), ("draft", "hf assisted")):
        if keys[a] in runs and keys[b] in runs:
            out[f"specray {a} / {'specray ' if b == 'draft' else ''}{b}"] = within_repeats(
                runs[keys[a]].samples, runs[keys[b]].samples)
    return out


def best_config(samples: dict[str, list[float]]) -> str:
    """The configuration with the highest geometric mean of its tokens/s over the repeats.
    Not each repeat's faster one: where two are about even, the larger of two noisy
    samples beats both their means, and a configuration held to it scores below 1 even
    against itself."""
    return max(samples, key=lambda name: sum(math.log(x) for x in samples[name] if x > 0) / len(samples[name]))


def within_repeats(samples: list[float], base: list[float]) -> dict | None:
    """``samples[i] / base[i]`` over repeats i (each pair ran minutes apart at most, under
    the same machine load): median, min and max, and the geometric mean with its 95 %
    confidence interval (Student's t on the log ratios; None for a single pair); None
    without a pair.

    The interval is what tells a goal met "within noise" from one missed: one repeat's
    ratio of two configurations scatters widely on a shared machine."""
    ratios = [x / y for x, y in zip(samples, base) if x > 0 and y > 0]
    if not ratios:
        return None
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    ci = None
    if len(logs) > 1:
        half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        ci = [math.exp(mean - half), math.exp(mean + half)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "geomean": math.exp(mean), "ci95": ci}


# Student's t, two-sided 95 %, by degrees of freedom (1-10); beyond, a Cornish-Fisher
# expansion around the normal's 1.96 (within 0.01 % from 10 on).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t975(df: int) -> float:
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def paired_ratios(runs: list[Run]) -> list[dict]:
    """Each specray draft policy's tokens/s over plain decoding's, over the other
    policies' and over the best of those, within each repeat (``within_repeats``). The
    spread says how far two configurations differ by noise alone.

    "best other" is ``best_config`` of the others, named in ``best``."""
    out = []
    for run in runs:
        if run.system != "specray" or run.proposer not in SPECULATING or run.mode != "greedy":
            continue
        others = {o.label: o.samples for o in runs
                  if o.system == "specray" and o.mode == "greedy" and o.batch_size == run.batch_size
                  and o.proposer in (run.proposer, "none") and o is not run}
        if not others:
            continue
        # Adaptive variants are compared one by one, not as what a policy must beat.
        best = best_config({name: v for name, v in others.items() if ":" not in name})
        others["best other"] = others[best]
        for name, base in others.items():
            if (ratio := within_repeats(run.samples, base)) is not None:
                out.append({"batch_size": run.batch_size, "proposer": run.proposer, "policy": run.policy, "k": run.k,
                            "against": name,
                            **({"best": best} if name == "best other" else {}), **ratio})
    return out
