"""An OpenAI-compatible HTTP server over ``SpecEngine`` (``nextn-graph serve``) and its
load benchmark (``nextn-graph bench-serve``). See docs/serve.md.

The folders show the process boundary: ``front/`` is the HTTP side (the server's
process), ``engine/`` the engine's side (its own process, or a thread), and
``messages.py`` all that crosses between them (frozen dataclasses) and the ``Host`` it
crosses by; the front never imports the engine's side. ``command.py`` (``serve``) puts a
front and an engine host together, ``thread.py`` runs such a server on a thread, and
``bench/`` is ``bench-serve``.

Nothing is imported here: the command line builds its parser without loading the web
libraries; import ``serve.front.app`` (``create_app``) or ``serve.command``
(``make_server``).
"""
