"""Helpers of the server tests: a checkpoint copy with a chat template, the server's
metrics read back, the engine seen idle, a free loopback port."""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from nextn_graph.checkpoint.loader import resolve_checkpoint

CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def chat_checkpoint(tmp: Path) -> Path:
    """builtin:tiny-trained copied, with a chat template in tokenizer_config.json."""
    root = tmp / "tiny-chat"
    shutil.copytree(resolve_checkpoint("builtin:tiny-trained"), root)
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return root


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics -> {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_idle(server, rows: int, timeout_s: float = 10.0) -> None:
    """Until the engine has no work, every pool row is free and nothing is in flight, as
    the engine loop's latest snapshot says (the engine may be in another process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = server.state.worker.snapshot
        if snap is not None and not snap.has_work and snap.free_rows == rows and (
                server.state.admission.in_flight == 0):
            return
        assert time.monotonic() < deadline, f"not idle: {snap}"
        time.sleep(0.02)


FAULT = "injected round fault"


def fault_a_shared_round(engine) -> None:
    """An engine's set-up for the fault tests (``EngineSpec.prepare``: a function of this
    module, so a spawned engine process imports it by name): once two pool rows have
    run rounds, the next round chunk launched raises, once. With one-row buckets, that
    chunk holds one request: it fails and the other runs on."""
    chunks = engine.chunks
    launch, seen, fired = chunks.launch, set(), []

    def faulty(slots, *args, **kwargs):
        seen.update(chunks.slots.row(s) for s in slots)
        if len(seen) >= 2 and not fired:
            fired.append(True)
            raise RuntimeError(FAULT)
        return launch(slots, *args, **kwargs)

    chunks.launch = faulty
