"""Speculation policies replayed on the bench's closed batches, without the machine's noise.

    python benchmarks/policy_replay.py --record table.json [--target DIR --draft DIR] [--tokens 64]
    python benchmarks/policy_replay.py --table table.json [--variant NAME='{"trial_batch": 1}' ...]
                                       [--repeats 7] [--seeds 12] [--noise 0.05] [--rotate-prompts]
                                       [--surface cpu|launch-bound]

On this 2-core machine two runs of the same configuration differ by 10-30 %, so a policy
change worth 3 % takes dozens of repeats to show in ``specray bench``. Greedy decoding is
deterministic, which makes most of a run replayable:

- ``--record`` runs the target greedily on the bench's prompts (through specray itself)
  and, at every position of each output, lets the draft propose its next ``k`` greedy
  tokens (through transformers). How many of them match the target's output there is all
  a greedy verification can accept, so a sequence proposing ``k_i`` tokens at that
  position accepts exactly ``min(k_i, L)``, whatever policy brought it there.
- ``--table`` replays bench-like repeats (batch sizes 1, 8, 32 in turn, each policy
  keeping what it learned, as each bench runtime does) through the real scheduler, engine
  and policy objects, over workers that answer from the table on a simulated clock
  (``TableWorkers``). Step times come from ``StepSurface``, a smooth
  CPU-like surface near this machine's measured ones, with lognormal noise per step.
  Like the bench, every repeat serves the same prompts (batch 1: the first one);
  ``--rotate-prompts`` moves each round to the next ones, so batch 1 meets a new text
  every round, as a server would, and a policy's fit to one prompt stops passing for
  skill.

The table also holds the draft's probability of each of those greedy tokens (what a
draft worker reports as ``Proposals.confidence``), so drafts' early stops replay as the
worker makes them: where the policy sets floors (``StepPlan.min_reach``, at batch 1 by
default), a proposal stops once the product of the calibrated probabilities
(``reach_map``) falls below its floor, keeping the proposal that crossed it, and the
policy's calibration learns from the same figures. A table recorded before it held them
replays adaptive policies with ``stop_early`` off (the rate-based choice everywhere).

The surface is the weak part: it is a model, not the machine, so the replay ranks changes
to how the policy reads acceptance (trust in a sequence's record, how levels compare)
far better than it predicts absolute tokens/s. It is also kinder to the cost model than
a machine is: its step times are linear in the model's own features with 5 % noise, so
the fit splits a level's price into the draft's fixed cost and its per-pass cost from a
few steps. Traced inside ``specray bench``'s adaptive runtime, the same draft call at
k = 4 took 8-16 ms as the machine's speed drifted, and one step at another level was
enough to price every pass at twice its cost for three runs. So the replay undervalues
exploration, which keeps the levels' costs measured: it rated level trials four times
rarer at batch 1 a 2.5 % gain, and in ``specray bench`` adaptive's mean accepted length
at batch 1 was 3.03-3.50 in four runs with them, against 3.64 in the run before (the
fit's split stayed wrong for longer; they were not kept). Check any change that touches
exploration or costs against ``benchmarks/policy_side_by_side.py`` and the bench too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specray.scheduler.adaptive import AdaptiveConfig, AdaptivePolicy  # noqa: E402
from specray.scheduler.messages import Proposals, StepPlan, StepResult, decile  # noqa: E402
from specray.scheduler.speculation_policy import SpeculationPolicy, StaticPolicy  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"
MS = 1e-3


@dataclass
class AcceptanceTable:
    """Per prompt: its length in tokens and, per output position, how many of the draft's
    next ``k`` greedy tokens match the target's greedy output from there, and (None in an
    older table) the draft's probability of each of those ``k`` tokens."""

    k: int
    prompt_lens: list[int]
    matches: list[list[int]]
    confidence: list[list[list[float]]] | None = None

    def to_json(self) -> str:
        return json.dumps({"k": self.k, "prompt_lens": self.prompt_lens, "matches": self.matches,
                           "confidence": self.confidence})

    @classmethod
    def from_json(cls, text: str) -> "AcceptanceTable":
        d = json.loads(text)
        return cls(d["k"], d["prompt_lens"], d["matches"], d.get("confidence"))


