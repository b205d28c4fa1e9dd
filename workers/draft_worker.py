"""The draft model: ``width`` autoregressive passes per call, inputs kept on the device.

All passes run inside one ``propose`` call, so a step costs one call and one host sync
however many passes it makes: each pass's sampled tokens feed the next pass straight from
the device tensor, the host only builds position and slot metadata (which it knows in
advance), and proposals come back to the host once, at the end. Sequence i makes exactly ``proposal_lens[i]`` proposals.

Vocabulary: the draft may have fewer or more embedding rows than the target (checkpoints
of one tokenizer padded differently; ``vocabulary`` checks the ids they share agree). It
proposes only ids the target scores: its logits are cut to the target's ``vocab_size``,
so proposals and probabilities come from the distribution restricted to those ids, and
its probabilities are given over the target's whole vocabulary, zero past its own. A
token of the sequence that the draft has no row for (the target emitted a padding id) is
fed to the draft as its token 0: only the quality of its proposals depends on that input.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from specray.scheduler.config import CacheConfig
from specray.scheduler.messages import Predraft, Proposals, StepPlan
from specray.scheduler.predraft import window
from specray.workers import model_loader
from specray.workers.config import ModelConfig
from specray.workers.grammar_step import GrammarSide
from specray.workers.model_runner import ModelWorker
from specray.workers.sampling import STREAM_DRAFT, keyed_uniform, logits_to_probs, sample_from_probs


class DraftWorker(ModelWorker):
    kind = "draft"

    def __init__(self, model: ModelConfig, cache: CacheConfig, allocate: bool = True) -> None:
        """Runs ``model.draft``; ``model.target``'s window and vocabulary bound it
        (``allocate`` as for ``TargetWorker``)."""
        if not model.draft:
            raise ValueError("a draft worker needs ModelConfig.draft")
        super().__init__(model.draft, model, cache, model.draft_max_model_len, allocate=allocate)
        own = self.runner.vocab_size
        # The target whose window bounds this draft's also bounds the ids it may propose.
        self.target_vocab = model_loader.load_config(model.target).vocab_size
        self.scored = min(own, self.target_vocab)      # ids the draft can propose
        # Overlap: the last window proposed (its plan and proposals), which ``predraft``
        # drafts past, and the last pre-draft, which ``adopt`` takes windows from.
        self._last: tuple[StepPlan, Proposals] | None = None
        self._pre: Predraft | None = None
        self.grammar = GrammarSide(model.target, self.target_vocab)
        self._probs: torch.Tensor | None = None     # the last call's draft probabilities

    def _own_ids(self, plan: StepPlan) -> StepPlan:
        """The plan with tokens the draft has no row for (ids in [own, target)) fed as 0;
        ids past the target's vocabulary stay, for ``check_plan`` to refuse."""
        own, ids = self.runner.vocab_size, plan.token_ids
        if self.target_vocab <= own or not ids or max(ids) < own:
            return plan
        return replace(plan, token_ids=[0 if own <= t < self.target_vocab else t for t in ids])

    def propose(self, plan: StepPlan) -> tuple[Proposals, torch.Tensor | None]:
        """Returns proposals ``[n, width]`` (-1 past each ``proposal_lens[i]``) and, when any
        sequence samples, the draft probabilities ``[n, width, V_target]`` its proposals
        were drawn from."""
        self._last = self._pre = None
        out = self._propose(plan)
        self._last = (plan, out[0])
        return out

    @torch.inference_mode()
    def predraft(self, step_id: int) -> tuple[Predraft, torch.Tensor | None]:
        """Drafts, while the target verifies window ``step_id``, the next window of each of
        its sequences on the optimistic outcome: every proposal accepted and the target's
        next token the draft's own top choice. A sequence is left out where it made fewer
        proposals than planned or its plan did not reserve the pre-draft's slots
        (``num_slots >= L + 2 proposal_len``). Proposals are drawn exactly as
        ``propose`` draws them on that prefix (the uniforms are keyed by position), so a
        branch that holds gives the window ``propose`` would give."""
        t0 = time.perf_counter()
        last, self._last, self._pre = self._last, None, None
        if last is None or last[0].step_id != step_id:
            return Predraft(step_id=step_id), None
        plan, props = last
        # Constrained sequences are drafted when their plan comes: a pre-draft would need
        # their matchers past a guessed token.
        rows = [i for i in range(plan.num_seqs) if props.proposal_lens[i] == plan.proposal_lens[i] >= 1
                and plan.num_slots[i] >= plan.num_computed[i] + plan.num_new[i] + 2 * plan.proposal_lens[i]
                and not (plan.grammar_lens and plan.grammar_lens[i])]
        if not rows:
            return Predraft(step_id=step_id), None
        r = self.runner
        proposal_lens = [plan.proposal_lens[i] for i in rows]
        # Each branch holds where the draft has cached all of the window but its last
        # proposal, which the pre-draft's first pass feeds.
        num_computed = [plan.num_computed[i] + plan.num_new[i] + p - 1 for i, p in zip(rows, proposal_lens)]
        tail = [props.token_ids[i * props.width + p - 1] for i, p in zip(rows, proposal_lens)]
        sids = [plan.seq_ids[i] for i in rows]
        # The last proposal, never run through the draft, gives the guess of the bonus token.
        guess = r.forward(sids, num_computed, [1] * len(rows), r.to_device(tail),
                          torch.arange(len(rows), device=r.device))[:, :self.scored].argmax(dim=-1).tolist()
        for sid, c in zip(sids, num_computed):
            r.kv.num_written[sid] = max(r.kv.num_written.get(sid, 0), c + 1)    # the last proposal's K/V
        ahead = StepPlan(step_id=step_id, width=max(proposal_lens), seq_ids=sids,
                         num_computed=[c + 1 for c in num_computed],
                         num_new=[1] * len(rows), token_ids=guess, num_slots=[plan.num_slots[i] for i in rows],
                         proposal_lens=proposal_lens, temperature=[plan.temperature[i] for i in rows],
                         top_k=[plan.top_k[i] for i in rows], top_p=[plan.top_p[i] for i in rows],
                         seeds=[plan.seeds[i] for i in rows])
        got, probs = self._propose(ahead)
        pre = Predraft(step_id=step_id, width=got.width, has_probs=got.has_probs, compute_s=time.perf_counter() - t0,
                       seq_ids=sids, num_computed=num_computed, fed_lens=[2] * len(rows),
                       fed_token_ids=[t for pair in zip(tail, guess) for t in pair],
                       proposal_lens=list(got.proposal_lens), token_ids=list(got.token_ids))
        self._pre = pre
        return pre, probs

    def adopt(self, plan: StepPlan, chosen: list[int]) -> tuple[Predraft, torch.Tensor | None]:
        """Takes ``plan``'s window from the last pre-draft (``chosen``: each sequence's
        branch, which holds) instead of drafting it: the cache already holds what
        ``propose(plan)`` would write there. Then pre-drafts past it, as after ``propose``."""
        pre = self._pre
        if pre is None:
            raise ValueError(f"adopt: step {plan.step_id} has no pre-draft to take its window from")
        r = self.runner
        r.check_plan(self._own_ids(plan))
        r.kv.apply(plan, [max(x - 1, 0) for x in plan.proposal_lens])
        self._last = (plan, window(plan, pre, chosen))
        return self.predraft(plan.step_id)

    @torch.inference_mode()
    def _propose(self, plan: StepPlan) -> tuple[Proposals, torch.Tensor | None]:
        t0 = time.perf_counter()
        r = self.runner
        plan = self._own_ids(plan)
        r.check_plan(plan)
        # Passes 1..proposal_len-1 each write one slot past the fed tokens; the last
        # proposal is never run through the draft.
        r.kv.apply(plan, [max(x - 1, 0) for x in plan.proposal_lens])
        n, width = plan.num_seqs, plan.width
        masks = self.grammar.draft_masks(plan, self.scored)      # None: nothing proposed is constrained
        if n == 0:
            return Proposals(step_id=plan.step_id, width=width, compute_s=time.perf_counter() - t0), None
        try:
            out = self._passes(plan, masks)
        finally:
            if masks is not None:
                masks.close()
        out.compute_s = time.perf_counter() - t0
        out.mask_s = masks.seconds if masks is not None else 0.0
        return out, self._probs

    def _passes(self, plan: StepPlan, masks) -> Proposals:
        """The catch-up pass and the proposal passes of ``_propose`` (the draft
        probabilities are left in ``self._probs``)."""
        r = self.runner
        n, width = plan.num_seqs, plan.width
        dev = r.device
        lens = plan.proposal_lens
        sampled_rows = [t > 0 for t in plan.temperature]
        any_sampled = any(sampled_rows)
        proposals = torch.full((n, width), -1, dtype=torch.long, device=dev)             # [n, width]
        # Over the target's vocabulary: zero past the ids this draft proposes.
        probs = torch.zeros(n, width, self.target_vocab, device=dev) if any_sampled else None  # [n, width, V]
        w = self.scored
        temps = r.to_device(plan.temperature, torch.float32)
        seeds = r.to_device(plan.seeds)
        greedy = r.to_device([not s for s in sampled_rows], torch.bool)
        seq_len = [c + f for c, f in zip(plan.num_computed, plan.num_new)]            # L_i

        # Pass 0 catches each sequence up (prefill, or the tokens it has not seen yet).
        rows = list(range(n))
        ends = torch.tensor(plan.num_new).cumsum(0) - 1
        logits = r.forward(plan.seq_ids, plan.num_computed, plan.num_new,
                           r.to_device(plan.token_ids), ends.to(dev), tail=[1] * n)[:, :w]   # [n, w]
        for p in range(width):
            if p > 0:
                rows = [i for i in rows if lens[i] > p]
                if not rows:
                    break
                idx = r.to_device(rows)
                logits = r.forward([plan.seq_ids[i] for i in rows], [seq_len[i] + p - 1 for i in rows],
                                   [1] * len(rows), proposals[idx, p - 1],
                                   torch.arange(len(rows), device=dev))[:, :w]       # [m, w]
            else:
                idx = torch.arange(n, device=dev)
            if masks is not None:
                masks.mask(p, rows, logits, proposals)
            tok = logits.argmax(dim=-1)
            if any_sampled and any(sampled_rows[i] for i in rows):
                q = logits_to_probs(logits, temps[idx], [plan.top_k[i] for i in rows],
                                    [plan.top_p[i] for i in rows])                    # [m, w]
                pos = r.to_device([seq_len[i] + p for i in rows])
                drawn = sample_from_probs(q, keyed_uniform(seeds[idx], pos, STREAM_DRAFT))
                tok = torch.where(greedy[idx], tok, drawn)
                probs[idx, p, :w] = q
            proposals[idx, p] = tok
        # Rows planned with proposal_len 0 still ran pass 0; their token is not a proposal.
        proposals[r.to_device([i for i in range(n) if lens[i] == 0])] = -1
        self._probs = probs
        return Proposals(step_id=plan.step_id, width=width, has_probs=any_sampled,
                         seq_ids=list(plan.seq_ids), proposal_lens=list(lens),
                         token_ids=proposals.flatten().tolist())
