"""The real ``Engine`` and ``Scheduler`` driven over pure-Python stand-ins for N target and
M draft workers (``Harness``), for the scheduler's tests.

The "model" is a deterministic function of the token history; the draft proposes the same
function but is wrong at positions chosen by ``draft_wrong``. Each fake worker (one per
target rank and one per draft rank) keeps what a real worker keeps -- per sequence, the
tokens in its KV cache and a BlockManager resized the way ``workers/kv_cache.py`` resizes
it -- and asserts the ``num_computed`` invariant on every plan: ``num_computed`` is exactly
the length of the cached prefix that matches the sequence's true tokens (nothing stale is
trusted, nothing valid is recomputed), and the fed tokens complete it to exactly the
sequence's current length.

On every step the engine also checks what the driver promises the workers: each sequence
sits on one target and one draft rank and keeps them while it runs; each rank's plan holds
exactly its own sequences and exactly the frees of the sequences it held that finished or
were preempted since its last plan (a plan may carry only frees); preemption on a target
rank takes the newest sequences of that rank; and once the workers applied their plans
every rank's pool equals the driver's mirror of it.

Workers can also die (``kill_draft`` / ``kill_target``, or ``fail_drafts`` / ``fail_targets``
during a step's call): the killed fake worker answers its next call with ``WorkerLost``, as a
Ray worker does, comes back holding nothing once ``back_at`` allows, and any plan that still
trusts what it held fails the ``num_computed`` check above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specray.runtime.engine.core import Engine
from specray.runtime.transport.draft_proposer import DraftModelProposer
from specray.runtime.transport.worker_call import WorkerLost
from specray.scheduler.block_manager import BlockManager
from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.scheduler.messages import Proposals, StepPlan, StepResult, decode, encode
from specray.scheduler.proposal_choice import common_prefix
from specray.scheduler.proposers.merged import MergedProposer
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.scheduler import Scheduler
from specray.scheduler.sequence import Sequence, SequenceStatus
from specray.scheduler.speculation_policy import SpeculationPolicy, StaticPolicy
from specray.scheduler.step import ScheduledStep, StepOutcome, Verdict
from specray.scheduler.token_logprob import TokenLogprob

V = 97


def true_next(tokens: list[int]) -> int:
    return (31 * tokens[-1] + 7 * len(tokens)) % V


def true_logprob(tokens: list[int], n: int) -> TokenLogprob:
    """The "model"'s logprob of its next token after ``tokens`` and its top ``n``: a
    function of the history, in quarters (float32 carries them exactly)."""
    base = -(len(tokens) % 4) / 4
    t = true_next(tokens)
    return TokenLogprob(t, base, [((t + j) % V, base - j) for j in range(n)])


def default_wrong(seq_id: int, pos: int) -> bool:
    return (3 * seq_id + 5 * pos) % 7 in (0, 3)


def reference(prompt: list[int], max_tokens: int, stop_ids=(), max_len: int | None = None) -> tuple[list[int], str]:
    """What plain greedy decoding emits: the true next token, max_tokens times."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        t = true_next(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop_ids:
            return out, "stop"
        if max_len is not None and len(tokens) >= max_len:
            return out, "length"
    return out, "length"


def make_seq(seq_id: int, prompt: list[int], max_tokens: int, stop_ids=(), **params) -> Sequence:
    """``params``: other SamplingParams fields (logprobs, speculation)."""
    return Sequence(seq_id=seq_id, request_id=f"req-{seq_id}", prompt_len=len(prompt), tokens=list(prompt),
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params), seed=seq_id,
                    stop_ids=frozenset(stop_ids))


def prompt_for(seq_id: int, length: int) -> list[int]:
    return [(seq_id * 13 + 5 * j + 1) % V for j in range(length)]


def roundtrip(plan: StepPlan) -> StepPlan:
    """What a worker receives: the plan after the wire (validates it, too)."""
    return decode(encode(plan), expected=StepPlan)


