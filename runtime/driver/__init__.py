"""The driver: the one scheduling point. It admits requests, runs the step loop on a
thread of its own, serves clients' polls and waits, and survives its own restarts.

May import: ray (the actor), ``specray.runtime.engine``, ``specray.runtime.transport``,
``specray.scheduler``; ``specray.workers`` only inside functions (model configs and the
tokenizer), so a client that names the actor class does not import torch.
"""
