"""How the driver reaches its workers, wherever they run.

One interface, ``WorkerCall`` (``worker_call``): ``submit`` a step, ``wait`` for its
answer, ``alive``/``gone`` for liveness. Behind it a worker runs in the driver's process
(``LocalCall``), or on a Ray actor (``draft_actor``, ``target_actor``, their shared
restarts and liveness in ``actor_handle``) reached by Ray calls or by the actor's own
socket (``worker_link``, with ``link_auth`` and ``link_frames``). ``worker_pool`` starts
the workers a configuration asks for and hands them to the engine: the targets as
``WorkerCall``s, the proposer as one ``Proposer`` (the draft model's workers are its
ranks, ``draft_proposer``).

May import: ray (only where an actor is defined or started), ``specray.scheduler``,
``specray.workers`` (inside actors, not at module level where the driver imports it).
"""
