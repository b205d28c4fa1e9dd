"""The target model: scores every sequence's k_i + 1 positions in one packed forward
pass (no batch expansion) and runs the rejection sampler."""

from __future__ import annotations

import torch

from scheduler.messages import StepPlan, StepResult
from workers.kv_cache import PlanError
from workers.model_runner import ModelWorker
from workers.rejection_sampler import greedy_verify, random_verify
from workers.sampling import STREAM_ACCEPT, STREAM_TARGET, keyed_uniform, logits_to_probs


class TargetWorker(ModelWorker):
    @torch.inference_mode()
    def verify(self, plan: StepPlan, *draft_probs: torch.Tensor | None) -> StepResult:
        """``draft_probs``: the proposing shards' ``[m, k, V]`` tensors in shard order
        (``plan.draft_rows`` indexes their concatenation)."""
        r = self.runner
        r.check_plan(plan)
        n, k = plan.num_seqs, plan.k
        plens = plan.proposal_lens if plan.proposal_token_ids else [0] * n
        self._check_proposals(plan, plens, draft_probs)
        r.kv.apply(plan, plens)          # proposals are fed: their K/V is written too
        if n == 0:
            return StepResult(step_id=plan.step_id)
        dev = r.device
        props = plan.proposal_token_ids or [-1] * (n * k)

        # Packed input: each sequence's new tokens, then its proposals.
        tokens: list[int] = []
        fed: list[int] = []
        score_rows: list[int] = []      # packed row of each scored position
        pad_rows: list[int] = []        # where it goes in [n * (k + 1)]
        start = pos = 0
        for i in range(n):
            m = plan.num_new[i]
            tokens.extend(plan.token_ids[start:start + m])
            tokens.extend(props[i * k:i * k + plens[i]])
            start += m
            fed.append(m + plens[i])
            last = pos + m - 1
            score_rows.extend(range(last, last + plens[i] + 1))
            pad_rows.extend(range(i * (k + 1), i * (k + 1) + plens[i] + 1))
            pos += fed[-1]
        logits = r.forward(plan.seq_ids, plan.num_computed, fed, r.to_device(tokens),
                           r.to_device(score_rows))                                   # [S, V]
        vocab = logits.shape[-1]
        scores = logits.new_zeros(n * (k + 1), vocab)
        scores[r.to_device(pad_rows)] = logits
        scores = scores.view(n, k + 1, vocab)                                         # [n, k+1, V]
        draft_ids = torch.tensor(props, dtype=torch.long).view(n, k).to(dev)          # [n, k]
        lens_t = r.to_device(plens)

        out = torch.empty(n, k + 1, dtype=torch.long, device=dev)
        emitted = torch.empty(n, dtype=torch.long, device=dev)
        g_rows = [i for i in range(n) if plan.temperature[i] == 0]
        s_rows = [i for i in range(n) if plan.temperature[i] > 0]
        if g_rows:
            gi = r.to_device(g_rows)
            out[gi], emitted[gi] = greedy_verify(scores[gi].argmax(dim=-1), draft_ids[gi], lens_t[gi])
        if s_rows:
            si = r.to_device(s_rows)
            m = len(s_rows)
            rep = lambda xs: [xs[i] for i in s_rows for _ in range(k + 1)]  # noqa: E731
            probs = logits_to_probs(scores[si].view(m * (k + 1), vocab), r.to_device(rep(plan.temperature), torch.float32),
                                    rep(plan.top_k), rep(plan.top_p)).view(m, k + 1, vocab)
            rows = [plan.draft_rows[i] if plan.draft_rows else -1 for i in s_rows]
            q, has_q = self._draft_probs(draft_probs, rows, dev)
            base = r.to_device([plan.num_computed[i] + plan.num_new[i] for i in s_rows])   # L_i
            positions = base.unsqueeze(-1) + torch.arange(k + 1, device=dev)             # [m, k+1]
            seeds = r.to_device([plan.seeds[i] for i in s_rows]).unsqueeze(-1)
            accept_u = keyed_uniform(seeds, positions[:, :k], STREAM_ACCEPT)
            sample_u = keyed_uniform(seeds, positions, STREAM_TARGET)
            out[si], emitted[si] = random_verify(probs, draft_ids[si], q, has_q, lens_t[si], accept_u, sample_u)

        counts = emitted.tolist()
        flat = out.tolist()
        token_ids = [t for i, row in enumerate(flat) for t in row[:counts[i]]]
        return StepResult(step_id=plan.step_id, seq_ids=list(plan.seq_ids), num_emitted=counts, token_ids=token_ids)

    def _check_proposals(self, plan: StepPlan, plens: list[int], shards) -> None:
        """Proposals are fed to the model and index one-hot rows, draft rows index the
        shards: all must be in range (O(n * k) in C, no per-token Python)."""
        vocab, k = self.runner.vocab_size, plan.k
        props = plan.proposal_token_ids
        if props and (min(props) < -1 or max(props) >= vocab):
            j = next(j for j, t in enumerate(props) if not -1 <= t < vocab)
            raise PlanError(f"StepPlan.proposal_token_ids[{j}] (sequence {plan.seq_ids[j // k]}): "
                            f"{props[j]} is outside the vocabulary [0, {vocab})")
        for i, m in enumerate(plens):
            if m and min(props[i * k:i * k + m]) < 0:
                raise PlanError(f"StepPlan.proposal_token_ids: sequence {plan.seq_ids[i]} pads inside "
                                f"its {m} proposals")
        rows = 0
        for j, s in enumerate(shards):
            if s is None:
                continue
            if not (isinstance(s, torch.Tensor) and s.is_floating_point() and s.dim() == 3
                    and s.shape[1:] == (k, vocab)):
                what = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                raise PlanError(f"draft_probs[{j}] must be a float tensor [m, {k}, {vocab}], got {what}")
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
