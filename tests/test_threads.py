"""CPU thread policy: explicit settings win, the auto count follows idle CPUs, the counts are
set per thread (and for threads not started yet), and other work's CPU use is measured."""

import subprocess
import sys
import threading
import time

import pytest
import torch

from qcfuse_core.engine import threads as T
from qcfuse_core.engine.threads import CpuInfo, busy_cpus, choose_threads, configure_cpu_threads, helper_threads

IDLE2 = CpuInfo(cpus=2, cores=2, busy=0.0)
LOADED2 = CpuInfo(cpus=2, cores=2, busy=3.6)  # the laptop: load ~3.6 on 2 cores


@pytest.fixture(autouse=True)
def _fresh_policy():
    """Every test starts from torch's 2 threads and a policy that has never run."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    T._reset()
    yield
    T._reset()
    torch.set_num_threads(before)


def in_thread(fn):
    """fn() in a fresh thread -> its result (exceptions re-raised here)."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["err"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


# ----------------------------------------------------------------------------- the count


@pytest.mark.parametrize("default, info, expected", [
    (2, IDLE2, 2),                                # idle 2-core laptop: torch's default
    (2, CpuInfo(2, 2, 0.4), 2),                   # background noise below half a CPU
    (2, CpuInfo(2, 2, 1.0), 1),                   # one busy process already halves 2 threads
    (2, LOADED2, 1),
    (8, CpuInfo(8, 8, 3.6), 4),                   # bigger machine: what the load leaves idle
    (8, CpuInfo(8, 4, 0.0), 4),                   # hyperthreads: physical cores only
    (1, IDLE2, 1),                                # never above torch's (or the user's) default
    (4, CpuInfo(2, 2, 0.0), 2),                   # never above the usable CPUs (cgroup quota)
    (2, CpuInfo(2, 2, 50.0), 1),                  # at least 1
])
def test_choose_threads(default, info, expected):
    assert choose_threads(default, info) == expected


def test_busy_cpus_subtracts_our_own_cpu_time():
    # (wall s, busy CPU-s on the usable CPUs, our CPU-s): 1 s with 1.5 CPU-s busy, 1 of them ours
    assert busy_cpus((10.0, 100.0, 5.0), (11.0, 101.5, 6.0)) == pytest.approx(0.5)
    assert busy_cpus((10.0, 100.0, 5.0), (12.0, 102.0, 7.0)) == 0.0  # all of it ours
    assert busy_cpus((10.0, 100.0, 5.0), (10.0, 100.0, 5.0)) == 0.0  # no time passed


def test_stat_and_cgroup_parsing():
    stat = ("cpu  900 0 90 500 7 0 3 10 0 0\ncpu0 300 5 30 200 4 0 1 4 0 0\n"
            "cpu1 600 0 60 300 3 0 2 6 0 0\nintr 123\n")
    assert T._stat_busy(stat, [0]) == 300 + 5 + 30 + 0 + 1 + 4  # idle and iowait excluded
    assert T._stat_busy(stat, [0, 1]) == 340 + 668
    assert T._stat_busy(stat, [1]) == 668  # only the CPUs we may run on
    assert T._cgroup_cpus("max 100000") is None and T._cgroup_cpus(None) is None
    assert T._cgroup_cpus("200000 100000") == 2 and T._cgroup_cpus("150000 100000") == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_cpu_info_sees_a_busy_process_within_one_window():
    T.cpu_info()  # the base sample
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        info = T.cpu_info()
    finally:
        child.kill()
        child.wait()
    assert info.busy >= 0.5  # the 1-minute load average would still be near its old value
    assert 1 <= info.cores <= info.cpus


# ----------------------------------------------------------------------------- explicit settings


