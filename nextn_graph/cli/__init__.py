"""The command line, ``nextn-graph`` (``main``): the top layer, above everything it
drives. ``commands`` (parser, dispatch, error mapping), ``generate`` (the generate
command), ``prompts`` (its prompt files), ``serve_options`` (the options of ``serve``
and ``bench-serve``; the web stack is imported only when one of those runs)."""

from .commands import main

__all__ = ["main"]
