"""Embedding the engine in a server loop: continuous batching, streamed tokens.

Run: .venv/bin/python examples/serve.py
"""

from nextn_graph import InputError, SamplingParams, SpecEngine, load_run_config

# Load once at start-up: checkpoint, KV pools, static buffers, then graph capture.
engine = SpecEngine.from_config(load_run_config())  # the embedded CPU default

# step -> (prompt, sampling): None is greedy; the third request samples, seeded
incoming = {0: ([5, 17, 9, 40, 41, 42], None), 1: ([100, 101, 102, 103], None),
            3: ([7, 8, 9], SamplingParams(temperature=0.8, top_p=0.95, seed=1))}
streams: dict[int, list[int]] = {}
step = 0
while incoming or engine.has_work:
    if step in incoming:  # requests join between rounds
        try:
            prompt, sampling = incoming.pop(step)
            rid = engine.add_request(prompt, max_new_tokens=24, sampling=sampling)
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
