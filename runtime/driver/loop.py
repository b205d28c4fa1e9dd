"""The step loop, on a thread of the driver's own: admitted requests join the scheduler,
aborted ones leave it, and ``Engine.step`` runs while there is work. A step that fails
fails only its own request (``StepFailed``); stop strings are matched after each step,
outside ``_cv``; then clients see the step. A mixin of ``DriverCore``
(``specray.runtime.driver.core``).
"""

from __future__ import annotations

from specray.runtime.driver.stop_strings import stop_cut
from specray.runtime.engine.core import StepFailed
from specray.scheduler.sequence import Sequence


class StepLoop:
    def _loop(self) -> None:
        exported = True
        while True:
            with self._cv:
                while not self._stop and not self._incoming and not self.scheduler.has_work:
                    if not exported:
                        break
                    if self.engine.degraded:
                        # Idle with a worker lost: keep watching for it to come back.
                        self._cv.wait(timeout=0.25)
                        try:
                            self.engine.poll_workers()
                        except Exception as e:  # noqa: BLE001 - the loop must outlive it
                            self._last_error = f"{type(e).__name__}: {e}"
                    else:
                        self._cv.wait()
                if self._stop:
                    return
                incoming, self._incoming = self._incoming, []
                aborted, self._aborted = self._aborted, []
            for seq in incoming:
                self.scheduler.add(seq)
            if aborted:
                for seq in aborted:
                    self.scheduler.finish(seq, "abort")
                self.engine.forget(aborted)
            if not (incoming or self.scheduler.has_work):
                # Idle after work: export the final figures once, then sleep.
                self._export()
                exported = True
                continue
            sched = self.scheduler
            unfinished = len(sched.waiting) + len(sched.running)
            stepped = []
            try:
                stepped = self.engine.step()
            except StepFailed as e:
                # Nothing of the step was kept and its requests were requeued, but the one
                # it ran alone: that one fails, with its own error (``Quarantine``).
                self._num_failed_steps += 1
                self._last_error = str(e)
                if e.culprit is not None:
                    self._fail([e.culprit], str(e))
            except Exception as e:  # noqa: BLE001 - no step's own (every target worker dead): all fail
                self._last_error = f"{type(e).__name__}: {e}"
                self._fail(self.scheduler.abort_all("error"), self._last_error)
            self._match_stops(stepped)
            # A finished sequence leaves both queues (preemption only moves one across).
            if self._pollers or len(sched.waiting) + len(sched.running) < unfinished:
                with self._cv:
                    self._cv.notify_all()
            exported = False
            if self._exporter is not None and self._exporter.due():
                self._export()
                exported = True

    def _fail(self, seqs: list[Sequence], why: str) -> None:
        """These requests failed (their sequences are finished already): each is told
        ``why`` when its client next asks."""
        self.engine.forget(seqs)
        self._num_failed_requests += len(seqs)
        with self._cv:
            for seq in seqs:
                req = self._requests.get(seq.request_id)
                if req is not None:
                    req.error = why
                    req.closed = True

    def _match_stops(self, stepped: list[tuple[Sequence, list[int]]]) -> None:
        """End the sequences whose text now holds one of their stop strings; then show
        clients the step. The search (a decode of each output) runs without ``_cv``:
        between steps only this thread changes a sequence's tokens, and clients read no
        further than what was committed."""
        with self._cv:
            reqs = [(seq, appended, self._requests.get(seq.request_id)) for seq, appended in stepped]
        cuts, broken = [], []
        for seq, appended, req in reqs:
            if req is None or not appended or not seq.params.stop:
                continue
            out = seq.output_tokens
            try:
                cut = stop_cut(self._decode, out, req.stop_checked, seq.params.stop)
            except Exception as e:  # noqa: BLE001 - its text cannot be read: it fails alone
                broken.append((seq, f"stop strings: {type(e).__name__}: {e}"))
                continue
            req.stop_checked = len(out)
            if cut is not None:
                cuts.append((seq, req, cut))
        for seq, why in broken:
            self.scheduler.finish(seq, "error")
            seq.finish_reason = "error"
            self._fail([seq], why)
        ended = []
        with self._cv:
            for seq, req, (keep, begin) in cuts:
                req.stop_text_at = begin
                if not seq.finished:
                    ended.append(seq)                 # else EOS or length ended it in this step
                self.scheduler.finish(seq, "stop")
                seq.finish_reason = "stop"
                seq.truncate_output(keep)
            for _, _, req in reqs:
                if req is not None:
                    req.commit()
        for seq in ended:
            self.engine.finished(seq)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _export(self) -> None:
        if self._exporter is None:
            return
        try:
            self._exporter.update(self.metrics(workers=False))
        except Exception as e:  # noqa: BLE001 - metrics must not stop the serving
            # Raised here, it ended the step loop: every request then waited for ever.
            self._last_error = f"metrics export: {type(e).__name__}: {e}"