def test_explicit_count_wins_over_load():
    got = in_thread(lambda: (configure_cpu_threads("cpu", env={"QCFUSE_THREADS": "2"}, info=LOADED2),
                             torch.get_num_threads()))
    assert got[0]["threads"] == 2 and got[0]["source"] == "QCFUSE_THREADS" and got[1] == 2
    got = in_thread(lambda: (configure_cpu_threads("cpu", threads=1, env={"QCFUSE_THREADS": "2"}, info=IDLE2),
                             torch.get_num_threads()))
    assert got[0]["source"] == "argument" and got[1] == 1


@pytest.mark.parametrize("value", ["zero", "0", "-3", "1.5"])
def test_bad_qcfuse_threads_is_an_error(value):
    with pytest.raises(ValueError, match="QCFUSE_THREADS"):
        configure_cpu_threads("cpu", env={"QCFUSE_THREADS": value}, info=IDLE2)


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_openmp_environment_is_left_alone(name):
    r = in_thread(lambda: (configure_cpu_threads("cpu", env={name: "2"}, info=LOADED2), torch.get_num_threads()))
    assert r[0]["source"] == name and r[1] == 2  # the policy would have chosen 1
    r = in_thread(lambda: (configure_cpu_threads("cpu", env={name: "2", "QCFUSE_THREADS": "auto"}, info=LOADED2),
                           torch.get_num_threads()))
    assert r[0]["source"] == "auto" and r[1] == 1  # QCFUSE_THREADS=auto overrides it


def test_user_count_set_before_the_first_call_is_kept():
    mine = max(T._torch_defaults()) + 1  # a count torch does not pick on its own here

    def user():
        torch.set_num_threads(mine)
        return configure_cpu_threads("cpu", env={}, info=LOADED2), torch.get_num_threads()

    got, now = in_thread(user)
    assert got["source"] == "user" and now == mine


def test_user_count_set_after_an_auto_call_is_kept():
    def run():
        first = configure_cpu_threads("cpu", env={}, info=LOADED2)
        torch.set_num_threads(3)  # the user changes it later
        return first, configure_cpu_threads("cpu", env={}, info=LOADED2), torch.get_num_threads()

    first, second, now = in_thread(run)
    assert first["source"] == "auto" and first["threads"] == 1
    assert second["source"] == "user" and now == 3


def test_non_cpu_devices_change_nothing():
    got = configure_cpu_threads("cuda:0", env={"QCFUSE_THREADS": "1"}, info=LOADED2)
    assert got["source"] == "device" and torch.get_num_threads() == 2


# ----------------------------------------------------------------------------- auto


def test_auto_follows_the_load_both_ways_and_is_idempotent(monkeypatch):
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))

    def run():
        out = [configure_cpu_threads("cpu", env={}, info=info) for info in (LOADED2, LOADED2, IDLE2, IDLE2)]
        return out, torch.get_num_threads()

    out, now = in_thread(run)
    assert [o["threads"] for o in out] == [1, 1, 2, 2] and {o["source"] for o in out} == {"auto"}
    assert calls == [1, 2] and now == 2  # set only when the count changes
    assert out[0]["busy"] == 3.6 and out[0]["default"] == 2


def test_auto_sets_the_count_new_threads_start_with():
    # the per-request prefetch loader is started after the request's call: it inherits the count
    in_thread(lambda: configure_cpu_threads("cpu", env={}, info=LOADED2))
    assert in_thread(torch.get_num_threads) == 1
    assert torch.get_num_threads() == 2  # a thread that already ran keeps its own


# ----------------------------------------------------------------------------- helper threads


def test_helper_threads_changes_only_its_own_thread():
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def helper():
        with helper_threads(1):
            seen["helper"] = torch.get_num_threads()
            inside.set()
            release.wait(10)
        seen["helper_after"] = torch.get_num_threads()

    t = threading.Thread(target=helper)
    t.start()
    assert inside.wait(10)
    seen["main_during"] = torch.get_num_threads()
    release.set()
    t.join()
    assert seen == {"helper": 1, "main_during": 2, "helper_after": 2}
    assert in_thread(torch.get_num_threads) == 2  # the default for new threads is restored
    with pytest.raises(ValueError):
        with helper_threads(0):
            pass
