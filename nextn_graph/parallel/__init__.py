"""Tensor-parallel primitives over ``torch.distributed``: the group the model calls
(``group``), rank 0's host messages to the other ranks (``messages``, frozen dataclasses)
and the channel that carries them (``control``). The lowest layer but the base modules:
the sharding table is ``checkpoint.sharding``, starting the ranks and the followers' loop
are ``nextn_graph.launch``."""
