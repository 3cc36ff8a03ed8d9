"""An OpenAI-compatible HTTP server over ``SpecEngine`` (``nextn-graph serve``) and its
load benchmark (``nextn-graph bench-serve``). See docs/serve.md.

Nothing is imported here: the command line builds its parser without loading the web
libraries; import ``serve.app`` (``create_app``) or ``serve.command`` (``make_server``).
"""
