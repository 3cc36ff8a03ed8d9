"""Serving on a tensor-parallel group of 2 (gloo on the CPU): ``parallel.tp`` 2 with the
engine process as rank 0 (it spawns rank 1), and ``nextn-graph serve --tp 2`` under
torchrun (rank 0 serves, its engine on a thread; rank 1 follows). Greedy tokens are the
no-cache oracle's; an idle server outlives the group's timeout (rank 0 pings); a killed
follower fails requests explicitly; no rank outlives the server or a killed engine
process; ``--engine-thread`` with ``--tp 2`` is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.cli.commands import build_parser
from nextn_graph.config import load_run_config
from nextn_graph.errors import ConfigError
from nextn_graph.launch.ranks import free_port
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.serve.command import make_server, serve_config
from nextn_graph.serve.engine.hosts import ProcessHost
from nextn_graph.serve.front.limits import ServeSettings
from nextn_graph.serve.thread import ServerThread

pytestmark = pytest.mark.process  # engine processes and their spawned followers

REPO = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
ENV["OMP_NUM_THREADS"] = "1"
ROWS, MAX_CONTEXT, TOKENS = 2, 256, 12
TIMEOUT_S = 12  # the group's: a follower's receive waits at most this long
PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 109, 121], [5, 6, 7, 8, 9, 10], [40] * 30]
SECTIONS = {"pool": {"max_requests": ROWS, "max_context": MAX_CONTEXT},
            "graph": {"sampling": False}}


@pytest.fixture(scope="module")
def oracle() -> list[list[int]]:
    """No-cache greedy decoding of the tiny checkpoint, EOS ignored."""
    models = load_checkpoint("builtin:tiny-trained")
    return reference_generate(models.target, PROMPTS, TOKENS, stop_ids=set(),
                              max_context=MAX_CONTEXT).outputs


def _tp2_server() -> ServerThread:
    cfg = load_run_config(None, **SECTIONS, parallel={"tp": 2, "timeout_s": TIMEOUT_S})
    return ServerThread(cfg, ServeSettings(port=0, max_waiting=4))


def _complete(url: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True})


def _tokens(url: str, prompt: list[int]) -> list[int]:
    r = _complete(url, prompt)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (Linux /proc), spawned ones only."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(stat[1]) == pid and stat[0] != "Z" and b"resource_tracker" not in cmd:
            kids.append(int(entry))
    return kids


def _listening(pids: list[int], port: int) -> list[int]:
    """Those of ``pids`` holding a socket that listens on ``port`` (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{f[9]}]")
    return [pid for pid in pids if inodes & set(_fd_targets(pid))]


def _fd_targets(pid: int):
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            yield os.readlink(fd)
        except OSError:  # closed meanwhile
            continue


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_tp2_engine_process_serves_the_oracle_and_outlives_an_idle_spell(oracle):
    """The engine process is rank 0 and rank 1 its child. Whole requests, three at once
    over two pool rows, give the oracle's tokens; after an idle spell longer than the
    group's timeout the server still serves them; at the end both ranks are gone."""
    with _tp2_server() as srv:
        host = srv.state.worker.host
        assert isinstance(host, ProcessHost) and host.pid != os.getpid()
        (follower,) = _children(host.pid)
        got: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: got.update(
            {i: _tokens(srv.url, PROMPTS[i])})) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got.get(i) for i in range(len(PROMPTS))] == oracle
        time.sleep(TIMEOUT_S + 3)  # only rank 0's pings reach rank 1 meanwhile
        assert srv.health() == 200
        assert _tokens(srv.url, PROMPTS[1]) == oracle[1]
    assert host.process.exitcode == 0  # (shutdown and an orderly group close)
    deadline = time.monotonic() + 15
    while not _gone(follower):
        assert time.monotonic() < deadline, "rank 1 outlived the engine process"
        time.sleep(0.1)


def test_a_killed_follower_fails_requests_explicitly():
    """SIGKILL rank 1: a request then fails with an error naming why (500, or 503 once the
    engine has ended), never hangs, and /health turns 503 with the reason."""
    with _tp2_server() as srv:
        host = srv.state.worker.host
        (follower,) = _children(host.pid)
        os.kill(follower, signal.SIGKILL)
        r = _complete(srv.url, PROMPTS[0])
        assert r.status_code in (500, 503), r.text
        assert r.json()["error"]["message"]
        deadline = time.monotonic() + 30  # the next idle ping finds the group gone
        while srv.health() != 503:
            assert time.monotonic() < deadline, "health still 200 with rank 1 dead"
            time.sleep(0.1)
        health = httpx.get(srv.url + "/health", timeout=10).json()
        assert "tensor parallelism" in health["reason"], health
    host.process.join(15)
    assert host.process.exitcode is not None


def test_a_killed_engine_process_takes_its_follower_along():
    """SIGKILL the engine process (rank 0): its pipe to rank 1 closes, and rank 1 exits at
    once (no wait for the group's timeout); the server says the engine died."""
    with _tp2_server() as srv:
        host = srv.state.worker.host
        (follower,) = _children(host.pid)
        os.kill(host.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _gone(follower):
            assert time.monotonic() < deadline, "rank 1 outlived the engine process"
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while srv.health() != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_engine_thread_with_tp_is_refused():
    """``serve --engine-thread --tp 2`` (no torchrun): a ConfigError naming both, before
    anything is built."""
    args = build_parser().parse_args(["serve", "--engine-thread", "--tp", "2", "--port", "0"])
    cfg = serve_config(args)
    assert cfg.parallel.tp == 2
    with pytest.raises(ConfigError, match=r"--engine-thread .* cannot serve --tp 2"):
        make_server(cfg, ServeSettings(port=0, engine="thread"))


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:  # not listening yet
        return 0


@pytest.mark.parametrize("signalled", ["rank 0", "launcher"])
def test_serve_under_torchrun(tmp_path, oracle, signalled):
    """torchrun with 2 processes, ``serve --tp 2``: rank 0 serves the oracle's tokens.
    SIGTERM to rank 0 drains it, shuts rank 1 down, and torchrun exits 0. SIGTERM to the
    launcher reaches both ranks (rank 1 ignores it and follows rank 0's shutdown); torchrun
    itself then exits 1, as it does on any signal, but no rank is left and none had to be
    killed."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(SECTIONS))  # JSON is YAML
    port = free_port()
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                                 "--nproc-per-node", "2", "-m", "nextn_graph", "serve",
                                 "--tp", "2", "--port", str(port), "--config", str(cfg),
                                 "--log-level", "warning"],
                                cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while _health(url) != 200:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert _tokens(url, PROMPTS[2]) == oracle[2]
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        lead = [p for p in ranks
                if b"RANK=0" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")]
        assert len(lead) == 1
        assert _listening(ranks, port) == lead  # rank 1 never binds the HTTP port
        os.kill(lead[0] if signalled == "rank 0" else proc.pid, signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == (0 if signalled == "rank 0" else 1), text
    assert "forcefully exiting" not in text, text  # (torchrun's SIGKILL after its timeout)
    assert all(_gone(p) for p in ranks), text