class FakeWorker:
    def __init__(self, name: str, num_blocks: int, block_size: int) -> None:
        self.name = name
        self.cache: dict[int, list[int]] = {}
        self.judged: dict[int, int] = {}   # seq id -> its length after the last step that judged its proposals
        self.blocks = BlockManager(num_blocks, block_size)
        self.num_plans = 0          # plans received
        self.num_seq_plans = 0      # plans received that carried sequences

    def apply(self, plan: StepPlan, truth: dict[int, list[int]]) -> list[list[int]]:
        """Frees, then per sequence: check and truncate the cache to num_computed, feed the
        new tokens, resize the block mirror. Returns each sequence's history after feeding."""
        self.num_plans += 1
        self.num_seq_plans += bool(plan.seq_ids)
        for sid in plan.free_seq_ids:
            self.cache.pop(sid, None)
            self.judged.pop(sid, None)
            self.blocks.free(sid)
        histories = []
        pos = 0
        for i, sid in enumerate(plan.seq_ids):
            c, m, slots = plan.num_computed[i], plan.num_new[i], plan.num_slots[i]
            assert sid in truth, f"{self.name}: seq {sid} is not part of this step"
            cache = self.cache.setdefault(sid, [])
            assert c <= len(cache), f"{self.name}: seq {sid} computed {c} > cached {len(cache)}"
            assert cache[:c] == truth[sid][:c], f"{self.name}: seq {sid} cached prefix is stale"
            # ... and nothing the worker already holds correctly is fed again: of the tokens
            # known when its last proposals were judged (``judged``), all it holds but the
            # last, which a worker is always fed (after a suffix proposal won, a draft may
            # hold correct tokens past what that step emitted: they are fed again)
            known = truth[sid][:self.judged[sid]] if sid in self.judged else truth[sid]
            held = common_prefix(cache, known)
            assert c == (min(held, len(known) - 1) if sid in self.judged else held), \
                f"{self.name}: seq {sid} re-fed cached tokens"
            del cache[c:]
            cache.extend(plan.token_ids[pos:pos + m])
            pos += m
            assert cache == truth[sid], f"{self.name}: seq {sid} fed tokens do not complete its history"
            assert c <= self.num_slots(sid), f"{self.name}: seq {sid} has fewer slots than computed"
            assert self.blocks.allocate_slots(sid, slots), f"{self.name}: worker pool out of blocks"
            histories.append(list(cache))
        self.blocks.check_integrity()
        return histories

    def num_slots(self, seq_id: int) -> int:
        return len(self.blocks.block_table(seq_id)) * self.blocks.block_size


@dataclass
class Counts:
    seq_steps: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_calls: int = 0


@dataclass
class Preemption:
    step_id: int
    seq_id: int
    target_rank: int
    # running sequences of other target ranks that were newer than the victim (and kept running)
    newer_elsewhere: list[int]


class Down(Exception):
    """What a fake call hands back when its worker died: ``wait`` raises WorkerLost."""


class FakeCall:
    """One fake worker rank as the real ``Engine`` reaches it (a ``WorkerCall``). A killed
    rank answers its next call with WorkerLost, as a Ray worker does whose call was lost or
    that restarted empty, and then answers ``alive()`` once the harness brings it back."""

    def __init__(self, harness: "Harness", kind: str, rank: int) -> None:
        self.h, self.kind, self.rank = harness, kind, rank

    def submit(self, plan: StepPlan, *args):
        h = self.h
        if (self.kind, self.rank) in h.dead:
            h.dead.discard((self.kind, self.rank))
            h.losses[self.kind] += 1
            return Down()
        if self.kind == "draft":
            return h.propose(self.rank, plan)
        return h.verify(self.rank, plan, *args)

    def wait(self, handle):
        if isinstance(handle, Down):
            raise WorkerLost(f"{self.kind} worker {self.rank} died")
        return handle

    def alive(self) -> bool:
        return self.h.tick >= self.h.back_at.get((self.kind, self.rank), 0)

    def gone(self) -> bool:
        return (self.kind, self.rank) in self.h.gone_for_good

    def close(self) -> None:
        pass


