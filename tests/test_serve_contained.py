"""`qcfuse serve --replicas N` stays contained (issue 55): with the default host every socket
the Ray cluster opens listens on the loopback interface, and SIGTERM stops the server, the
replicas and every process Ray started within the shutdown timeout, with one line saying so.

The command runs as a user runs it (a subprocess, the embedded model, two replicas); its
processes are read with psutil while it serves. Slow: it starts Ray.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

psutil = pytest.importorskip("psutil", reason="psutil reads the processes' sockets; requirements.lock pins it")
pytest.importorskip("ray", reason="the Ray tests need the `ray` extra (ray[serve]); requirements.lock pins it")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SHUTDOWN_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def _listening(procs) -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every listening TCP socket of `procs`."""
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.Error:
            continue
        out += [(p.pid, name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def test_replicas_listen_on_loopback_and_sigterm_leaves_nothing(tmp_path):
    port = _free_port()
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the command sets what it needs
    cmd = [sys.executable, "-m", "qcfuse_core.cli", "serve", "--store", str(tmp_path / "store"), "--replicas", "2",
           "--port", str(port), "--cpus-per-replica", "0.5", "--shutdown-timeout-s", str(SHUTDOWN_S)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    server = psutil.Process(proc.pid)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:  # the replicas load the embedded model: a minute or two on 2 cores
            assert proc.poll() is None, proc.communicate(timeout=10)
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        res = httpx.post(url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 2}, timeout=120)
        assert res.status_code == 200, res.text

        # 1. every listening socket of every process of the run is on the loopback interface
        procs = [server, *server.children(recursive=True)]
        names = " ".join(p.name() for p in procs if p.is_running())
        assert "raylet" in names and "gcs_server" in names, names
        sockets = _listening(procs)
        assert any(p == port for *_, p in sockets)  # the HTTP proxy
        assert len(sockets) >= 8, sockets  # the GCS, the raylet, the agents, the workers, the replicas
        wide = [s for s in sockets if not _loopback(s[2])]
        assert not wide, f"sockets on other interfaces: {wide}"

        # 2. SIGTERM: everything stops within the timeout, one line says so, nothing is left
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(SHUTDOWN_S + 30)
        took = time.monotonic() - t0
        stdout, stderr = proc.communicate(timeout=10)
        assert rc == 0, stderr
        assert took < SHUTDOWN_S + 15, took
        last = stdout.strip().splitlines()[-1]
        assert last.startswith("qcfuse serve: stopped 2 replicas and ") and "still running" not in last, last
        assert "Traceback" not in stderr, stderr
        psutil.wait_procs(procs[1:], timeout=5)
        left = [p for p in procs[1:] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, [(p.pid, p.name()) for p in left]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
