"""The target model: scores every sequence's proposal_len + 1 positions in one packed
forward pass (no batch expansion) and runs the rejection sampler."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from specray.scheduler.config import CacheConfig
from specray.scheduler.messages import StepPlan, StepResult
from specray.workers import memory_budget
from specray.workers.config import ModelConfig
from specray.workers.eagle3_drafter import Eagle3Drafter
from specray.workers.errors import PlanError
from specray.workers.grammar_step import GrammarSide
from specray.workers.in_target_head import InTargetHead, propose_in_target
from specray.workers.model_runner import ModelWorker
from specray.workers.rank_group import OP_VERIFY, StepShare
from specray.workers.rejection_sampler import greedy_accept, random_verify
from specray.workers.sampling import STREAM_ACCEPT, STREAM_TARGET, keyed_uniform, logits_to_probs, token_logprobs
from specray.workers.tensor_parallel import RankGroup


class TargetWorker(ModelWorker):
    kind = "target"
    # A proposer in this process, reading the target's hidden states (an EAGLE head,
    # ``specray.workers.in_target_head``): it proposes inside ``verify``.
    head: InTargetHead | None = None

    def __init__(self, model: ModelConfig, cache: CacheConfig, allocate: bool = True,
                 group: RankGroup | None = None, head: str | None = None) -> None:
        """``allocate=False``: the KV cache is sized later, with the process's other workers
        (``ModelRunner``). ``group``: this worker is one rank of a tensor-parallel target;
        rank 0 is called as any worker and shares each step with the others, which run
        ``rank_group.follow`` (every rank of the group builds at once). ``head``: an
        EAGLE-3 head's checkpoint; it proposes inside ``verify`` (``in_target_head``) from
        the hidden states each verify captures (tensor parallel runs without one)."""
        super().__init__(model.target, model, cache, model.max_model_len, allocate=allocate and not head,
                         group=group)
        self.grammar = GrammarSide(model.target, self.runner.vocab_size)
        self.share = StepShare(group) if group is not None and group.size > 1 and group.rank == 0 else None
        self.head = Eagle3Drafter(head, self.runner) if head else None
        if self.head is not None:
            # The head's cache has a slot for every one of the target's: sized together.
            r, h = self.runner, self.head.head
            r.need = dataclasses.replace(r.need, per_block=r.need.per_block + h.block_bytes(cache.block_size),
                                         held=r.need.held + h.nbytes)
            if allocate:
                r.allocate(cache.num_kv_blocks or memory_budget.plan_blocks([r.need], cache.gpu_memory_utilization)[0])

    @torch.inference_mode()
    def verify(self, plan: StepPlan, *draft_probs: torch.Tensor | None) -> StepResult:
        """``draft_probs``: the proposing shards' ``[rows, width, V]`` tensors in shard order
        (``plan.draft_rows`` indexes their concatenation)."""
        t0 = time.perf_counter()
        r = self.runner
        r.check_plan(plan)
        plan, draft_probs = propose_in_target(self.head, plan, draft_probs)
        n, width = plan.num_seqs, plan.width
        proposal_lens = verified_lens(plan)
        self._check_proposals(plan, proposal_lens, draft_probs)
        if self.share is not None:
            self.share.send(OP_VERIFY, plan)     # the group's other ranks run this forward with this one
        masks = self.grammar.start_verify_masks(plan, proposal_lens)       # on the host, beside the forward
        aux = self.head.capture() if self.head is not None else None     # what the head reads
        scored = self.score(plan, aux)
        if scored is None:
            return self._told(plan, StepResult(step_id=plan.step_id, compute_s=time.perf_counter() - t0))
        batch, logits = scored
        # Structured output: forbidden tokens masked before anything reads the logits.
        mask_s = self.grammar.finish_verify_masks(masks, logits)
        vocab = logits.shape[-1]
        w1 = width + 1
        # The [n, width+1] grid repeats a sequence's last row past its proposals; only the
        # distinct rows go through the head, so a sequence that proposed fewer tokens than
        # the step's width does not pay the head once per missing proposal.
        grid_rows = None if len(batch.logit_rows) == n * w1 else r.to_device(batch.cells)
        # Greedy rows are decided on the host from the argmax grid ([n, width+1] ints):
        # fewer tensor ops than a masked device computation, and the same one host sync.
        argmax = logits.argmax(dim=-1)
        if grid_rows is not None:
            argmax = argmax.index_select(0, grid_rows)
        sampled = [i for i, t in enumerate(plan.temperature) if t > 0]
        asked = [i for i, x in enumerate(plan.logprobs) if x >= 0]
        if sampled or asked:
            scores = (logits if grid_rows is None else logits.index_select(0, grid_rows)).view(n, w1, vocab)
        parts, out = [argmax], None
        if sampled:
            out, counts = self._sample(plan, proposal_lens, sampled, scores, draft_probs)
            parts += [counts, out.view(-1)]
        if asked:
            chosen, top_lp, top_ids, num_top = self._logprobs(plan, asked, sampled, scores, argmax, out)
            parts.append(top_ids.view(-1))
        flat = torch.cat(parts).tolist() if len(parts) > 1 else argmax.tolist()    # still one host sync
        cells, ns = n * w1, len(sampled)
        grid, counts, out = flat[:cells], flat[cells:cells + ns], flat[cells + ns:cells + ns + ns * w1]
        emitted = greedy_accept(grid, plan.proposal_token_ids, proposal_lens, width)
        for j, i in enumerate(sampled):
            emitted[i] = out[j * w1:j * w1 + counts[j]]
        result = StepResult(step_id=plan.step_id, seq_ids=list(plan.seq_ids), proposed=list(proposal_lens),
                            num_emitted=[len(e) for e in emitted], token_ids=[t for e in emitted for t in e],
                            mask_s=mask_s)
        if asked:
            # Computed before the sync above: this copy waits for nothing.
            floats = torch.cat([chosen.view(-1), top_lp.view(-1)]).tolist()
            _fill_logprobs(result, plan, asked, emitted, floats, flat[cells + ns + ns * w1:], w1, num_top)
        self._told(plan, result)
        result.compute_s = time.perf_counter() - t0
        return result

    def graph_stats(self) -> dict:
        stats = super().graph_stats()
        if self.head is not None:
            # The head's own time (proposing, and rebuilding from the target's states),
            # inside this worker's verify calls: what the bench sets against the draft's.
            stats["head_compute_s"] = getattr(self.head, "compute_s", 0.0)
        return stats

    def _told(self, plan: StepPlan, result: StepResult) -> StepResult:
        """The proposer in this process (``head``), if any, hears the step's verdicts."""
        if self.head is not None:
            self.head.verified(plan, result)
        return result

    def score(self, plan: StepPlan, aux=None) -> tuple["PackedVerify", torch.Tensor] | None:
        """The model's part of ``verify`` (every rank of a tensor-parallel group runs it):
        the KV pool resized to the plan, then one packed forward; its layout and the logits
        [sum(proposal_lens) + n, V] of the scored rows (None for an empty plan). ``aux``: an
        ``AuxCapture`` the forward fills for a head."""
        r = self.runner
        proposal_lens = verified_lens(plan)
        r.kv.apply(plan, proposal_lens)          # proposals are fed: their K/V is written too
        if plan.num_seqs == 0:
            return None
        batch = packed_verify_batch(plan.token_ids, plan.num_new, plan.proposal_token_ids, proposal_lens,
                                    plan.width)
        logits = r.forward(plan.seq_ids, plan.num_computed, batch.fed, r.to_device(batch.tokens),
                           r.to_device(batch.logit_rows), tail=[p + 1 for p in proposal_lens], aux=aux)
        return batch, logits

    def _logprobs(self, plan: StepPlan, asked: list[int], sampled: list[int], scores, argmax, out):
        """Raw logprobs for the sequences ``asked`` (batch indices) at each of their
        width + 1 scored positions, of the token that position emits if it emits one (the
        argmax for greedy rows, ``out`` [len(sampled), width+1] for sampled ones):
        chosen [a, width+1], top logprobs and ids [a, width+1, N], N the most any of them
        asked for (within the vocabulary)."""
        r = self.runner
        n, w1, vocab = scores.shape
        tokens = argmax.view(n, w1)
        if sampled:
            tokens = tokens.clone()
            tokens[r.to_device(sampled)] = out.clamp(min=0)     # -1 past the emitted: never read
        rows = r.to_device(asked)
        num_top = min(max(plan.logprobs[i] for i in asked), vocab)
        return (*token_logprobs(scores[rows], tokens[rows], num_top), num_top)

    def _sample(self, plan: StepPlan, proposal_lens: list[int], rows: list[int], scores, draft_probs):
        """Rejection sampling for the sequences ``rows`` (batch indices) that sample:
        their emitted tokens [s, width+1] (-1 past the emitted) and counts [s], s = len(rows)."""
        r = self.runner
        dev = r.device
        width = plan.width
        w1, vocab = scores.shape[1:]
        s = len(rows)
        rep = lambda xs: [xs[i] for i in rows for _ in range(w1)]  # noqa: E731
        di = r.to_device(rows)
        probs = logits_to_probs(scores[di].view(s * w1, vocab), r.to_device(rep(plan.temperature), torch.float32),
                                rep(plan.top_k), rep(plan.top_p)).view(s, w1, vocab)
        props = plan.proposal_token_ids
        draft_ids = r.to_device([props[i * width + j] for i in rows for j in range(width)] if props
                                else [-1] * (s * width))
        rows_proposal_lens = r.to_device([proposal_lens[i] for i in rows])
        q, has_q = self._draft_probs(draft_probs, [plan.draft_rows[i] if plan.draft_rows else -1 for i in rows], dev)
        # The first scored position is the sequence's length before the step (its step_len).
        step_lens = r.to_device([plan.num_computed[i] + plan.num_new[i] for i in rows])
        positions = step_lens.unsqueeze(-1) + torch.arange(w1, device=dev)                 # [s, width+1]
        seeds = r.to_device([plan.seeds[i] for i in rows]).unsqueeze(-1)
        accept_u = keyed_uniform(seeds, positions[:, :-1], STREAM_ACCEPT)
        sample_u = keyed_uniform(seeds, positions, STREAM_TARGET)
        return random_verify(probs, draft_ids.view(s, width), q, has_q, rows_proposal_lens, accept_u, sample_u)

    def _check_proposals(self, plan: StepPlan, proposal_lens: list[int], shards) -> None:
        """Proposals are fed to the model and index one-hot rows, draft rows index the
        shards: all must be in range (O(n * width) in C, no per-token Python)."""
        vocab, width = self.runner.vocab_size, plan.width
        props = plan.proposal_token_ids
        if props and (min(props) < -1 or max(props) >= vocab):
            j = next(j for j, t in enumerate(props) if not -1 <= t < vocab)
            raise PlanError(f"StepPlan.proposal_token_ids[{j}] (sequence {plan.seq_ids[j // width]}): "
                            f"{props[j]} is outside the vocabulary [0, {vocab})")
        for i, proposal_len in enumerate(proposal_lens):
            if proposal_len and min(props[i * width:i * width + proposal_len]) < 0:
                raise PlanError(f"StepPlan.proposal_token_ids: sequence {plan.seq_ids[i]} pads inside "
                                f"its {proposal_len} proposals")
        rows = 0
        for j, s in enumerate(shards):
            if s is None:
                continue
            if not (isinstance(s, torch.Tensor) and s.is_floating_point() and s.dim() == 3
                    and s.shape[1:] == (width, vocab)):
                what = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                raise PlanError(f"draft_probs[{j}] must be a float tensor [rows, {width}, {vocab}], got {what}")
            rows += s.shape[0]
        if plan.draft_rows and max(plan.draft_rows) >= rows:
            i = max(range(plan.num_seqs), key=plan.draft_rows.__getitem__)
            raise PlanError(f"StepPlan.draft_rows[{i}]: sequence {plan.seq_ids[i]} points at row "
                            f"{plan.draft_rows[i]}, the draft shards hold {rows}")

    @staticmethod
    def _draft_probs(shards, rows: list[int], dev):
        has = torch.tensor([r >= 0 for r in rows], device=dev)
        present = [s for s in shards if s is not None]
        if not present or not any(r >= 0 for r in rows):
            return None, has
        allp = torch.cat([s.to(dev) for s in present]) if len(present) > 1 else present[0].to(dev)
        return allp[torch.tensor([max(r, 0) for r in rows], device=dev)], has