def static_greedy_run(target: str, draft: str, prompts: list, max_tokens: int, k: int) -> list:
    """specray's own greedy outputs (RequestOutput) with static k, in process on CPU."""
    from specray.config import RuntimeConfig
    from specray.driver import DriverCore
    from specray.scheduler.sampling_params import SamplingParams

    drv = DriverCore(RuntimeConfig(target=target, draft=draft, num_speculative_tokens=k, device="cpu",
                                   dtype="float32", speculation_policy="static", max_num_seqs=len(prompts)),
                     backend="local")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return drv.wait(drv.submit(prompts, [params] * len(prompts)).request_ids, timeout=600)
    finally:
        drv.shutdown()


def record(target: str, draft: str, prompts: list, max_tokens: int, k: int) -> AcceptanceTable:
    import torch
    from transformers import AutoModelForCausalLM

    outs = static_greedy_run(target, draft, prompts, max_tokens, k)
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    matches, confidence = [], []
    with torch.no_grad():
        for o in outs:
            out, row, conf = list(o.token_ids), [], []
            for p in range(len(out)):
                x = torch.tensor([list(o.prompt_token_ids) + out[:p]])
                gen = model.generate(x, max_new_tokens=k, min_new_tokens=k, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
                g = gen.sequences[0, x.shape[1]:].tolist()
                # The draft's probability of each token it proposed, as a draft worker
                # computes it (softmax of the raw logits).
                conf.append([round(torch.softmax(logits[0].float(), -1)[t].item(), 6)
                             for logits, t in zip(gen.logits, g)])
                n = 0
                while n < k and p + n < len(out) and g[n] == out[p + n]:
                    n += 1
                row.append(n)
            matches.append(row)
            confidence.append(conf)
    return AcceptanceTable(k, [len(o.prompt_token_ids) for o in outs], matches, confidence)


def made_proposals(ks: list[int], floors: list[float], reach_map: list[float],
                   confidence: list[list[float]]) -> list[int]:
    """What drafts asked for ``ks`` propose under ``floors`` (0: no floor), as the draft
    worker stops them: after its j-th proposal a row's reach is the product of its
    proposals' calibrated probabilities (``reach_map`` by decile; the raw probabilities
    when it is empty), and below the floor the row stops there, keeping the j-th."""
    made = []
    for k_i, floor, conf in zip(ks, floors, confidence):
        m, reach = k_i, 1.0
        if floor > 0:
            for j in range(1, k_i):
                c = conf[j - 1]
                reach *= reach_map[decile(c)] if reach_map else c
                if reach < floor:
                    m = j
                    break
        made.append(m)
    return made


@dataclass
class StepSurface:
    """Seconds per step, CPU-like: fitted by eye to this machine's in-process step times
    (tiny pair, 2 cores: plain decoding 6.5 ms at batch 1 and 15.5 ms at 32; k = 4 for all
    15.8 and 45 ms; a 160-token prompt's prefill about 18 ms of the target's per
    sequence) and to ``specray bench``'s driver overhead, adaptive against static.

    How a speculating step splits between the draft and the target decides which level
    is worth running. Measured in process at batch 1 (median of 120-260 steps per level),
    the draft's call took 2.5 / 4.5 / 6.1 / 8.4 ms at k = 1..4, about 1.9 ms per pass, and
    the target's verification 6.7 ms plain and 6.9-8.7 ms with proposals; ``specray
    bench`` puts a k = 4 draft call at 9.5-10.4 ms at batch 8 and 12.8-14.8 ms at 32. An
    earlier fit gave the same totals with a pass at 0.67 ms and verification 2 ms dearer:
    deep levels were a third cheaper than on the machine, and fixed k = 3 against k = 4
    at batch 1 across the table's prompts came out 0.95 where it is 1.02 now."""

    plain: float = 6.2 * MS           # the target's step without proposals ...
    plain_seq: float = 0.29 * MS      # ... and per sequence
    spec: float = 0.6 * MS            # the target's extra for scoring proposals at all ...
    spec_token: float = 0.12 * MS     # ... per (proposed + padded) token / 2
    draft: float = 0.5 * MS           # the draft's call ...
    draft_pass: float = 1.9 * MS      # ... per pass (its longest proposal) ...
    draft_pass_seq: float = 0.04 * MS     # ... per pass and sequence ...
    draft_fed: float = 0.012 * MS     # ... per token it catches up on
    prefill: float = 0.0              # the target's prefill step besides ...
    prefill_seq: float = 18 * MS      # ... its cost per prompt
    draft_prefill_seq: float = 1.7 * MS
    driver: float = 0.18 * MS         # the driver's own work per step ...
    driver_seq: float = 0.0085 * MS
    policy: float = 0.22 * MS         # ... and an adaptive policy's on top
    policy_seq: float = 0.009 * MS

    def target(self, n: int, proposed: int, longest: int) -> float:
        t = self.plain + self.plain_seq * n
        return t + (self.spec + self.spec_token * (proposed + n * longest) / 2 if proposed else 0.0)

    def drafting(self, n: int, longest: int, fed: int) -> float:
        return self.draft + (self.draft_pass + self.draft_pass_seq * n) * longest + self.draft_fed * fed

    def overhead(self, n: int, adaptive: bool) -> float:
        return self.driver + self.driver_seq * n + ((self.policy + self.policy_seq * n) if adaptive else 0.0)


def launch_bound_surface() -> StepSurface:
    """An accelerator where a forward pass of these tiny models costs its kernel launches
    and Python, not its tokens: the target's step about 2 ms (4 layers) whatever it
    verifies, a draft pass about 0.6 ms (1 layer and the head), a prefill step about a
    decode step. NOT measured (no GPU was lent to the session that wrote it): a sketch of
    the regime an accelerator puts small models in, where a verified token is nearly
    free. Speculation then pays at every batch size here, and the best fixed k on the
    table's prompts is 3 at batch 1 and 2 at 8 and 32 (a closed batch waits for its
    slowest acceptors). The driver's and the adaptive policy's own times are the CPU
    surface's, the same Python on a host CPU, and they become a large share of a short
    step: this is the surface to ask what the policy's own work costs. Refit it from
    ``specray bench``'s ``step_ms`` on a real device before reading more into it."""
    return StepSurface(plain=2.0 * MS, plain_seq=0.005 * MS, spec=0.1 * MS, spec_token=0.002 * MS,
                       draft=0.3 * MS, draft_pass=0.6 * MS, draft_pass_seq=0.002 * MS, draft_fed=0.0005 * MS,
                       prefill=2.0 * MS, prefill_seq=0.1 * MS, draft_prefill_seq=0.05 * MS,
                       driver=0.5 * MS, driver_seq=0.01 * MS)


SURFACES = {"cpu": StepSurface, "launch-bound": launch_bound_surface}


@dataclass
class ReplayedBatch:
    tokens_per_s: float
    steps: int
    proposed: list[int]              # per sequence, over the whole run
    accepted: list[int]


class Drift:
    """The machine's speed, for every kind of step alike: lognormal with ``sigma``, drawn
    again every ``period`` steps (on the 2-core CPU step times moved by 30 % within a
    minute). Each run of a batch draws its own sequence of speeds, indexed by its steps."""

    def __init__(self, sigma: float, period: int, seed: int) -> None:
        self.sigma, self.period = sigma, period
        self.rng = random.Random(seed)
        self.steps, self.speed = 0, 1.0

    def factor(self) -> float:
        """A step's time multiplier; advances one step."""
        if self.steps % self.period == 0:
            self.speed = math.exp(self.rng.gauss(0.0, self.sigma))
        self.steps += 1
        return self.speed


class TableWorkers:
    """A draft and a target worker that answer from the table, on a simulated clock: the
    draft proposes ``k_i`` tokens (stopping below its floor as a draft worker does, from
    the table's probabilities), the target accepts ``min(k_i, L)`` of them, and each call
    advances the clock by what the surface says it costs."""

    def __init__(self, table: AcceptanceTable, surface: StepSurface, rng: random.Random, noise: float,
                 drift: Drift | None, adaptive: bool) -> None:
        self.table, self.surface, self.rng, self.noise, self.drift = table, surface, rng, noise, drift
        self.adaptive = adaptive
        self.now = 0.0
        self.rows: dict[int, tuple[int, int]] = {}      # seq id -> (table row, prompt length)
        self._slow = 1.0

    def clock(self) -> float:
        return self.now

    def _jitter(self) -> float:
        return math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else 1.0

    def overhead(self, n: int) -> None:
        """The driver's (and an adaptive policy's) own time of a step of ``n``; the step's
        drift is drawn here, before its worker calls."""
        self._slow = self.drift.factor() if self.drift is not None else 1.0
        self.now += self.surface.overhead(n, self.adaptive) * self._jitter() * self._slow

    def _gen(self, plan: StepPlan, i: int) -> int:
        row, plen = self.rows[plan.seq_ids[i]]
        return plan.num_computed[i] + plan.num_new[i] - plen

    def propose(self, plan: StepPlan) -> tuple[Proposals, None]:
        n, k = plan.num_seqs, plan.k
        lens = list(plan.proposal_lens)
        conf_rows = None
        if plan.min_reach and self.table.confidence is not None:
            conf_rows = [self.table.confidence[self.rows[sid][0]][self._gen(plan, i)] for i, sid in enumerate(plan.seq_ids)]
            lens = made_proposals(lens, list(plan.min_reach), list(plan.reach_map), conf_rows)
        longest = max(lens, default=0)
        s = self.surface
        if n and all(c == 0 for c in plan.num_computed):     # everyone arrived together: prefill
            t = s.draft_prefill_seq * n * self._jitter() + s.drafting(n, longest, 0)
        else:
            t = s.drafting(n, longest, sum(plan.num_new)) * self._jitter()
        self.now += t * self._slow
        tokens = [1 if j < m else -1 for m in lens for j in range(k)]
        confidence = [c if j < m else 0.0 for m, row in zip(lens, conf_rows) for j, c in enumerate(row[:k])] \
            if conf_rows is not None else []
        return Proposals(step_id=plan.step_id, k=k, seq_ids=list(plan.seq_ids), proposal_lens=lens,
                         token_ids=tokens, confidence=confidence), None

    def verify(self, plan: StepPlan, probs: list) -> StepResult:
        n = plan.num_seqs
        ks = list(plan.proposal_lens) if plan.proposal_token_ids else [0] * n
        proposed, longest = sum(ks), max(ks, default=0)
        s = self.surface
        if n and all(c == 0 for c in plan.num_computed):
            t = (s.prefill + s.prefill_seq * n) * self._jitter() + s.target(n, proposed, longest) - s.target(n, 0, 0)
        else:
            t = s.target(n, proposed, longest) * self._jitter()
        self.now += t * self._slow
        emitted = [min(ki, self.table.matches[self.rows[sid][0]][self._gen(plan, i)]) + 1
                   for i, (sid, ki) in enumerate(zip(plan.seq_ids, ks))]
        return StepResult(step_id=plan.step_id, seq_ids=list(plan.seq_ids), num_emitted=emitted,
                          token_ids=[1] * sum(emitted))


def replay_batch(policy: SpeculationPolicy | None, table: AcceptanceTable, batch: int, max_tokens: int,
                 surface: StepSurface, rng: random.Random, noise: float = 0.05, first: int = 0,
                 drift: Drift | None = None) -> ReplayedBatch:
    """One closed batch of ``batch`` of the table's prompts from the ``first``-th on
    (wrapping around), all admitted together, through the real scheduler and engine;
    ``policy`` None is plain decoding. The lookahead is the table's ``k``, as a runtime's
    is its widest step: each policy keeps within its own."""
    from specray.engine import Engine, LocalCall
    from specray.scheduler.adaptive import AdaptivePolicy
    from specray.scheduler.block_manager import BlockManager
    from specray.scheduler.config import CacheConfig
    from specray.scheduler.sampling_params import SamplingParams
    from specray.scheduler.scheduler import Scheduler, SchedulerConfig
    from specray.scheduler.sequence import Sequence

    rows = [(first + i) % len(table.matches) for i in range(batch)]
    if any(len(table.matches[r]) < max_tokens for r in rows):
        raise ValueError(f"the table holds fewer than max_tokens={max_tokens} positions per prompt")
    workers = TableWorkers(table, surface, rng, noise, drift, isinstance(policy, AdaptivePolicy))
    lookahead = table.k if policy is not None else 0
    longest_prompt = max(table.prompt_lens[r] for r in rows)
    config = SchedulerConfig(target_max_len=longest_prompt + max_tokens + lookahead + 2,
                             max_speculative_tokens=lookahead,
                             cache=CacheConfig(block_size=16, max_num_seqs=batch, max_num_batched_tokens=10**6))
    sched = Scheduler(config, BlockManager(10**6, 16), None, num_proposers=1 if policy is not None else 0,
                      policy=policy)
    schedule = sched.schedule

    def scheduled():
        step = schedule()
        if step is not None:
            workers.overhead(len(step.seqs))
        return step
    sched.schedule = scheduled
    engine = Engine(sched, [LocalCall(workers.verify)], [LocalCall(workers.propose)] if policy is not None else [],
                    clock=workers.clock)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = []
    for i, r in enumerate(rows):
        plen = table.prompt_lens[r]
        seq = Sequence(seq_id=i + 1, request_id=str(i + 1), prompt_len=plen, tokens=[1] * plen, params=params, seed=i)
        workers.rows[seq.seq_id] = (r, plen)
        sched.add(seq)
        seqs.append(seq)
    steps = 0
    while sched.has_work:
        engine.step()
        steps += 1
    return ReplayedBatch(batch * max_tokens / workers.now, steps, [s.num_draft_tokens for s in seqs],
                         [s.num_accepted_tokens for s in seqs])


def replay_bench(factories: dict, table: AcceptanceTable, batch_sizes: list[int], max_tokens: int,
                 repeats: int, seeds: int, surface: StepSurface, noise: float,
                 rotate: bool = False, drift: float = 0.0, drift_period: int = 40) -> dict[tuple[int, str], list[float]]:
    """name -> a factory of fresh policies (None: plain decoding); each seed builds every
    policy afresh and runs ``repeats`` rounds of the batch sizes. Returns tokens/s per
    (batch, name), one per (seed, repeat), aligned across names. The bench's batch of
    ``b`` is always its first ``b`` prompts; with ``rotate`` round ``r`` takes the ``b``
    prompts after the first ``r * b`` instead, so batch 1 meets a different text every
    round, as a server would."""
    out: dict[tuple[int, str], list[float]] = {}
    for seed in range(seeds):
        rng = random.Random(seed)
        policies = {name: make() for name, make in factories.items()}
        for r in range(repeats):
            for b in batch_sizes:
                for name, pol in policies.items():
                    # Every policy of a round meets the same spells, as runs seconds apart do.
                    run = replay_batch(pol, table, b, max_tokens, surface, rng, noise, first=r * b if rotate else 0,
                                       drift=Drift(drift, drift_period, seed * 100003 + r * 101 + b) if drift else None)
                    out.setdefault((b, name), []).append(run.tokens_per_s)
    return out


def policy_factory(kwargs: dict, stops: bool = True):
    """A factory of adaptive policies with ``kwargs``: ``AdaptiveConfig`` fields, and dotted
    keys for a field of a component, e.g. ``{"spread.prior_weight": 4.0,
    "switch.explore_every": 32}``. ``stops``: whether the table replays drafts' early stops
    (it holds their probabilities). Without them a policy that counts on stops (a sequence
    alone proposing up to its cap) would replay as static k, so its policies choose by
    rates alone unless a variant says otherwise."""
    top = {"stop_early": stops, **{key: v for key, v in kwargs.items() if "." not in key}}
    AdaptiveConfig(**top)       # refuse a bad field before any run
    parts: dict[str, dict] = {}
    for key, v in kwargs.items():
        if "." in key:
            part, name = key.split(".", 1)
            parts.setdefault(part, {})[name] = v

    def make() -> AdaptivePolicy:
        pol = AdaptivePolicy(AdaptiveConfig(**top))
        for part, changes in parts.items():
            component = getattr(pol, part)
            names = {f.name for f in dataclasses.fields(component) if f.init}
            for name in changes:
                if name not in names:
                    raise ValueError(f"{part} has no field {name!r}")
            # A fresh component built with the changes, as its own __init__ would.
            setattr(pol, part, dataclasses.replace(component, **changes))
        return pol
    return make


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", help="write an acceptance table here (runs the models)")
    ap.add_argument("--table", help="replay this acceptance table")
    ap.add_argument("--target", default=str(MODELS / "tiny-target"))
    ap.add_argument("--draft", default=str(MODELS / "tiny-draft"))
    ap.add_argument("-k", type=int, default=None,
                    help="recording: the draft's proposals per position (default 4); replaying: static k and "
                         "adaptive's k, a request alone reaching up to twice it within the table's "
                         "(default: the table's)")
    ap.add_argument("--prompts", type=int, default=32, help="bench prompts to record (the largest batch)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--noise", type=float, default=0.05, help="lognormal sigma of each step's time")
    ap.add_argument("--drift", type=float, default=0.0,
                    help="lognormal sigma of the machine's speed, every kind of step alike (0: none)")
    ap.add_argument("--drift-period", type=int, default=40, help="steps between draws of the machine's speed")
    ap.add_argument("--surface", choices=sorted(SURFACES), default="cpu",
                    help="step times: this CPU's (fitted) or a launch-bound accelerator's (a sketch, unmeasured)")
    ap.add_argument("--rotate-prompts", action="store_true",
                    help="each round's batch takes the next prompts of the table (batch 1: another text each round)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="an adaptive policy with these AdaptiveConfig fields (dotted: a component's)")
    args = ap.parse_args()
    if bool(args.record) == bool(args.table):
        ap.error("give exactly one of --record and --table")
    if args.record:
        from specray.stdlib_corpus import held_out_prompts
        table = record(args.target, args.draft, held_out_prompts(args.prompts), args.tokens, args.k or 4)
        Path(args.record).write_text(table.to_json())
        mean = statistics.mean(x for row in table.matches for x in row)
        print(f"wrote {args.record}: {len(table.matches)} prompts x {args.tokens} positions, mean match {mean:.2f}")
        return
    table = AcceptanceTable.from_json(Path(args.table).read_text())
    stops = table.confidence is not None
    k = args.k or table.k
    if k > table.k:
        ap.error(f"-k {k} is past the table's {table.k} proposals per position")
    # As the runtime does: alone (with stops) a request reaches twice k, here within the table.
    caps = {"k": k, "max_speculative_tokens": min(2 * k, table.k)}
    factories = {"static": lambda: StaticPolicy(k), "none": lambda: None,
                 "adaptive": policy_factory(caps, stops)}
    for spec in args.variant:
        name, _, kw = spec.partition("=")
        factories[name] = policy_factory({**caps, **json.loads(kw or "{}")}, stops)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    res = replay_bench(factories, table, batch_sizes, args.tokens, args.repeats, args.seeds, SURFACES[args.surface](),
                       args.noise, rotate=args.rotate_prompts, drift=args.drift, drift_period=args.drift_period)
    drafts = [name for name in factories if name not in ("static", "none")]
    print(f"{'batch':>5}  " + " ".join(f"{name:>9}" for name in factories) + "   over the better of static and none")
    for b in batch_sizes:
        best = [max(xs) for xs in zip(res[(b, "static")], res[(b, "none")])]
        ratios = " ".join(f"{name} {statistics.median([x / y for x, y in zip(res[(b, name)], best)]):.3f}"
                          for name in drafts)
        print(f"{b:5d}  " + " ".join(f"{statistics.median(res[(b, name)]):9.0f}" for name in factories) + "   " + ratios)


if __name__ == "__main__":
    main()