@dataclass
class Harness:
    """The real ``Engine`` (schedule -> draft every rank -> merge -> verify every rank ->
    update) over fake workers, with the checks above around the scheduler's calls."""
    sched: Scheduler
    targets: list[FakeWorker]
    drafts: list[FakeWorker]
    draft_wrong: Callable[[int, int], bool] = default_wrong
    probs: bool = False          # even draft ranks send probabilities (draft_rows are then checked)
    # how many of its planned k_i tokens the proposer actually proposes (n-gram style)
    shorten: Callable[[int, int, int], int] | None = None
    counts: Counts = field(default_factory=Counts)
    finished: dict[int, Sequence] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    steps: list[ScheduledStep] = field(default_factory=list)     # kept when keep_steps
    verdicts: list[list[Verdict]] = field(default_factory=list)     # kept when keep_steps
    on_step: Callable[[ScheduledStep], None] | None = None
    on_plan: Callable[[ScheduledStep], None] | None = None
    keep_steps: bool = False
    # admissions into ample pools go to the least loaded rank by tokens, exactly
    check_balance: bool = False
    # bookkeeping of the checks
    ranks: dict[int, tuple[int, int]] = field(default_factory=dict)       # seq -> (target, draft) while running
    placements: list[tuple[int, int, int]] = field(default_factory=list)  # (seq, target, draft) per admission
    preemptions: list[Preemption] = field(default_factory=list)
    _frees_t: list[set[int]] = field(default_factory=list)               # frees owed to each rank
    _frees_d: list[set[int]] = field(default_factory=list)
    # ranks whose call fails in the next step (the worker dies during its call)
    fail_drafts: set[int] = field(default_factory=set)
    fail_targets: set[int] = field(default_factory=set)
    # workers killed and not called since (their next call fails); when each answers again
    dead: set[tuple[str, int]] = field(default_factory=set)
    back_at: dict[tuple[str, int], int] = field(default_factory=dict)
    # workers dead more often than Ray restarts them: they will not come back
    gone_for_good: set[tuple[str, int]] = field(default_factory=set)
    tick: int = 0
    losses: dict[str, int] = field(default_factory=lambda: {"draft": 0, "target": 0})
    engine: Engine | None = None
    # A second proposer beside the drafts (draft+suffix): where it is wrong, as draft_wrong
    # for the drafts; None: the drafts alone.
    suffix_wrong: Callable[[int, int], bool] | None = None

    def __post_init__(self) -> None:
        assert len(self.targets) == len(self.sched.target_pools)
        self._frees_t = [set() for _ in self.sched.target_pools]
        self._frees_d = [set() for _ in range(self.sched.num_draft_ranks)]
        self.suffix = FakeSuffix(self) if self.suffix_wrong is not None else None
        proposer = DraftModelProposer([FakeCall(self, "draft", d) for d in range(len(self.drafts))])
        if self.suffix is not None:
            proposer = MergedProposer(proposer, self.suffix)
        self.engine = Engine(self.sched, [FakeCall(self, "target", r) for r in range(len(self.targets))], proposer)
        self._in_step = False
        self._truth: dict[int, list[int]] = {}
        self._proposed: dict[int, list[int]] = {}
        self._suffix_proposed: dict[int, list[int]] = {}
        self._prob_rows: list[int] = []
        schedule, update = self.sched.schedule, self.sched.update
        self.sched.schedule = lambda: self._schedule(schedule)
        self.sched.update = lambda outcome: self._update(update, outcome)

    @property
    def target(self) -> FakeWorker:          # the single-rank tests' worker
        assert len(self.targets) == 1
        return self.targets[0]

    @property
    def draft(self) -> FakeWorker:
        assert len(self.drafts) == 1
        return self.drafts[0]

    def _owe(self, seq_id: int, t: int, d: int) -> None:
        """A released sequence's frees are owed to its ranks -- except to a rank that is down:
        it restarts empty, and a plan for it would be a call to a dead worker."""
        if t not in self.sched.targets_down:
            self._frees_t[t].add(seq_id)
        if self._frees_d and d not in self.sched.drafts_down:
            self._frees_d[d].add(seq_id)

    def kill_draft(self, d: int) -> None:
        """Draft worker ``d`` dies. It restarts empty, so any trust in what it held shows up
        as a stale prefix; the engine hears of it at its next call."""
        worker = self.drafts[d]
        self.drafts[d] = FakeWorker(worker.name, worker.blocks.num_blocks, worker.blocks.block_size)
        self.dead.add(("draft", d))

    def kill_target(self, r: int) -> None:
        worker = self.targets[r]
        self.targets[r] = FakeWorker(worker.name, worker.blocks.num_blocks, worker.blocks.block_size)
        self.dead.add(("target", r))

    def truth(self, step: ScheduledStep) -> dict[int, list[int]]:
        return {s.seq_id: list(s.tokens) for s in step.seqs}

    # -- around the real scheduler ------------------------------------------------------
    def _schedule(self, schedule) -> ScheduledStep | None:
        sched = self.sched
        before_running = [(s, s.target_rank, s.draft_rank, s.num_preemptions) for s in sched.running]
        before_waiting = {s.seq_id for s in sched.waiting}
        step = schedule()
        sched.check_integrity()
        if step is None or not self._in_step:
            return step
        self._scheduled = step
        self.check_plan_shape(step, before_running, before_waiting)
        if self.on_plan is not None:
            self.on_plan(step)
        for d in self.fail_drafts:
            self.kill_draft(d)
        for r in self.fail_targets:
            self.kill_target(r)
        self._truth = self.truth(step)
        self._proposed, self._prob_rows, self._suffix_proposed = {}, [], {}
        self._running_on = {r: [s for s in sched.running if s.target_rank == r] for r in range(len(self.targets))}
        return step

    def _update(self, update, outcome: StepOutcome):
        if not self._in_step:
            return update(outcome)
        step = outcome.step
        out = update(outcome)
        sched = self.sched
        sched.check_integrity()
        for r in outcome.lost_targets:
            # requeued: its draft rank is owed a free, the dead target nothing
            self._frees_t[r].clear()
            for s in self._running_on[r]:
                del self.ranks[s.seq_id]
                if self._frees_d and s.draft_rank not in sched.drafts_down:
                    self._frees_d[s.draft_rank].add(s.seq_id)
        for d in outcome.lost_drafts:
            self._frees_d[d].clear()
        assert [s for s, _ in out] == [s for r, seqs in enumerate(step.target_seqs)
                                       if r not in outcome.lost_targets for s in seqs]
        for seq, appended in out:
            if seq.seq_id in self._proposed and self.drafts:
                self.drafts[seq.draft_rank].judged[seq.seq_id] = seq.num_tokens
            self.outputs.setdefault(seq.seq_id, []).extend(appended)
            assert self.outputs[seq.seq_id] == seq.output_tokens
            if seq.finished:
                assert seq.seq_id not in self.finished, "a request finished twice"
                self.finished[seq.seq_id] = seq
                del self.ranks[seq.seq_id]
                # its workers are told with their next plan
                self._owe(seq.seq_id, seq.target_rank, seq.draft_rank)
            else:
                assert self.ranks[seq.seq_id] == (seq.target_rank, seq.draft_rank)
        self.check_mirrors(step)
        self.counts.steps += 1
        if self.on_step is not None:
            self.on_step(step)
        if self.keep_steps:
            self.steps.append(step)
            self.verdicts.append(list(outcome.verdicts))
        return out

    def step(self) -> bool:
        """One step of the real engine; False when nothing was scheduled."""
        self._in_step, self._scheduled = True, None
        try:
            self.engine.step()
        finally:
            self._in_step = False
        return self._scheduled is not None

    def run_step(self, step: ScheduledStep) -> StepOutcome:
        """The engine's phases for a step scheduled outside ``step`` (no checks, no update)."""
        self._truth, self._proposed, self._prob_rows = self.truth(step), {}, []
        outcome = StepOutcome(step)
        outcome.verdicts = self.engine.verify(step, self.engine.propose(step, outcome), outcome)
        return outcome

    def check_plan_shape(self, step: ScheduledStep, before_running: list[tuple[Sequence, int, int, int]],
                         before_waiting: set[int]) -> None:
        sched = self.sched
        T, D = len(sched.target_pools), sched.num_draft_ranks
        width = max((s.proposal_len for s in step.seqs), default=0)
        assert len(step.target_plans) == len(step.target_seqs) == T
        assert len(step.draft_plans) == len(step.draft_seqs) == D
        ids = [s.seq_id for s in step.seqs]
        assert len(ids) == len(set(ids))
        # a running sequence is kept (same place, same ranks) or preempted (its KV dropped
        # everywhere, its preemption counted); a preempted one may only come back as a newcomer
        preempted = [(s, t, d) for s, t, d, np in before_running if s.num_preemptions > np]
        for s, _, _, np in before_running:
            assert s.num_preemptions in (np, np + 1)
            assert s.num_preemptions > np or s in step.seqs, f"seq {s.seq_id} left the batch unpreempted"
        kept_ids = {s.seq_id for s, _, _, np in before_running if s.num_preemptions == np}
        kept = [s for s in step.seqs if s.seq_id in kept_ids]
        admitted = [s for s in step.seqs if s.seq_id not in kept_ids]
        assert {s.seq_id for s in admitted} <= before_waiting | {s.seq_id for s, _, _ in preempted}
        assert step.seqs == kept + admitted                  # newcomers come last
        # running sequences keep their order; on each target rank the ones left out are that
        # rank's newest (preempted by an older sequence of the same rank, or by themselves)
        assert kept == [s for s, _, _, _ in before_running if s.seq_id in kept_ids]
        for r in range(T):
            on_rank = [s for s, t, _, _ in before_running if t == r]
            kept_r = [s for s in on_rank if s.seq_id in kept_ids]
            assert kept_r == on_rank[:len(kept_r)], f"target rank {r} preempted a sequence older than a kept one"
        for s, t, d in preempted:
            if s not in admitted:
                assert s.status is SequenceStatus.WAITING and s.target_computed == 0 and s.draft_computed == 0
                assert not any(p.has(s.seq_id) for p in sched.target_pools + sched.draft_pools)
            assert s.seq_id not in self.finished
            order = [x for x, _, _, _ in before_running]
            newer = [x.seq_id for x, xt, _, _ in before_running[order.index(s) + 1:]
                     if xt != t and x.seq_id in kept_ids]
            self.preemptions.append(Preemption(step.step_id, s.seq_id, t, newer))
            del self.ranks[s.seq_id]
            self._owe(s.seq_id, t, d)
        if preempted and kept:
            assert not admitted, "a step that had to preempt admits nobody"

        # ranks: sticky while running, in range, recorded at admission
        for s, t, d, _ in before_running:
            assert (s.target_rank, s.draft_rank) == (t, d) or s.seq_id not in kept_ids, \
                f"running seq {s.seq_id} moved"
        for s in kept:
            assert self.ranks[s.seq_id] == (s.target_rank, s.draft_rank), f"running seq {s.seq_id} moved"
        for s in admitted:
            assert s.seq_id not in self.ranks
            assert 0 <= s.target_rank < T and 0 <= s.draft_rank < max(D, 1)
            self.ranks[s.seq_id] = (s.target_rank, s.draft_rank)
            self.placements.append((s.seq_id, s.target_rank, s.draft_rank))
        assert set(self.ranks) == {s.seq_id for s in sched.running} == set(ids)
        if self.check_balance:
            t_load, d_load = [0] * T, [0] * max(D, 1)
            for s in kept:
                t_load[s.target_rank] += s.num_tokens
                d_load[s.draft_rank] += s.num_tokens
            for s in admitted:
                assert t_load[s.target_rank] == min(t_load), (s.seq_id, t_load)
                assert d_load[s.draft_rank] == min(d_load), (s.seq_id, d_load)
                t_load[s.target_rank] += s.num_tokens
                d_load[s.draft_rank] += s.num_tokens

        for s in step.seqs:
            n = s.num_tokens
            assert s.seq_id not in self.finished and s.status is SequenceStatus.RUNNING
            assert s.step_len == n
            if not D:
                assert s.proposal_len == 0
        # target plans: exactly the rank's sequences, in step order, and exactly its frees
        for r in range(T):
            seqs = step.target_seqs[r]
            assert seqs == [s for s in step.seqs if s.target_rank == r]
            plan = step.target_plans[r]
            frees = self._frees_t[r]
            if not seqs and not frees:
                assert plan is None, f"target rank {r} got a plan with nothing in it"
                continue
            # One width for the whole step: its longest proposal.
            assert plan is not None and plan.step_id == step.step_id
            assert plan.width == width <= sched.num_speculative_tokens
            assert sorted(plan.free_seq_ids) == sorted(frees), f"target rank {r} frees"
            frees.clear()
            assert plan.seq_ids == [s.seq_id for s in seqs]
            for i, s in enumerate(seqs):
                n = s.num_tokens
                assert plan.num_computed[i] == s.target_computed
                assert plan.num_new[i] == n - s.target_computed >= 1
                assert plan.num_slots[i] == n + s.proposal_len
                assert plan.proposal_lens[i] == s.proposal_len
        # draft plans: the rank's sequences that speculate this step, and its frees
        for d in range(D):
            seqs = step.draft_seqs[d]
            assert seqs == [s for s in step.seqs if s.proposal_len > 0 and s.draft_rank == d]
            plan = step.draft_plans[d]
            frees = self._frees_d[d]
            if not seqs and not frees:
                assert plan is None, f"draft rank {d} got a plan with nothing in it"
                continue
            assert plan is not None and plan.step_id == step.step_id and plan.width == width
            assert sorted(plan.free_seq_ids) == sorted(frees), f"draft rank {d} frees"
            frees.clear()
            assert plan.seq_ids == [s.seq_id for s in seqs]
            for i, s in enumerate(seqs):
                assert plan.num_computed[i] == s.draft_computed
                assert plan.num_slots[i] == s.num_tokens + s.proposal_len - 1
                assert plan.proposal_lens[i] == s.proposal_len

    def check_mirrors(self, step: ScheduledStep) -> None:
        """Once every worker has applied the step's plan and the driver its outcome, each
        worker has seen exactly the operations the driver's mirror of its pool has: the same
        blocks per sequence and the same free count, where the frees the driver still owes
        it (sequences that finished or were requeued in this step) count as applied. A
        worker holds only sequences that run on its rank."""
        sched = self.sched
        # A worker killed since its last call is empty and the driver does not know yet:
        # it hears so at that worker's next call.
        pairs = [(mirror, worker, {s.seq_id for s in sched.running if s.target_rank == r}, self._frees_t[r])
                 for r, (mirror, worker) in enumerate(zip(sched.target_pools, self.targets))
                 if ("target", r) not in self.dead]
        if sched.num_draft_ranks:
            on_draft = [{s.seq_id for s in sched.running if s.draft_rank == d} for d in range(sched.num_draft_ranks)]
            for d, mirror in enumerate(sched.draft_pools):
                if ("draft", d) not in self.dead:
                    pairs.append((mirror, self.drafts[d], on_draft[d], self._frees_d[d]))
            for d, worker in enumerate(self.drafts[:sched.num_draft_ranks]):
                assert set(worker.cache) <= on_draft[d] | self._frees_d[d], \
                    f"{worker.name} holds another rank's sequence"
        for mirror, worker, owners, owed in pairs:
            assert set(mirror._tables) <= owners, "a sequence holds blocks on a rank it does not run on"
            assert set(worker.cache) <= owners | owed, f"{worker.name} holds a sequence it was told to free"
            held_by_owed = sum(len(worker.blocks.block_table(sid)) for sid in owed)
            assert mirror.num_free_blocks == worker.blocks.num_free_blocks + held_by_owed
            for sid in (set(mirror._tables) | set(worker.blocks._tables)) - owed:
                assert len(mirror.block_table(sid)) == len(worker.blocks.block_table(sid))

    def propose(self, d: int, plan: StepPlan) -> tuple[Proposals, list[int] | None]:
        """Draft rank ``d``'s call: the true next tokens, wrong where ``draft_wrong`` says.
        The probabilities "handle" is the list of its sequence ids, so the target side can
        check the merge's draft_rows."""
        plan = roundtrip(plan)
        width = plan.width
        worker = self.drafts[d]
        histories = worker.apply(plan, self._truth)
        rows = []
        for i, sid in enumerate(plan.seq_ids):
            n = plan.proposal_lens[i]
            if self.shorten is not None:
                n = self.shorten(sid, len(histories[i]), n)
                assert 0 <= n <= plan.proposal_lens[i]
            hist = histories[i]
            props = []
            for _ in range(n):
                t = true_next(hist + props)
                if self.draft_wrong(sid, len(hist) + len(props)):
                    t = (t + 1) % V
                props.append(t)
            # the draft ran its first n - 1 proposals through the model: they are in its KV
            worker.cache[sid].extend(props[:len(props) - 1])
            assert len(worker.cache[sid]) <= worker.num_slots(sid)
            rows.append((sid, props))
            self._proposed[sid] = props
        if plan.num_seqs:
            self.counts.draft_calls += 1
        toks = [t for _, p in rows for t in p + [-1] * (width - len(p))]
        has_probs = self.probs and d % 2 == 0
        shard = Proposals(step_id=plan.step_id, width=width, has_probs=has_probs, seq_ids=[s for s, _ in rows],
                          proposal_lens=[len(p) for _, p in rows], token_ids=toks)
        return decode(encode(shard), expected=Proposals), (list(shard.seq_ids) if has_probs else None)

    def verify(self, r: int, plan: StepPlan, probs: list) -> StepResult:
        """Target rank ``r``'s call: checks the merged proposals against what the drafts
        proposed, then accepts while they match the true next token."""
        plan = roundtrip(plan)
        width = plan.width
        prob_rows = [sid for rows in probs for sid in rows]
        if plan.proposal_token_ids:
            for i, sid in enumerate(plan.seq_ids):
                props = self._proposed.get(sid, [])
                got = plan.proposal_token_ids[i * width:i * width + plan.proposal_lens[i]]
                if sid in self._suffix_proposed and got == self._suffix_proposed[sid] and got != props:
                    assert plan.draft_rows[i] == -1          # the suffix's proposal: one-hot
                    continue
                assert plan.proposal_lens[i] == len(props)
                assert plan.proposal_token_ids[i * width:(i + 1) * width] == props + [-1] * (width - len(props))
                if plan.draft_rows[i] != -1:
                    assert props and prob_rows[plan.draft_rows[i]] == sid
                else:
                    assert not props or sid not in prob_rows
        worker = self.targets[r]
        histories = worker.apply(plan, self._truth)
        num_proposed, num_emitted, token_ids = [], [], []
        logprobs = StepResult(num_top=list(plan.logprobs))
        for i, sid in enumerate(plan.seq_ids):
            n = plan.proposal_lens[i] if plan.proposal_token_ids else 0
            props = plan.proposal_token_ids[i * width:i * width + n]
            assert -1 not in props
            worker.cache[sid].extend(props)
            assert len(worker.cache[sid]) <= worker.num_slots(sid)
            hist = histories[i]
            out: list[int] = []
            for p in props:
                t = true_next(hist + out)
                out.append(t)
                if p != t:
                    break
            else:
                out.append(true_next(hist + out))   # every proposal accepted: bonus token
            num_proposed.append(n)
            num_emitted.append(len(out))
            token_ids.extend(out)
            if plan.logprobs and plan.logprobs[i] >= 0:
                for j in range(len(out)):
                    lp = true_logprob(hist + out[:j], plan.logprobs[i])
                    logprobs.logprobs.append(lp.logprob)
                    logprobs.top_ids += [t for t, _ in lp.top]
                    logprobs.top_logprobs += [x for _, x in lp.top]
            self.counts.drafted += n
            self.counts.accepted += len(out) - 1
            self.counts.emitted += len(out)
        self.counts.seq_steps += plan.num_seqs
        result = StepResult(step_id=plan.step_id, seq_ids=list(plan.seq_ids), proposed=num_proposed,
                            num_emitted=num_emitted, token_ids=token_ids, num_top=logprobs.num_top,
                            logprobs=logprobs.logprobs, top_ids=logprobs.top_ids,
                            top_logprobs=logprobs.top_logprobs)
        return decode(encode(result), expected=StepResult)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            assert self.step(), "scheduler has work but scheduled nothing"
        raise AssertionError("did not finish")