def verified_lens(plan: StepPlan) -> list[int]:
    """What each sequence verifies: its proposal_len, 0 where the plan carries no proposals."""
    return plan.proposal_lens if plan.proposal_token_ids else [0] * plan.num_seqs


def _fill_logprobs(result: StepResult, plan: StepPlan, asked: list[int], emitted: list[list[int]],
                   floats: list[float], top_ids: list[int], w1: int, num_top: int) -> None:
    """Each asked sequence's emitted tokens' logprobs and its own number of alternatives
    into ``result``, from the host copies of ``TargetWorker._logprobs``' grids (``floats``:
    chosen, then the top logprobs)."""
    result.num_top = [-1] * plan.num_seqs
    top_lp = floats[len(asked) * w1:]
    for a, i in enumerate(asked):
        e, keep = len(emitted[i]), min(plan.logprobs[i], num_top)
        result.num_top[i] = keep
        result.logprobs += floats[a * w1:a * w1 + e]
        for j in range(a * w1, a * w1 + e):
            result.top_ids += top_ids[j * num_top:j * num_top + keep]
            result.top_logprobs += top_lp[j * num_top:j * num_top + keep]


@dataclass
class PackedVerify:
    tokens: list[int]         # [T]: per sequence its new tokens, then its proposals
    fed: list[int]            # [n]: tokens each sequence feeds
    logit_rows: list[int]     # [sum(proposal_lens) + n]: the packed rows whose logits are computed
    cells: list[int]          # [n * (width+1)]: index into logit_rows scoring each position

    @property
    def score_rows(self) -> list[int]:
        """[n * (width+1)]: the packed row scoring each position (repeats past proposal_len)."""
        return [self.logit_rows[c] for c in self.cells]


