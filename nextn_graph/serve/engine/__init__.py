"""The engine's side of the server: the engine built (``build``), the one loop that calls
it (``loop``) and its per-turn ``snapshot``, hosted in a process of its own (``process``)
or on a thread (``hosts``: ``ProcessHost``, ``ThreadHost``). It talks to the HTTP front
only through ``serve.messages``, and never imports it."""
