"""An EAGLE-3 head proposing in the target worker's process, from the target's own
hidden states.

It is the target worker's ``InTargetHead`` (``specray.workers.in_target_head``): both
calls happen inside the target's verify, so a step stays one call to the target.

- ``verified`` (end of the target's verify): the rows the target kept (each sequence's
  fed tokens and its accepted proposals) are run through the head with the target's aux
  hidden states, the row at position q carrying token q + 1: the head's K/V at those
  positions is rebuilt from the target's features, overwriting whatever its own guesses
  wrote there. The last row's prenorm output is kept: it predicts the sequence's next
  token but one, the first draft of the next step.
- ``propose`` (the next verify, before its forward): the first draft from that row; each later draft feeds the
  previous one with the head's prenorm output back, one row per pass, at the positions
  past the target's (their K/V are scratch, rebuilt by the next ``verified``)::

      sequence of length L after a verify (target computed L - 1 positions):
      verified rows c .. L-2 : tokens x_{c+1} .. x_{L-1}, h = fc(target aux)  -> d_1 (position L)
      propose  row  L-1      : token d_1, h = prenorm of row L-2             -> d_2 (position L+1)
               row  L        : token d_2, h = prenorm of row L-1             -> d_3 ...

The head's cache is laid out like the target's and indexed by the target's block tables
(``eagle3_head``): it holds a slot wherever the target does, and the target's
reservation of ``proposal_len`` lookahead slots covers the drafts' rows. A sequence the
head has not observed at its current length (its first step, a recompute, a step that
failed) proposes nothing that step: drafts only ever come from the target's features.

Proposals are drawn as a draft model's are (``draft_worker``): greedy rows take the
argmax, sampled rows a sample of the head's logits scattered into the target vocabulary
(-inf outside the draft vocabulary) under the request's temperature, top-k and top-p,
with the uniform keyed by (seed, position); those probabilities are the q the rejection
sampler reads, so the output is the target's distribution exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specray.scheduler.messages import StepPlan, StepResult
from specray.workers.eagle3_head import Eagle3Head
from specray.workers.eagle3_loader import fit_target, load_eagle3
from specray.workers.in_target_head import InTargetHead
from specray.workers.llama_model import AuxCapture
from specray.workers.paged_attention import build_metadata
from specray.workers.sampling import STREAM_DRAFT, keyed_uniform, logits_to_probs, sample_from_probs


@dataclass
class _Observed:
    seq_len: int             # the sequence's length the state is for: the next token's position
    hidden: torch.Tensor     # [H] prenorm output of its last observed row


class Eagle3Drafter(InTargetHead):
    def __init__(self, path: str, runner) -> None:
        """The head at ``path`` for the target ``runner`` (a ``ModelRunner``) runs; refused
        (ValueError naming the field) where it does not fit that target."""
        if runner.native is None:
            raise ValueError(f"draft: the EAGLE-3 head {path} reads the target's hidden states, which specray "
                             f"captures on its native executor only, and {runner.path} runs on transformers")
        ckpt = fit_target(load_eagle3(path), runner.config)
        self.path = path
        self.runner = runner
        self.aux_layers = ckpt.aux_inputs
        self.head = Eagle3Head(ckpt, runner.native.embed, runner.max_model_len, runner.dtype, runner.device)
        self.draft_vocab_size = ckpt.draft_vocab_size
        self._observed: dict[int, _Observed] = {}
        self._aux: AuxCapture | None = None          # what this step's target forward filled
        self.compute_s = 0.0                         # the head's own time, proposing and rebuilding

    def capture(self) -> AuxCapture:
        """What the target's forward fills for ``verified``: the residual stream entering
        the head's aux layers, every row."""
        self._aux = AuxCapture(self.aux_layers)
        return self._aux

    def forget(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self._observed.pop(sid, None)

    def _cache(self) -> None:
        # One head slot per target slot: (re)made when the target's cache is (it may be
        # sized after this drafter is built).
        slots = self.runner.kv.layers[0][0].shape[0]
        if self.head.num_slots != slots:
            self.head.allocate(slots)

    @torch.inference_mode()
    def propose(self, plan: StepPlan, rows: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Proposals for the target plan's sequences ``rows`` (``InTargetHead.propose``):
        up to ``plan.proposal_lens[i]`` each, none where the head has not observed the
        sequence at its length or the target's pool cannot hold the drafts' rows yet; and,
        where a row samples, their probabilities ``[len(rows), width, V_target]``. Runs
        before the verify applies the plan to the target's cache: the plan's frees are made
        in its pool first (the verify makes them again, which changes nothing), then each
        drafting sequence's block table grows to hold the rows its drafts write, within
        what the driver reserved for the step."""
        t0 = time.perf_counter()
        n, width = plan.num_seqs, plan.width
        dev = self.runner.device
        kv = self.runner.kv
        step_len = [c + f for c, f in zip(plan.num_computed, plan.num_new)]
        self.forget(plan.free_seq_ids)
        bm = kv.blocks
        for sid in plan.free_seq_ids:
            bm.free(sid)
        asked = set(rows)
        lens = [x if i in asked and x and (o := self._observed.get(sid)) is not None and o.seq_len == length else 0
                for i, (sid, x, length) in enumerate(zip(plan.seq_ids, plan.proposal_lens, step_len))]
        for i, sid in enumerate(plan.seq_ids):
            # Draft p >= 2 is computed from a row at position L + p - 3: L + lens - 2 slots.
            need = step_len[i] + lens[i] - 2
            if lens[i] > 1 and bm.blocks_needed(need) > len(bm.block_table(sid)) and not bm.allocate_slots(sid, need):
                lens[i] = 0
        tables = kv.tables(plan.seq_ids)
        proposals = torch.full((n, width), -1, dtype=torch.long, device=dev)              # [n, width]
        sampled = [plan.temperature[i] > 0 for i in range(n)]
        any_sampled = any(sampled[i] for i in rows)
        probs = torch.zeros(n, width, self.head.target_vocab, device=dev) if any_sampled else None  # [n, width, V]
        rows_asked, rows = rows, [i for i in range(n) if lens[i]]
        if rows:
            self._cache()
            to_dev = self.runner.to_device
            temps = to_dev(plan.temperature, torch.float32)
            seeds = to_dev(plan.seeds)
            greedy = to_dev([not s for s in sampled], torch.bool)
            h = torch.stack([self._observed[plan.seq_ids[i]].hidden for i in rows])            # [m, H]
            tok = None
            for p in range(max(lens)):
                if p > 0:
                    keep = [j for j, i in enumerate(rows) if lens[i] > p]
                    rows = [rows[j] for j in keep]
                    keep_t = to_dev(keep)
                    # Draft p (at position L + p - 1) is fed at position L + p - 2.
                    meta, positions = build_metadata(self.head.kv, [tables[i] for i in rows],
                                                     [step_len[i] + p - 2 for i in rows], [1] * len(rows),
                                                     self.runner.cache_config.block_size, dev)
                    h = self.head.forward(tok.index_select(0, keep_t), h.index_select(0, keep_t), positions, meta)
                idx = to_dev(rows)
                logits = self.head.logits(h)                                                  # [m, draft_vocab]
                tok = self.head.target_ids.index_select(0, logits.argmax(dim=-1))              # [m]
                if any_sampled and any(sampled[i] for i in rows):
                    q = logits_to_probs(self.head.to_target(logits), temps[idx], [plan.top_k[i] for i in rows],
                                        [plan.top_p[i] for i in rows])                          # [m, V]
                    pos = to_dev([step_len[i] + p for i in rows])
                    drawn = sample_from_probs(q, keyed_uniform(seeds[idx], pos, STREAM_DRAFT))
                    tok = torch.where(greedy[idx], tok, drawn)
                    probs[idx, p] = q
                proposals[idx, p] = tok
        flat = proposals.flatten().tolist()
        tokens = [flat[i * width:i * width + lens[i]] for i in rows_asked]
        self.compute_s += time.perf_counter() - t0
        return tokens, (probs.index_select(0, self.runner.to_device(rows_asked)) if probs is not None else None)

    def verified(self, plan: StepPlan, result: StepResult) -> None:
        """The step's verdicts (``InTargetHead.verified``): rebuild the head over the rows
        the target kept, from the hidden states its forward captured."""
        aux, self._aux = self._aux, None
        emitted, pos = [], 0
        for k in result.num_emitted:
            emitted.append(result.token_ids[pos:pos + k])
            pos += k
        t0 = time.perf_counter()
        if aux is None or not plan.num_seqs:
            self.forget(plan.free_seq_ids)
        else:
            self.observe(plan, result.proposed, emitted, aux.concat(), self.runner.kv.tables(plan.seq_ids))
        self.compute_s += time.perf_counter() - t0

    @torch.inference_mode()
    def observe(self, plan: StepPlan, proposal_lens: list[int], emitted: list[list[int]], aux: torch.Tensor,
                tables: list[list[int]]) -> None:
        """After the target verified ``plan`` (``proposal_lens`` proposals each, its
        forward's rows packed as fed tokens then proposals): ``emitted[i]`` the tokens
        sequence i emitted, ``aux`` [T, n * H_t] the target's hidden states of every row.
        Rebuilds the head's K/V over the rows the target kept."""
        self.forget(plan.free_seq_ids)
        n = plan.num_seqs
        if n == 0:
            return
        self._cache()
        rows: list[int] = []
        tokens: list[int] = []
        kept: list[int] = []
        row = fed = 0
        for i in range(n):
            new = plan.num_new[i]
            k = new + len(emitted[i]) - 1            # fed tokens and accepted proposals
            rows += range(row, row + k)
            # Row q carries token q + 1: the fed tokens shifted by one, then what was emitted.
            tokens += plan.token_ids[fed + 1:fed + new]
            tokens += emitted[i]
            kept.append(k)
            row += new + proposal_lens[i]
            fed += new
        r = self.runner
        h = self.head.combine(aux.index_select(0, r.to_device(rows)))                          # [R, H]
        meta, positions = build_metadata(self.head.kv, tables, plan.num_computed, kept,
                                         r.cache_config.block_size, r.device)
        out = self.head.forward(r.to_device(tokens), h, positions, meta)                       # [R, H]
        last = out.index_select(0, r.to_device(kept).cumsum(0) - 1)                           # [n, H]
        for i, sid in enumerate(plan.seq_ids):
            self._observed[sid] = _Observed(plan.num_computed[i] + kept[i] + 1, last[i])
