"""The Ray side of specray: the driver actor and its step loop, the worker actors and
their driver-side handles, the client handle, the CLI, the batch job and the bench."""
