"""Tensor and expert parallelism over ``torch.distributed``: the group the model calls
(``group``), the sharding table (``sharding``), rank 0's round broadcast and the
followers' loop (``control``, ``follower``), and the launchers (``launch``)."""
