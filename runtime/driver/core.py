"""The driver: owns the scheduler and the workers, runs the step loop on its own thread,
and serves clients (submit, wait, stream polls, metrics) concurrently.

``DriverCore`` is the driver itself, by concern: admission (``admission``), what clients
see (``streams``), the step loop (``loop``), and here its start, its view of the models,
its metrics and its shutdown. ``Driver`` (``actor``) is the Ray actor around it.

State the parts share, guarded by ``_cv`` where a client thread and the loop both reach
it: ``_requests`` (request id -> ``streams.Request``), ``_incoming`` and ``_aborted``
(handed to the loop), ``_pollers``, ``_stop``.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.admission import Admission
from specray.runtime.driver.loop import StepLoop
from specray.runtime.driver.prompt_bound import max_prompt_chars
from specray.runtime.driver.replies import DriverInfo
from specray.runtime.driver.streams import Request, Streams
from specray.runtime.engine.core import Engine
from specray.runtime.engine.step_groups import GroupEngine, wants_groups
from specray.runtime.settled import settle
from specray.runtime.transport.worker_pool import start_workers
from specray.scheduler.block_manager import BlockManager
from specray.scheduler.policies import build_policy
from specray.scheduler.scheduler import Scheduler
from specray.scheduler.sequence import Sequence


def _call_off(launch: Future, cancel: threading.Event) -> None:
    """Workers starting for a driver that then refused its configuration: call the start
    off (on Ray at once; in this process once the model it is loading is in) and release
    whatever it had already taken."""
    cancel.set()
    try:
        pool = launch.result()
    except BaseException:
        return          # called off, or failed as well: it released its own
    pool.release()


class DriverCore(Admission, Streams, StepLoop):
    def __init__(self, config: RuntimeConfig, export_metrics: bool = False) -> None:
        """``config``: its layout decided (``specray.runtime.layout.resolve``); everything
        that follows from it is settled here once (``specray.runtime.settled``), before
        anything starts. ``export_metrics``: publish on Ray's metrics API."""
        config = settle(config)
        self.config = config
        policy = build_policy(config.speculation)      # bad policy options are refused before any start
        # The workers start first and load their models while this process reads the
        # tokenizer and the configs (importing transformers alone takes seconds).
        cancel = threading.Event()
        # A target worker loads in this process in either layout: transformers imported
        # from two threads at once fails half-initialised, so it is imported here first.
        import specray.workers.target_worker  # noqa: F401
        with ThreadPoolExecutor(1, thread_name_prefix="specray-start") as ex:
            launch = ex.submit(start_workers, config, cancel)
            try:
                self._read_models(config)
            except BaseException:
                _call_off(launch, cancel)
                raise
            self.pool = launch.result()
        bs = config.cache.block_size
        draft_pools = [BlockManager(n, bs) for n in self.pool.draft_blocks] if self.pool.draft_blocks else None
        # A cached block's name says which models computed it (and in which dtype).
        model = config.model
        cache_key = repr((model.target, model.draft if config.speculation.draft_model else None, model.dtype))
        self.scheduler = Scheduler(config.cache, config.speculation, self.max_model_len,
                                   [BlockManager(n, bs) for n in self.pool.target_blocks], draft_pools,
                                   draft_max_model_len=config.model.draft_max_model_len,
                                   num_proposers=self.pool.proposer.num_ranks, policy=policy,
                                   prefix_cache_key=cache_key)
        # Pre-drafts run while the target verifies where draft workers are actors; in
        # process they run in turn, computing the same windows.
        engine = GroupEngine if wants_groups(config) else Engine
        self.engine = engine(self.scheduler, self.pool.verifiers, self.pool.proposer,
                             config.cluster.target_down_timeout_s, overlap=config.speculation.overlap)
        self._rng = random.Random(config.seed)
        self._cv = threading.Condition()
        self._incoming: list[Sequence] = []
        self._aborted: list[Sequence] = []
        self._num_aborted = 0
        self._requests: dict[str, Request] = {}
        # Stream polls waiting for tokens: the loop wakes waiters every step only while one
        # waits; ``wait`` callers need a wake-up only when a request ends (waking them every
        # step hands the GIL to a thread with nothing to do, a tenth of a batch-1 step).
        self._pollers = 0
        self._next_seq = 0
        self._stop = False
        self._last_error: str | None = None      # operators' view (metrics); a client sees its own request's
        self._num_failed_steps = 0
        self._num_failed_requests = 0
        self._exporter = None
        if export_metrics:
            from specray.runtime.driver.metrics_export import RayMetrics

            self._exporter = RayMetrics(config.cluster.name or "anonymous")
        self._thread = threading.Thread(target=self._loop, name="specray-step-loop", daemon=True)
        self._thread.start()

    @property
    def max_model_len(self) -> int:
        """The window in force (settled)."""
        return self.config.model.max_model_len

    def _read_models(self, config: RuntimeConfig) -> None:
        """The driver's own view of the models: vocabulary, EOS ids and the tokenizer;
        checks the pair agrees."""
        # Imported here, not at module level: the client process defines the driver actor
        # from this class and should not pay for torch and transformers (seconds per CLI call).
        from specray.workers import model_loader
        from specray.workers.vocabulary import check_pair

        def tokenizer_or_none(path: str):
            try:
                return model_loader.load_tokenizer(path)
            except Exception:
                return None

        model = config.model
        tcfg = model_loader.load_config(model.target)
        self.vocab_size = tcfg.vocab_size
        self.eos_ids = model_loader.eos_token_ids(tcfg)
        self.tokenizer = tokenizer_or_none(model.target)  # None: token-id prompts only
        # A text prompt longer than this cannot fit the window, whatever it is: refused
        # before tokenizing it (which costs as much as the text is long); None: no bound
        # is known for this tokenizer.
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        if model.draft is not None and config.speculation.draft_model:    # a head is checked where it loads
            dcfg = model_loader.load_config(model.draft)
            # Vocabulary sizes may differ (padding); the token ids both score must agree.
            check_pair(model.target, model.draft, tcfg.vocab_size, dcfg.vocab_size, self.tokenizer,
                       tokenizer_or_none(model.draft) if self.tokenizer is not None else None)

    def info(self) -> DriverInfo:
        return DriverInfo(self.config, self.vocab_size, self.max_model_len, list(self.eos_ids),
                          self.tokenizer is not None, bool(getattr(self.tokenizer, "chat_template", None)))

    def metrics(self, workers: bool = True) -> dict:
        """``workers``: also ask each model worker whether its steps replayed CUDA graphs
        (``worker_graphs``, one entry per worker, targets first; None where an actor did not
        answer), and their sums. The periodic export leaves that out: a dead actor would
        hold the step loop for the call's timeout."""
        m = self.scheduler.stats.as_dict()
        dead_drafts, dead_targets = self.engine.dead()
        m.update(num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
                 # accepted and not yet delivered (finished ones wait here for their caller)
                 num_requests_held=len(self._requests), max_pending=self.config.max_pending,
                 num_requests_aborted=self._num_aborted,
                 target_kv_blocks_used=[p.num_used_blocks for p in self.scheduler.target_pools],
                 target_kv_blocks_total=[p.num_blocks for p in self.scheduler.target_pools],
                 draft_kv_blocks_used=[p.num_used_blocks for p in self.scheduler.draft_pools],
                 draft_kv_blocks_total=[p.num_blocks for p in self.scheduler.draft_pools],
                 num_target_workers=len(self.pool.verifiers), num_draft_workers=self.pool.proposer.num_ranks,
                 draft_workers_down=sorted(self.scheduler.drafts_down),
                 target_workers_down=sorted(self.scheduler.targets_down),
                 draft_workers_dead=dead_drafts, target_workers_dead=dead_targets,
                 # workers whose steps run over a link of their own (``worker_link``) right now
                 num_linked_workers=sum(getattr(c, "linked", bool)()
                                        for c in self.pool.verifiers + self.pool.draft_calls),
                 num_speculative_tokens=self.config.speculation.num_speculative_tokens,
                 proposer=self.config.speculation.proposer, overlap=self.engine.book is not None,
                 layout=self.config.cluster.layout, tensor_parallel_size=self.config.cluster.tensor_parallel_size,
                 draft_tensor_parallel_size=self.config.cluster.draft_tensor_parallel_size,
                 num_group_steps=getattr(self.engine, "num_group_steps", 0),
                 # steps that raised (requeued, then narrowed down to the request that
                 # failed them) and the requests that failed, for any reason
                 num_failed_steps=self._num_failed_steps, num_requests_failed=self._num_failed_requests,
                 last_error=self._last_error)
        m.update(self.engine.proposer.stats())
        if workers:
            graphs = self.pool.graph_stats()
            live = [g for g in graphs if g is not None]
            m.update(worker_graphs=graphs, graph_replays=sum(g["graph_replays"] for g in live),
                     eager_forwards=sum(g["eager_forwards"] for g in live),
                     graph_capture_failures=sum(g["graph_capture_failure"] is not None for g in live))
        return m

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        self.pool.release()