class FakeSuffix:
    """A host-side proposer beside the drafts, as suffix decoding is: the true next tokens,
    wrong where ``suffix_wrong`` says, with a score that wins for odd sequence ids (so over
    a run both proposers' proposals get verified)."""

    def __init__(self, harness: "Harness") -> None:
        self.h = harness
        self.finished_ids: list[int] = []
        self.observed: list[tuple[int, tuple[int, ...]]] = []     # the emitted tokens it heard of

    def propose(self, step_id: int, seqs: list[Sequence]) -> Proposals:
        width = max((s.proposal_len for s in seqs), default=0)
        lens, toks, scores = [], [], []
        for s in seqs:
            hist = list(s.tokens)
            props: list[int] = []
            for _ in range(s.proposal_len if s.seq_id % 3 else max(s.proposal_len - 1, 0)):
                t = true_next(hist + props)
                props.append((t + 1) % V if self.h.suffix_wrong(s.seq_id, len(hist) + len(props)) else t)
            self.h._suffix_proposed[s.seq_id] = props
            lens.append(len(props))
            toks += props + [-1] * (width - len(props))
            scores.append(float(len(props)) * (0.9 if s.seq_id % 2 else 0.1))
        return Proposals(step_id=step_id, width=width, seq_ids=[s.seq_id for s in seqs], proposal_lens=lens,
                         token_ids=toks, scores=scores)

    def finished(self, seq: Sequence) -> None:
        self.finished_ids.append(seq.seq_id)

    def forget(self, seq_ids) -> None:
        pass

    def observe(self, outcome: StepOutcome) -> None:
        self.observed += [(v.seq_id, v.tokens) for v in outcome.verdicts]

    def ceiling(self) -> float:
        return 1.0          # its scores never pass 0.9 a token: it always proposes

    def fade(self) -> None:
        raise AssertionError("a ceiling of 1 is never below the draft's expectation")


