"""One model, its paged KV cache, and a packed forward pass over both."""

from __future__ import annotations

import bisect
import itertools
import logging
import time

import torch

from specray.scheduler.block_manager import blocks_needed
from specray.scheduler.config import CacheConfig
from specray.scheduler.messages import StepPlan
from specray.workers import graph_capture, host_copy, llama_model, memory_budget, model_loader, step_graphs
from specray.workers.config import ModelConfig
from specray.workers.errors import PlanError
from specray.workers.kv_cache import KVCache, kv_shape
from specray.workers.paged_attention import build_metadata, query_tail
from specray.workers.tensor_parallel import RankGroup, check_backend

log = logging.getLogger(__name__)


class ModelRunner:
    """Start-up order (each step needs the one before)::

        load the checkpoint -> native executor (its own fused copies; the checkpoint's
        tensors, or transformers' modules, dropped layer by layer) -> free -> measure
        what this worker holds and what its steps will need -> size and allocate the KV
        cache -> capture every CUDA graph bucket

    so the KV budget never counts weights held twice, and no step pays for a capture.
    With ``allocate=False`` the runner stops before the KV cache: the caller sizes several
    runners of one process together (``memory_budget.plan_blocks`` over their ``need``)
    and calls ``allocate`` on each."""

    def __init__(self, path: str, model: ModelConfig, cache: CacheConfig, window: int | None,
                 allocate: bool = True, group: RankGroup | None = None) -> None:
        """``path``: the checkpoint this runner loads (the target or the draft of ``model``);
        ``window``: the longest sequence it serves, as the driver decided it
        (``workers.model_files.settle_windows``): no plan may reach past it. ``group``: this
        runner is one rank of a tensor-parallel group (``tensor_parallel``): it holds its
        part of the model and KV cache, and every rank runs every forward with it."""
        if model.torch_threads:
            torch.set_num_threads(model.torch_threads)      # the whole process's: its workers share it
        self.path = path
        self.cache_config = cache
        self.max_num_seqs = cache.max_num_seqs
        before = memory_budget.allocated(model_loader.resolve_device(model.device))
        self.group = group if group is not None and group.size > 1 else None
        self.tp_size = group.size if self.group is not None else 1
        self.tp_rank = group.rank if self.group is not None else 0
        if window is None:
            raise ValueError(f"{path}: a worker is built with its window decided (workers.model_files.settle_windows)")
        self.max_model_len = window
        self.native = self._load(model)
        memory_budget.release(self.device)
        self.query_lens = tuple(model.cuda_graph_query_lens) or (1,)
        # A graph would capture the collectives too: tensor-parallel ranks run eagerly.
        self.wants_graphs = self.native is not None and model.cuda_graphs and step_graphs.available(self.device) \
            and self.group is None
        layers, kvh, head_dim = kv_shape(self.config, self.tp_size, self.tp_rank)
        useful = cache.max_num_seqs * blocks_needed(self.max_model_len + 1, cache.block_size)
        sized = self.device.type == "cuda" and not cache.num_kv_blocks
        activations, graph_pool = self.profile_reserve() if sized else (0, 0)
        self.need = memory_budget.MemoryNeed(
            self.device, memory_budget.block_bytes(layers, kvh, head_dim, cache.block_size, self.dtype), useful,
            held=memory_budget.allocated(self.device) - before, activations=activations, graph_pool=graph_pool)
        self.kv: KVCache | None = None
        self.graphs: step_graphs.StepGraphs | None = None
        self.graph_failure: str | None = None    # why capture failed: every step then runs eagerly
        self.graph_capture_s = 0.0
        self.eager_forwards = 0
        if allocate:
            self.allocate(cache.num_kv_blocks or memory_budget.plan_blocks(
                [self.need], cache.gpu_memory_utilization)[0])

    def allocate(self, num_blocks: int) -> None:
        """The KV cache, then (where they apply) every CUDA graph over it. The ranks of a
        group take the fewest blocks any of them sized: one plan serves them all."""
        if self.group is not None:
            num_blocks = self.group.min(num_blocks)
        self.kv = KVCache(self.config, num_blocks, self.cache_config.block_size, self.dtype, self.device,
                          self.tp_size, self.tp_rank)
        if self.wants_graphs:
            self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        graphs = step_graphs.StepGraphs(self.native, self.kv, self.max_num_seqs, self.max_model_len,
                                        self.query_lens, graph_capture.for_device(self.device))
        t0 = time.perf_counter()
        try:
            graphs.capture_all()
        except step_graphs.GraphCaptureError as e:
            self.graph_failure = str(e)
            log.warning("specray: CUDA graph capture for %s failed (%s); every step runs eagerly",
                        self.path, self.graph_failure)
            return
        self.graph_capture_s = time.perf_counter() - t0
        self.graphs = graphs
        # The warm-ups' blocks are cached for the capture stream, where no step runs.
        memory_budget.release(self.device)
        log.info("specray executor: %d CUDA graphs of %s captured in %.1f s (batch up to %d, q in %s)",
                 graphs.captured, self.path, self.graph_capture_s, graphs.batches[-1], graphs.query_lens)

    def profile_reserve(self) -> tuple[int, int]:
        """Bytes this worker's steps will allocate beyond its weights and KV cache: the peak
        of its largest eager steps (a prefill of ``max_num_batched_tokens`` tokens; every
        sequence verifying its widest window at full length, logits included), and its
        graph pool (the largest bucket's forward). Run over a one-block scratch cache (every
        table points at block 0): activations do not depend on the cache's size."""
        reserve = self._measure_reserve()
        memory_budget.release(self.device)        # the profile's buffers go back before sizing
        return reserve

    @torch.inference_mode()
    def _measure_reserve(self) -> tuple[int, int]:
        cache, dev, window = self.cache_config, self.device, self.max_model_len
        tmp = KVCache(self.config, 1, cache.block_size, self.dtype, dev, self.tp_size, self.tp_rank)
        bs = cache.block_size
        total = min(cache.max_num_batched_tokens, self.max_num_seqs * (window - 1))
        per = max(1, min(window - 1, total))
        lens = [per] * (total // per) + ([total % per] if total % per else [])

        def prefill():
            ends = torch.tensor(lens).cumsum(0) - 1
            self._eager(tmp.layers, [[0] * blocks_needed(n, bs) for n in lens], [0] * len(lens), lens,
                        torch.zeros(sum(lens), dtype=torch.long, device=dev), ends.to(dev))

        q = max(self.query_lens, default=1)
        ctx = max(0, window - q)
        n = self.max_num_seqs

        def verify():
            self._eager(tmp.layers, [[0] * blocks_needed(ctx + q, bs)] * n, [ctx] * n, [q] * n,
                        torch.zeros(n * q, dtype=torch.long, device=dev), torch.arange(n * q, device=dev))

        activations = max(memory_budget.peak_bytes(dev, prefill), memory_budget.peak_bytes(dev, verify))
        pool = 0
        if self.wants_graphs:
            g = step_graphs.StepGraphs(self.native, tmp, self.max_num_seqs, window, self.query_lens,
                                       graph_capture.Uncaptured())
            if g.buckets:
                pool = memory_budget.peak_bytes(dev, lambda: g.run_once(g.buckets[0]))
        return activations, pool

    def graph_stats(self) -> dict:
        """Whether this worker's steps replayed CUDA graphs: what ``metrics()`` reports."""
        g = self.graphs
        return {"executor": self.executor, "graphs_captured": g.captured if g else 0,
                "graph_replays": g.replays if g else 0, "eager_forwards": self.eager_forwards,
                "graph_capture_failure": self.graph_failure, "graph_capture_s": round(self.graph_capture_s, 3),
                "kv_blocks": self.num_blocks, "tensor_parallel_size": self.tp_size}

    def _load(self, model: ModelConfig):
        """The checkpoint, on specray's own executor for the families it covers (read
        directly where it is safetensors), else on transformers' modules, which then stay
        in ``self.model`` (``model.executor`` was validated with its ModelConfig)."""
        path, choice = self.path, model.executor
        self.device = model_loader.resolve_device(model.device)
        self.config = model_loader.load_config(path)
        self.dtype = model_loader.resolve_dtype(model.dtype, self.device, self.config)
        self.vocab_size = self.config.vocab_size
        self.model = None
        why = "executor='transformers'" if choice == "transformers" else llama_model.supports(self.config)
        if why and self.group is not None:
            raise ValueError(f"{self.group.field}={self.tp_size} needs the native executor, which cannot run "
                             f"{path}: {why}")
        if why and choice == "native":
            raise ValueError(f"executor='native' cannot run {path}: {why}")
        if self.group is not None:
            check_backend(self.device, self.dtype)
        files = None if why else model_loader.safetensors_files(path)
        if files is not None:
            weights = model_loader.load_weights(files, self.dtype, self.device)
            native = llama_model.NativeCausalLM.from_weights(self.config, weights, self.max_model_len, self.group)
        else:
            self.model, self.config, _, _ = model_loader.load_model(path, model.dtype, model.device, self.config)
            if why:
                log.info("specray executor: %s runs on the transformers path (%s)", path, why)
                return None
            # The native executor holds its own fused, transposed copies: the modules go
            # layer by layer as it builds, so the weights are never held twice.
            native = llama_model.NativeCausalLM.from_hf(self.model, self.max_model_len, release=True,
                                                        group=self.group)
            self.model = None
        log.info("specray executor: %s runs on the native %s executor", path, self.config.model_type)
        return native

    @property
    def executor(self) -> str:
        return "transformers" if self.native is None else "native"

    @property
    def num_blocks(self) -> int:
        return self.kv.blocks.num_blocks

    def check_plan(self, plan: StepPlan) -> None:
        """The plan's own consistency and what this worker's limits allow, before its
        state is touched; the one place every caller's plan is checked (O(batch))."""
        plan.validate()
        n = plan.num_seqs
        if n > self.max_num_seqs:
            raise PlanError(f"StepPlan.seq_ids: {n} sequences, max_num_seqs is {self.max_num_seqs}")
        # The width sizes [n, width, V] buffers whatever the proposal lengths: bound it
        # before allocating.
        if plan.width > self.max_model_len:
            raise PlanError(f"StepPlan.width = {plan.width} exceeds max_model_len {self.max_model_len}")
        if n and max(plan.num_slots) > self.max_model_len:
            i = max(range(n), key=plan.num_slots.__getitem__)
            raise PlanError(f"StepPlan.num_slots[{i}]: sequence {plan.seq_ids[i]} reserves {plan.num_slots[i]} "
                            f"slots, max_model_len is {self.max_model_len}")
        self.check_tokens(plan)

    def check_tokens(self, plan: StepPlan) -> None:
        ids = plan.token_ids
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            j = next(j for j, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            i = bisect.bisect_right(list(itertools.accumulate(plan.num_new)), j)
            sid = plan.seq_ids[i] if i < plan.num_seqs else None
            raise PlanError(f"StepPlan.token_ids[{j}] (sequence {sid}): token id {ids[j]} is outside the "
                            f"vocabulary [0, {self.vocab_size})")

    @torch.inference_mode()
    def forward(self, seq_ids: list[int], num_computed: list[int], num_new: list[int],
                input_ids: torch.Tensor, logits_index: torch.Tensor, tail: list[int] | None = None,
                aux: llama_model.AuxCapture | None = None) -> torch.Tensor:
        """input_ids: [T] on the device (packed, ``num_new[i]`` per sequence);
        logits_index: [m] packed rows whose logits are wanted; ``tail`` (optional): per
        sequence, how many of its last fed rows those lie in. Where the tails are at most
        half the step (a prefill, a draft's catch-up), the native executor's last layer
        runs on them alone. ``aux`` (native executor only): filled with the residual
        stream entering its layers (an EAGLE-3 head's input); such a step runs eagerly.
        Returns float32 [m, V]."""
        tables = self.kv.tables(seq_ids)
        if self.graphs is not None and aux is None:
            hidden = self.graphs.run(tables, num_computed, num_new, input_ids, logits_index)
            if hidden is not None:
                return self.native.logits(hidden).float()
        self.eager_forwards += 1
        return self._eager(self.kv.layers, tables, num_computed, num_new, input_ids, logits_index, tail, aux)

    def _eager(self, layers, tables: list[list[int]], num_computed: list[int], num_new: list[int],
               input_ids: torch.Tensor, logits_index: torch.Tensor, tail: list[int] | None = None,
               aux: llama_model.AuxCapture | None = None) -> torch.Tensor:
        meta, positions = build_metadata(layers, tables, num_computed, num_new, self.cache_config.block_size,
                                         self.device)
        if self.native is not None:
            tail_step = None
            # A tail longer than what its sequence feeds would reach into the one before.
            if tail is not None and 2 * sum(tail) <= input_ids.shape[0] and all(map(int.__le__, tail, num_new)):
                tail_step = query_tail(layers, tables, num_computed, num_new, tail, logits_index,
                                       self.cache_config.block_size, self.device)
            return self.native.forward(input_ids, positions, meta, logits_index, tail_step, aux).float()
        out = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                         use_cache=False, logits_to_keep=logits_index, specray_meta=meta)
        return out.logits[0].float()

    def to_device(self, values: list[int], dtype=torch.long) -> torch.Tensor:
        return host_copy.to_device(values, self.device, dtype)


class ModelWorker:
    """What draft and target workers share: a model runner and what the driver asks of it."""

    kind = "model"

    def __init__(self, path: str, model: ModelConfig, cache: CacheConfig, window: int | None,
                 allocate: bool = True, group: RankGroup | None = None) -> None:
        self.runner = ModelRunner(path, model, cache, window, allocate, group)

    def graph_stats(self) -> dict:
        return {"kind": self.kind, **self.runner.graph_stats()}

    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def vocab_size(self) -> int:
        return self.runner.vocab_size
