"""CPU thread settings that hold on a loaded machine: how many intra-op threads torch uses.

Why. torch's CPU build runs its kernels on GNU OpenMP teams, one thread per core by default.
A team is only as fast as its slowest thread: each parallel region ends at a barrier, and
when other work holds one of the cores the team waits for a scheduler time slice, hundreds
of times per forward. Worse, libgomp *spins* at those barriers (300k iterations, a few ms)
while it manages no more threads than there are CPUs - a main thread's team - and the
spinning thread takes the core its partner needs. Measured on a 2-core VM (SmolLM2-135M
bf16, 8 x 256-token chunks + question = 2124 tokens, TTFT medians of 5-12 interleaved runs;
"loaded": 3 busy processes + other work, load average 4-5.5):

                       full prefill   qcfuse@0.15             cacheblend@0.15
    idle,   2 threads  1.32 s         0.59 s                  0.52 s
    idle,   1 thread   1.98 s         0.89 s
    1 busy, 2 threads  3.00 s         1.45 s
    1 busy, 1 thread   1.59 s         0.65 s
    loaded, 2 threads  9.3-10.9 s     4.5-6.2 s, runs to 36 s  4.0-10.2 s
    loaded, 1 thread   3.2-5.0 s      1.6-2.1 s               1.4-1.6 s
    loaded, from a worker thread: full prefill 3.2-4.7 s with 2 threads, 3.4-4.9 s with 1

(At load ~7, 2 threads: qcfuse 18.0 s against full prefill's 17.2 s; 1 thread: 3.5 s.)

The main thread's team does not sleep (8-40 voluntary context switches per forward, CPU
time ~ wall time; a worker thread's team: ~2400). OMP_WAIT_POLICY=PASSIVE set before
start-up makes it sleep and halves the loaded full prefill (10.4 -> 4.8 s), still slower
than 1 thread. A second team (a worker thread's, or the prefetch loader's copies) makes
libgomp manage more threads than CPUs and throttle its spinning - which is why a worker
thread, and a request with the loader running, fared differently. The spin policy is read
once, when torch loads libgomp, so a library cannot change it; the thread count it can
set, per request. The loader's own count made no consistent difference (idle: -12% to +10%
with 1 thread; under the policy it inherits 1 anyway), nor does torch's inter-op pool (the
engine never starts it).

Policy (`configure_cpu_threads`, on CPU devices only; ~0.1 ms, so call it per request):

    1. an explicit count wins: the `threads` argument, then QCFUSE_THREADS=N (N >= 1)
    2. OMP_NUM_THREADS / MKL_NUM_THREADS set, or torch.set_num_threads called by the user
       (a count that is neither torch's default nor one set here): left exactly as it is,
       unless QCFUSE_THREADS=auto
    3. otherwise: torch's default, capped at the CPUs other work leaves idle, at least 1

    usable CPUs  sched_getaffinity, capped by a cgroup v2 cpu.max quota (containers)
    busy CPUs    CPU time the usable CPUs spent on other work since the previous call (or
                 over 50 ms at the first): /proc/stat busy time minus this process's CPU
                 time, per second. The load average would lag a minute and count our own
                 earlier work (model loading); this is at most one request late
    threads      max(1, min(default, physical cores, round(usable - busy)))

One busy process on two cores already halves the speed of two threads, hence the rounding.

torch.set_num_threads is per thread and process-wide at once (tested, torch 2.13): it sets
the calling thread's OpenMP count and the count that threads which have not run a parallel
op yet start with; threads that already have keep theirs. So call `configure_cpu_threads`
in the thread that runs the request; a helper thread started after it (the per-request
prefetch loader) inherits the count; one that lives longer uses `helper_threads(count)`.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ENV = "QCFUSE_THREADS"
USER_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch applies these itself at start-up
MIN_WINDOW_S = 0.05  # shortest window over which other work's CPU use is measured


@dataclass(frozen=True)
class CpuInfo:
    """What the policy looks at: usable CPUs, their physical cores, CPUs busy with other work."""

    cpus: int
    cores: int
    busy: float


def choose_threads(default: int, info: CpuInfo) -> int:
    """torch's default count capped at the physical cores and the idle CPUs; at least 1."""
    idle = int(info.cpus - info.busy + 0.5)
    return max(1, min(default, info.cores, idle))