def _per_rank(blocks, ranks: int) -> list:
    if isinstance(blocks, (list, tuple)):
        assert len(blocks) == ranks or ranks == 1
        return list(blocks)
    return [blocks] * ranks


def build(k: int = 4, max_model_len: int = 256, draft_max_model_len: int | None = None, block_size: int = 4,
          target_blocks: int | list[int] = 1000, draft_blocks: int | list[int] | None = 1000,
          target_ranks: int = 1, draft_ranks: int = 1, use_proposer: bool = True, max_num_seqs: int = 256,
          max_num_batched_tokens: int = 8192, disable_by_batch_size: int | None = None,
          policy: SpeculationPolicy | None = None, overlap: bool = False,
          suffix_wrong: Callable[[int, int], bool] | None = None) -> Harness:
    """A scheduler with ample pools by default; ``draft_blocks=None``: proposers without a KV
    pool (n-gram style). Pool sizes are per rank (an int: the same for every rank). The fake
    workers' pools are the same size as the mirrors. One rank is passed as a bare pool (the
    single-pool form of the API), several as a list. ``policy``: static k by default."""
    cache = CacheConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens)
    spec = SpeculationConfig(proposer="draft" if use_proposer and k else "none", num_speculative_tokens=k,
                             disable_by_batch_size=disable_by_batch_size, overlap=overlap)
    t_sizes = _per_rank(target_blocks, target_ranks)
    tpools = [BlockManager(n, block_size) for n in t_sizes]
    if draft_blocks is None:
        d_sizes = [2000] * draft_ranks
        dpools = None
    else:
        d_sizes = _per_rank(draft_blocks, draft_ranks)
        dpools = [BlockManager(n, block_size) for n in d_sizes]
        dpools = dpools[0] if len(dpools) == 1 else dpools
    policy = policy if policy is not None else StaticPolicy(spec)
    sched = Scheduler(cache, spec, max_model_len, tpools[0] if len(tpools) == 1 else tpools, dpools,
                      draft_max_model_len=draft_max_model_len, num_proposers=len(d_sizes), policy=policy)
    targets = [FakeWorker(f"target{r}", n, block_size) for r, n in enumerate(t_sizes)]
    drafts = [FakeWorker(f"draft{d}", n, block_size) for d, n in enumerate(d_sizes)]
    return Harness(sched, targets, drafts, suffix_wrong=suffix_wrong)


