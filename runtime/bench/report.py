"""The bench's outputs: ``bench.json``, a bar plot and the table printed."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from specray.runtime.bench.settings import PHASES, Run


def public(r: Run) -> dict:
    d = asdict(r)
    for key in ("accepted", "drafted", "emitted", "seq_steps", "steps", "phase_s"):
        d.pop(key)
    return d


def write_outputs(result: dict, out_dir: str) -> tuple[Path, Path | None]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "bench.json"
    jpath.write_text(json.dumps(result, indent=2))
    return jpath, _plot(result, out / "bench.png")


def _plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [r for r in result["runs"] if r["mode"] == "greedy"]
    for r in runs:
        r["label"] = (f"{r['system']}/{r['proposer']}" + (f"/{r['policy']}" if r["proposer"] == "draft" else "")
                      + (f"/k{r['k']}" if r.get("k") is not None else ""))
    labels = sorted({r["label"] for r in runs})
    sizes = sorted({r["batch_size"] for r in runs})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs, ys, err = [], [], [[], []]
        for j, b in enumerate(sizes):
            for r in runs:
                if r["label"] == label and r["batch_size"] == b:
                    xs.append(j + i * width)
                    ys.append(r["tokens_per_s"])
                    err[0].append(r["tokens_per_s"] - r["tokens_per_s_min"])
                    err[1].append(r["tokens_per_s_max"] - r["tokens_per_s"])
        ax.bar(xs, ys, width, yerr=err, label=label, capsize=2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"batch {b}" for b in sizes])
    ax.set_ylabel("tokens/s (median, min-max)")
    figures = (f"alpha={result['alpha']:.2f}, c={result['c']:.2f}" if result["alpha"] is not None
               else f"{result.get('prompt_set', 'code')} prompts")
    ax.set_title(f"specray bench: {result['draft_label']} draft, k={result['k']}, {figures}, {result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _policy(r: dict) -> str:
    return r["policy"] + (f" k{r['k']}" if r.get("k") is not None else "")


def _eagle3_lines(e: dict | None) -> list[str]:
    """The EAGLE-3 head beside the draft model (``run.eagle3_figures``)."""
    if not e:
        return []
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = ["", "eagle3 beside the draft (greedy; tokens/s ratio within each repeat, median)"]
    for b, row in e["by_batch"].items():
        ratio = row.get("tokens_per_s_over_draft")
        lines.append(f"  batch {b:>3}: accept {f(row['acceptance_rate'])}  mean_len {f(row['mean_accepted_length'], 2)}"
                     f" (draft {f(row.get('draft_mean_accepted_length'), 2)})  tokens/s over draft "
                     f"{f(ratio['median'] if ratio else None)}")
    if e.get("c") is not None:
        lines.append(f"  batch 1: alpha {f(e['alpha'])}  c {f(e['c'])} (draft {f(e.get('draft_c'))})  "
                     f"analytic bound {f(e['analytic_bound'], 2)}  measured {f(e['measured_speedup'], 2)}")
    return lines


def format_table(result: dict) -> str:
    w = max([8] + [len(_policy(r)) for r in result["runs"]])        # the policy column, variants included
    against = lambda p: p["against"] + (f" ({p['best']})" if p.get("best") else "")  # noqa: E731
    a = max([14] + [len(against(p)) for p in result.get("paired", [])])
    head = (f"{'system':8} {'proposer':9} {'policy':{w}} {'mode':8} {'batch':>5} {'tokens/s':>10} {'spread':>17} "
            f"{'accept':>7} {'mean_len':>8}")
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        mal = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        spread = f"{r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}"
        lines.append(f"{r['system']:8} {r['proposer']:9} {_policy(r):{w}} {r['mode']:8} {r['batch_size']:>5} "
                     f"{r['tokens_per_s']:>10.1f} {spread:>17} {acc:>7} {mal:>8}")
    lines.append("")
    lines.append("per step, ms (draft and verify: the workers' own compute; overhead: the rest of the step)")
    names = [*PHASES, "overhead", "step"]
    head = f"{'proposer':9} {'policy':{w}} {'batch':>5} " + " ".join(f"{n:>9}" for n in names)
    lines += [head, "-" * len(head)]
    for r in result["runs"]:
        if r["step_ms"] and r["mode"] == "greedy":
            lines.append(f"{r['proposer']:9} {_policy(r):{w}} {r['batch_size']:>5} "
                         + " ".join(f"{r['step_ms'][n]:>9.3f}" for n in names))
    if result.get("paired"):
        lines.append("")
        lines.append("draft runs over others, tokens/s ratio within each repeat (median, min-max, "
                     "geometric mean and its 95 % interval)")
        head = (f"{'proposer':9} {'policy':{w}} {'batch':>5} {'against':>{a}} {'ratio':>6} {'spread':>11} "
                f"{'geomean':>8} {'95 %':>11}")
        lines += [head, "-" * len(head)]
        for p in result["paired"]:
            ci = f"{p['ci95'][0]:.2f}-{p['ci95'][1]:.2f}" if p["ci95"] else "-"
            lines.append(f"{p.get('proposer', 'draft'):9} {_policy(p):{w}} {p['batch_size']:>5} {against(p):>{a}} "
                         f"{p['median']:>6.3f} "
                         f"{p['min']:>5.2f}-{p['max']:.2f} {p['geomean']:>8.3f} {ci:>11}")
    lines += _eagle3_lines(result.get("eagle3"))
    if result.get("batch1_ratios"):
        lines.append("")
        lines.append("batch 1 tokens/s ratios within each repeat (median, min-max)")
        for name, q in result["batch1_ratios"].items():
            if q is not None:
                lines.append(f"  {name:28} {q['median']:6.3f}  {q['min']:.2f}-{q['max']:.2f}")
    lines.append("")
    if result["alpha"] is None:
        lines.append(f"k={result['k']}  no draft: n-gram and plain decoding only")
    else:
        lines.append(f"k={result['k']}  alpha={result['alpha']:.3f}  c={result['c']:.3f}  "
                     f"analytic bound={result['analytic_bound']:.2f}x  measured (draft vs none, batch 1)="
                     f"{result['measured_speedup']:.2f}x  efficiency={result['efficiency']:.2f}")
    lines.append(f"greedy outputs equal across every configuration: {result['greedy_outputs_equal']}")
    lines.append(f"prompts: the {result.get('prompt_set', 'code')} set, "
                 + ("the next ones every repeat (--rotate-prompts)" if result.get("rotate_prompts")
                                else "the same ones every repeat"))
    return "\n".join(lines)
