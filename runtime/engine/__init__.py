"""The step loop's one step, independent of where the workers run:
schedule -> propose -> verify -> update (``core.Engine``); two groups of sequences in
flight so the draft of one overlaps the verify of the other (``step_groups``); and the
book of pre-drafted windows (``predraft_book``).

May import: ``specray.scheduler`` and ``specray.runtime.transport.worker_call`` (the
interface, not the actors). No Ray: a replay drives it with in-process workers.
"""
