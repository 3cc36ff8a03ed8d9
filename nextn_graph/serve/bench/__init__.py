"""``nextn-graph bench-serve``: a load against a server on a thread of this process
(``load``: the requests and their measures; ``prefix``: the prefix-cache comparison;
``command``: the command, its report and plot)."""