def packed_verify_batch(token_ids: list[int], num_new: list[int], proposal_token_ids: list[int],
                        proposal_lens: list[int], width: int) -> PackedVerify:
    """The verify pass's input layout, as host lists (list slicing and ``range`` run at
    C speed; a handful of tiny tensor ops cost more at these sizes). Sequence i's
    positions 0..proposal_len are scored at its last new token and its proposals: those
    proposal_len + 1 rows are computed once (``logit_rows``), and ``cells`` lays them out
    as a dense ``[n, width+1]`` grid whose cells past its proposal_len repeat the last one
    (the sampler never reads them)."""
    tokens: list[int] = []
    fed: list[int] = []
    logit_rows: list[int] = []
    cells: list[int] = []
    start = row = 0
    for i, (new, proposal_len) in enumerate(zip(num_new, proposal_lens)):
        tokens += token_ids[start:start + new]
        start += new
        if proposal_len:
            tokens += proposal_token_ids[i * width:i * width + proposal_len]
        last = row + new - 1
        first_cell = len(logit_rows)
        logit_rows += range(last, last + proposal_len + 1)
        cells += range(first_cell, first_cell + proposal_len + 1)
        cells += [first_cell + proposal_len] * (width - proposal_len)
        row += new + proposal_len
        fed.append(new + proposal_len)
    return PackedVerify(tokens, fed, logit_rows, cells)
