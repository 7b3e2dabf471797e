"""Several processes: a writer killed with SIGKILL mid-write, and concurrent writers of
overlapping keys. Afterwards every entry reads back exactly or is absent; verify finds
nothing bad."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from store_fixtures import make_chunk, store_at

from qcfuse_core.store.maintenance import verify

TESTS = Path(__file__).parent
ROOT = TESTS.parent

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")

WRITER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from store_fixtures import make_chunk, store_at
    import qcfuse_core.store.atomic as atomic
    import qcfuse_core.store.disk as disk_mod

    root, mode = Path(sys.argv[1]), sys.argv[2]
    ready = root.parent / "ready"

    def hang():
        ready.touch()
        time.sleep(120)

    s = store_at(root)
    s.put(make_chunk(0))
    if mode == "data":  # half the bytes written and synced, then killed
        def half(fd, buffers):
            mv = memoryview(buffers[0]).cast("B")
            os.write(fd, mv[: len(mv) // 2])
            os.fsync(fd)
            hang()
        atomic.write_all = half
        s.put(make_chunk(1))
    elif mode == "commit":  # file published under its final name, manifest not committed
        publish = disk_mod.publish
        def publish_and_hang(tmp, final, *sync):
            publish(tmp, final, *sync)
            hang()
        disk_mod.publish = publish_and_hang
        s.put(make_chunk(1))
    elif mode == "loop":  # keep writing big entries until killed
        for i in range(1, 200):
            s.put(make_chunk(i, T=256, L=8, Hkv=4, D=64))
            if i == 3:
                ready.touch()
        hang()
    elif mode == "overlap":  # say ready, wait for the start signal, then write our share
        start, first = root.parent / "start", int(sys.argv[3])
        (root.parent / f"ready-{first}").touch()
        while not start.exists():
            time.sleep(0.01)
        for i in list(range(first, first + 8))[:: 1 if first % 2 else -1]:
            c = make_chunk(i, T=64, L=4)
            s.put(c)
            s.link(f"node-{i}", c.key)
        s.close()
""")


def _spawn(tmp_path: Path, *args: str) -> subprocess.Popen:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "kv"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"writer exited early: {proc.stdout.read().decode()}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("writer never got ready")
        time.sleep(0.02)


def _check_all_valid(root: Path, expect=lambda key: None) -> int:
    """Every listed entry reads back exactly; returns how many."""
    with store_at(root) as s:
        n = 0
        for key in s.keys():
            got = s.get(key)
            assert got is not None, f"listed entry {key} unreadable"
            want = expect(key)
            if want is not None:
                assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
            n += 1
        assert s.stats()["corrupt"] == 0
        return n


@pytest.mark.parametrize("mode", ["data", "commit", "loop"])
def test_writer_killed_mid_write(tmp_path, mode):
    proc = _spawn(tmp_path, mode)
    _wait_for(tmp_path / "ready", proc)
    if mode == "loop":
        time.sleep(0.05 + (hash(str(tmp_path)) % 100) / 1000)  # somewhere inside a later put
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    root = tmp_path / "kv"
    chunks = {c.key: c for c in (make_chunk(0), make_chunk(1))}
    big = (make_chunk(i, T=256, L=8, Hkv=4, D=64) for i in range(1, 200))

    def expect(key):  # the writer's chunks, rebuilt lazily in its order
        while key not in chunks:
            c = next(big)
            chunks[c.key] = c
        return chunks[key]

    n = _check_all_valid(root, expect)
    with store_at(root) as s:
        assert torch.equal(s.get(make_chunk(0).key).k, make_chunk(0).k)
        if mode != "loop":
            assert n == 1 and s.get(make_chunk(1).key) is None  # the killed put left nothing valid
        else:
            assert n >= 3
        rep = verify(s.disk, remove=True, grace_s=0)
        assert rep.bad == [] and rep.ok == n
        if mode == "data":
            assert len(rep.orphans) == 1  # the tmp file
        if mode == "commit":  # the published but uncommitted file is intact: kept, and indexed by repair
            assert rep.orphans == [] and len(rep.unindexed) == 1
            assert verify(s.disk, repair=True, grace_s=0).repaired == 1
            assert torch.equal(s.get(make_chunk(1).key).k, make_chunk(1).k)
        assert verify(s.disk, grace_s=0).orphans == []
        s.put(make_chunk(1))  # the store is writable again (no stale SQLite lock)
        assert s.get(make_chunk(1).key) is not None


def test_concurrent_writers_overlapping_keys(tmp_path):
    procs = [_spawn(tmp_path, "overlap", str(first)) for first in (0, 4, 8)]  # keys 0..15, overlaps
    end = time.monotonic() + 120  # all three wait at the start line (their store open), then go together
    while not all((tmp_path / f"ready-{first}").exists() for first in (0, 4, 8)):
        assert time.monotonic() < end and all(p.poll() is None for p in procs), "a writer did not get ready"
        time.sleep(0.01)
    (tmp_path / "start").touch()
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()
    root = tmp_path / "kv"
    want = {c.key: c for c in (make_chunk(i, T=64, L=4) for i in range(16))}
    want[make_chunk(0).key] = make_chunk(0)
    assert _check_all_valid(root, want.get) == 17
    with store_at(root) as s:
        rep = verify(s.disk, grace_s=0)
        assert rep.bad == [] and rep.orphans == [] and rep.ok == 17
        assert len(list((root / "data").rglob("*.safetensors"))) == 17  # each entry stored once
        for i in range(16):
            assert s.resolve(f"node-{i}") == make_chunk(i, T=64, L=4).key
