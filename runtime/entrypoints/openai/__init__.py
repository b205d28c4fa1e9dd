"""The OpenAI-compatible HTTP endpoint on Ray Serve: request parsing and answers
(``protocol``), the doors every request passes first (``guard``: Host, API key,
Content-Type, body size), the FastAPI ingress in front of the driver (``ingress``), and
``specray serve --http`` in the foreground (``serve_http``)."""