def busy_cpus(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """CPUs kept busy by other work between two `_sample`s (wall s, busy CPU-s, our CPU-s)."""
    wall = after[0] - before[0]
    if wall <= 0:
        return 0.0
    return max(0.0, (after[1] - before[1] - (after[2] - before[2])) / wall)


def cpu_info() -> CpuInfo:
    """The machine now; `busy` is measured since the previous call (the first waits 50 ms)."""
    global _base, _busy
    cpus, cores, allowed = _cpus_cores()
    now = _sample(allowed)
    if now is None:  # no /proc/stat (macOS, Windows): the load average, which counts us too
        return CpuInfo(cpus, cores, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
    if _base is None:
        _base = now
        time.sleep(MIN_WINDOW_S)
        now = _sample(allowed)
        assert now is not None  # /proc/stat was readable 50 ms ago
    if now[0] - _base[0] >= MIN_WINDOW_S:  # else keep the last estimate and let the window grow
        _busy, _base = busy_cpus(_base, now), now
    return CpuInfo(cpus, cores, round(_busy, 2))


_lock = threading.Lock()
_default: int | None = None  # torch's count at the first call
_user_first = False  # ... which the user had already chosen (not one of torch's defaults)
_ours: set[int] = set()  # counts this module has set
_base: tuple[float, float, float] | None = None  # the previous `_sample`
_busy = 0.0


def configure_cpu_threads(
    device: torch.device | str,
    *,
    threads: int | None = None,
    env: Mapping[str, str] | None = None,
    info: CpuInfo | None = None,
) -> dict:
    """Set the calling thread's torch intra-op threads by the policy above -> what it chose:

    {"threads", "source": "argument" | ENV | "OMP_NUM_THREADS" | "MKL_NUM_THREADS" | "user" |
    "auto" | "device", "default": torch's count at the first call, and with "auto" the
    CpuInfo fields}. Idempotent; set_num_threads runs only when the count changes (~0.1 ms
    a call, the first 50 ms). Non-CPU devices: nothing changes. `info` replaces the machine."""
    global _default, _user_first
    env = os.environ if env is None else env
    current = torch.get_num_threads()
    with _lock:
        if _default is None:
            _default = current
            _user_first = current not in _torch_defaults()
        out: dict = {"threads": current, "default": _default}
        if torch.device(device).type != "cpu":
            return {**out, "source": "device"}
        wanted, source = threads, "argument"
        setting = env.get(ENV, "").strip().lower()
        if wanted is None and setting not in ("", "auto"):
            wanted, source = _count(setting), ENV
        if wanted is None and setting != "auto":  # QCFUSE_THREADS=auto overrides the user's setting
            for name in USER_ENV:
                if env.get(name, "").strip():
                    return {**out, "source": name}
            if current not in _ours and (current != _default or _user_first):
                return {**out, "source": "user"}
        if wanted is None:
            info = info or cpu_info()
            wanted, source = choose_threads(_default, info), "auto"
            out.update(asdict(info))
        if wanted < 1:
            raise ValueError(f"thread count must be >= 1, got {wanted}")
        if wanted != current:
            torch.set_num_threads(wanted)
        _ours.add(wanted)
        return {**out, "threads": wanted, "source": source}


@contextmanager
def helper_threads(n: int) -> Iterator[None]:
    """Inside a helper thread (a long-lived prefetch loader): run its torch ops on `n`
    intra-op threads - the request's count, `configure_cpu_threads(...)["threads"]` - and
    restore on exit the count that new threads start with (set_num_threads changes that
    too: a thread started elsewhere meanwhile starts with `n`). Other threads keep theirs."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def _reset() -> None:
    """Forget every earlier call (tests)."""
    global _default, _user_first, _base, _busy
    with _lock:
        _default, _user_first, _base, _busy = None, False, None, 0.0
        _ours.clear()


def _cpus_cores() -> tuple[int, int, list[int]]:
    """(usable CPUs: affinity capped by a cgroup v2 quota, physical cores among them, affinity)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        allowed = list(range(os.cpu_count() or 1))
    quota = _cgroup_cpus(_read("/sys/fs/cgroup/cpu.max"))
    cpus = min(len(allowed), quota) if quota else len(allowed)
    siblings = {_read(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") or str(c) for c in allowed}
    return cpus, max(1, min(cpus, len(siblings))), allowed


def _torch_defaults() -> set[int]:
    """Counts torch picks by itself: one per usable CPU or per physical core."""
    cpus, cores, allowed = _cpus_cores()
    return {cpus, cores, len(allowed), os.cpu_count() or 1}


def _sample(allowed: list[int]) -> tuple[float, float, float] | None:
    """(monotonic s, busy CPU-s of the `allowed` CPUs from /proc/stat, this process's CPU-s)."""
    text = _read("/proc/stat")
    if text is None:
        return None
    return time.monotonic(), _stat_busy(text, allowed) / os.sysconf("SC_CLK_TCK"), time.process_time()


def _stat_busy(text: str, allowed: list[int]) -> int:
    """Busy ticks of CPUs `allowed` in /proc/stat: user nice system irq softirq steal (not
    idle, iowait; guest time is already inside user)."""
    want, ticks = {f"cpu{c}" for c in allowed}, 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in want:
            f = [int(x) for x in rest.split()]
            ticks += f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)
    return ticks


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV} must be an integer >= 1 or 'auto', got {text!r}")
    return n


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _cgroup_cpus(text: str | None) -> int | None:
    """cgroup v2 cpu.max "QUOTA PERIOD" -> CPUs (rounded up); None when unlimited or absent."""
    if not text or text.split()[0] == "max":
        return None
    quota, period = (int(x) for x in text.split()[:2])
    return max(1, math.ceil(quota / period))
