"""The HTTP side of the server: routes (``app``, ``tokens``), request parsing and field
policies, prompts, sessions and their text, logprobs, response shapes, limits, errors and
metrics, and the ``worker`` that holds the engine's host. It never imports the engine's
side (``serve.engine``) or the runtime's engine: it reaches the engine only through
``serve.messages`` and a ``Host`` (a ``layers`` and a ``forbidden`` contract in
pyproject.toml keep it so)."""