def add_requests(eng: Harness, specs, stop_ids=()) -> dict[int, tuple[list[int], str]]:
    """specs: (seq_id, prompt_len, max_tokens). Returns the reference output per seq."""
    ref = {}
    for sid, plen, mt in specs:
        prompt = prompt_for(sid, plen)
        eng.sched.add(make_seq(sid, prompt, mt, stop_ids))
        ref[sid] = reference(prompt, mt, stop_ids, eng.sched.max_model_len)
    return ref


def assert_matches_reference(eng: Harness, ref) -> None:
    assert set(eng.finished) == set(ref)
    for sid, (tokens, reason) in ref.items():
        seq = eng.finished[sid]
        assert seq.output_tokens == tokens, f"seq {sid}"
        assert seq.finish_reason == reason, f"seq {sid}"
        assert seq.status is SequenceStatus.FINISHED
    s = eng.sched
    assert not s.running and not s.waiting
    assert s.stats.num_requests_finished == len(ref)
    for pool in s.target_pools + s.draft_pools:
        assert pool.num_free_blocks == pool.num_blocks
    # the last frees are still owed: they travel with the next plan
    pending_t = [sorted(f) for f in s._target_frees]
    assert pending_t == [sorted(f) for f in eng._frees_t]
    assert [sorted(f) for f in s._draft_frees] == [sorted(f) for f in eng._frees_d]


def expected_limit(sched: Scheduler, k: int, n: int, remaining: int) -> int:
    """The proposal-length rule of DESIGN.md, written out independently."""
    if k == 0:
        return 0
    limit = max(0, min(k, remaining - 1, sched.max_model_len - n - 1))
    if sched.draft_max_model_len is not None and n + limit > sched.draft_max_model_len:
        return 0
    return limit


MIXED = [(i, 1 + (7 * i) % 40, 1 + (11 * i) % 45) for i in range(1, 25)]
