"""The KV budget (cache/budget.py `KVBudget`): reservations, the idle KV pool and the device
chunk tier's size, on a CPU with a tiny model and a fake tier (a store that records the room
it is given and can refuse it, as pinned entries would). The pool is switched on here
(`pool=1`); an engine keeps one on CUDA only. The tier through the store's protocol
(`ChunkStore.device_tier` / `fit_device_tier`) is checked on a real tiered store at the end."""

from __future__ import annotations

import random

import pytest
import torch

from qcfuse_core import KVBudgetError
from qcfuse_core.cache.budget import KVBudget, Reservation
from qcfuse_core.model.fusion import KVCache
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.store import MemoryStore, open_store


class FakeTierStore(MemoryStore):
    """A store whose device chunk tier is a log of the room it was sized to; `refuse`: entries
    being read hold more than any room asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.rooms: list[int] = []
        self.refuse = False

    def fit_device_tier(self, device: torch.device, room: int) -> bool:
        if self.refuse:
            return False
        self.rooms.append(room)
        return True


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def per_token(model) -> int:
    sh = model.shape
    return 2 * sh.num_layers * sh.num_kv_heads * sh.head_dim * model.dtype.itemsize  # fp32 here


def budget_of(model, tokens: int | None, pool: int = 1, store=None) -> KVBudget:
    total = None if tokens is None else tokens * per_token(model)
    return KVBudget(model, store if store is not None else FakeTierStore(), kv_cache_bytes=total, pool=pool)


def nbytes(cache: KVCache) -> int:
    return cache.k.nbytes + cache.v.nbytes


def test_the_bytes_per_token_live_on_the_models_shape(model):
    sh = model.shape
    assert sh.kv_bytes(1, torch.float32) == per_token(model)
    assert sh.kv_bytes(7, torch.bfloat16) == 7 * per_token(model) // 2
    assert nbytes(KVCache(model, 7)) == sh.kv_bytes(7, model.dtype)


def test_a_request_waits_while_the_budget_is_full_and_is_admitted_once_room_is_released(model):
    budget = budget_of(model, 250)
    a, b = budget.reserve(100), budget.reserve(100)
    assert isinstance(a, Reservation) and isinstance(b, Reservation)
    assert a.nbytes == b.nbytes == 100 * per_token(model) and budget.reserved_bytes() == 200 * per_token(model)
    assert budget.reserve(100) is None  # 300 > 250: it waits
    assert budget.reserve(50) is not None  # what fits beside them is admitted
    budget.release(a)
    assert budget.reserve(100) is not None


def test_a_cache_larger_than_the_whole_budget_fails_at_once(model):
    budget = budget_of(model, 250)
    with pytest.raises(KVBudgetError, match=r"KV cache \(251 tokens, [\d.]+ \w+\) exceeds the engine's KV budget"):
        budget.reserve(251)
    assert budget.reserve(250) is not None  # the whole budget is fine
    with pytest.raises(ValueError, match="positive token count"):
        budget.reserve(0)
    with pytest.raises(ValueError, match="pool must be >= 0"):
        KVBudget(model, MemoryStore(), pool=-1)


def test_no_budget_on_a_cpu_without_kv_cache_bytes(model):
    budget = budget_of(model, None)
    rs = [budget.reserve(10_000) for _ in range(5)]
    assert all(r is not None for r in rs) and budget.reserved_bytes() == 5 * 10_000 * per_token(model)


def test_kv_is_the_requests_one_buffer_until_its_release(model):
    budget = budget_of(model, 1000)
    r = budget.reserve(40)
    cache = r.kv()
    assert cache.capacity == 40 and nbytes(cache) == r.nbytes and cache.length == 0
    cache.length = 12  # a prefill wrote into it
    assert r.kv() is cache  # a rung or a rerun prefills into the same buffer
    budget.release(r)
    with pytest.raises(RuntimeError, match="released"):
        r.kv()


def test_the_pool_never_hands_out_more_than_the_reservation_holds(model):
    budget = budget_of(model, 300)
    first = budget.reserve(100)
    big = first.kv()
    big.length = 77
    budget.release(first)
    assert budget.pooled_bytes() == nbytes(big)
    r = budget.reserve(60)  # the 100-row buffer fits 60 rows (up to twice as many): reused, counted whole
    assert r.kv() is big and big.length == 0 and r.nbytes == nbytes(big) == 100 * per_token(model)
    assert budget.pooled_bytes() == 0 and budget.reserved_bytes() == nbytes(big)
    budget.release(r)
    small = budget.reserve(40)  # 100 rows is more than twice 40: a buffer of its own
    assert small.kv() is not big and small.kv().capacity == 40 and small.nbytes == 40 * per_token(model)
    held = budget.reserve(180)  # 40 + 180 held, the idle 100 beside them: 320 > 300
    assert held is not None and budget.pooled_bytes() == 0  # the idle buffer gave way
    assert budget.reserved_bytes() == 220 * per_token(model)


def test_over_random_traffic_no_buffer_exceeds_its_reservation_nor_the_budget(model):
    rng = random.Random(0)
    total = 1000 * per_token(model)
    budget = budget_of(model, 1000, pool=2)
    live: list[Reservation] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            budget.release(live.pop(rng.randrange(len(live))))
            continue
        r = budget.reserve(rng.randint(1, 400))
        if r is not None:
            live.append(r)
            assert nbytes(r.kv()) == r.nbytes and r.kv().capacity >= r.tokens
        assert budget.reserved_bytes() == sum(x.nbytes for x in live) <= total
        assert budget.reserved_bytes() + budget.pooled_bytes() <= total
    for r in live:
        budget.release(r)
    assert budget.reserved_bytes() == 0


def test_release_gives_the_room_back_to_the_device_tier_once(model):
    store = FakeTierStore()
    budget = budget_of(model, 1000, store=store)
    p = per_token(model)
    r = budget.reserve(300)
    assert store.rooms == [1000 * p, 700 * p]  # sized with all of it, then what the request leaves
    r.kv()
    budget.release(r)
    assert store.rooms[-1] == 700 * p  # its buffer is idle in the pool: still not the tier's
    budget.drop_pool()
    assert budget.pooled_bytes() == 0
    r = budget.reserve(100)
    assert store.rooms[-1] == 900 * p  # the pool dropped: the tier has all the request leaves
    r.kv()
    budget.release(r)
    n = len(store.rooms)
    budget.release(r)  # idempotent: nothing changes
    budget.release(None)
    assert len(store.rooms) == n and budget.reserved_bytes() == 0 and budget.pooled_bytes() == 100 * p


def test_without_a_pool_release_gives_every_byte_back_to_the_tier(model):
    store = FakeTierStore()
    budget = budget_of(model, 1000, pool=0, store=store)
    r = budget.reserve(300)
    r.kv()
    budget.release(r)
    assert store.rooms[-1] == 1000 * per_token(model) and budget.pooled_bytes() == 0


def test_a_request_waits_while_entries_being_read_hold_the_room(model):
    store = FakeTierStore()
    budget = budget_of(model, 1000, store=store)
    first = budget.reserve(100)
    first.kv()
    budget.release(first)
    store.refuse = True  # pinned chunk entries: the tier cannot shrink now
    assert budget.reserve(100) is None
    assert budget.reserved_bytes() == 0 and budget.pooled_bytes() == 100 * per_token(model)  # the buffer is kept
    store.refuse = False
    assert budget.reserve(100) is not None


def test_the_store_protocol_reaches_the_device_tier(tmp_path):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    plain = MemoryStore()
    assert plain.device_tier(cpu) is None and plain.fit_device_tier(cpu, 123)
    assert plain.note_use(None) == 0 and plain.admits(None)  # type: ignore[arg-type]
    with open_store(tmp_path, memory_bytes=1 << 20, gpu_bytes=1 << 16, use_cuda=False, chunk_device="cpu") as st:
        assert st.device_tier(cpu) is st.gpu and st.device_tier(cuda) is None
        assert st.fit_device_tier(cpu, 1 << 20) and st.gpu.capacity_bytes == 1 << 16  # at most its cap
        assert st.fit_device_tier(cpu, 100) and st.gpu.capacity_bytes == 100
        assert st.fit_device_tier(cpu, -5) and st.gpu.capacity_bytes == 0
