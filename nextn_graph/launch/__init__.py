"""Starting and following the ranks of a tensor-parallel group: ``ranks`` (spawn,
torchrun, loading on every rank) and ``follower`` (the loop of every rank but 0).
Above the runtime and the checkpoint side, which they drive; the primitives they use
(the group, its collectives and host messages) are in ``nextn_graph.parallel``."""
