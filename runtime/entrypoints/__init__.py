"""Where users meet specray besides the Python handle: the ``specray`` command
(``cli``, its flags from the configuration in ``cli_args``), ``specray serve``
(``serve``), the OpenAI-compatible HTTP server (``openai/``), the batch job
(``batch/``) and ``specray models`` (``models_cli``).

May import anything of specray's; nothing imports it but the console script and tests.
"""
