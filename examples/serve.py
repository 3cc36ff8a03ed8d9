"""Embedding the engine in a server loop: continuous batching, streamed tokens.

Run: .venv/bin/python examples/serve.py
"""

from nextn_graph import InputError, SpecEngine, load_run_config

# Load once at start-up: checkpoint, KV pools, static buffers, then graph capture.
engine = SpecEngine.from_config(load_run_config())  # the embedded CPU default

incoming = {0: [5, 17, 9, 40, 41, 42], 1: [100, 101, 102, 103], 3: [7, 8, 9]}  # step -> prompt
streams: dict[int, list[int]] = {}
step = 0
while incoming or engine.has_work:
    if step in incoming:  # requests join between rounds
        try:
            rid = engine.add_request(incoming.pop(step), max_new_tokens=24)
            streams[rid] = []
        except InputError as exc:  # a bad request is refused alone
            print("refused:", exc)
    for out in engine.step():  # one prefill and/or one speculative round
        streams[out.rid].extend(out.new_tokens)  # send these to the client now
        if out.error is not None:  # a fault (kernel error, OOM) failed this request alone
            print(f"request {out.rid} failed: {out.error}")
        elif out.finished:
            print(f"request {out.rid} done: {streams[out.rid]}")
    step += 1
