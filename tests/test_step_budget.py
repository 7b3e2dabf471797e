"""The step budget in time (engine/step_budget.py, issue 64 item 3): the scheduler sizes a
step's prefill rows from the measured prefill rate so that a step's prefill takes about
`SchedulerConfig.step_prefill_ms`; an explicit `step_prefill_tokens` overrides it. The rate
is given (the scheduler's measure fed a fixed ms per row, or the planner's), and the slices
are counted in scheduler steps: no wall clock. Tiny random model, fp32, CPU."""

from __future__ import annotations

import math

import pytest

from qcfuse_core.cache.planner import Rates
from qcfuse_core.engine.config import SchedulerConfig
from qcfuse_core.engine.step_budget import (
    CPU_STEP_PREFILL_MS,
    DECAY,
    FALLBACK_STEP_PREFILL_TOKENS,
    GPU_STEP_PREFILL_MS,
    MIN_STEP_PREFILL_TOKENS,
    PrefillRate,
    default_step_ms,
    step_rows,
)
from qcfuse_core.model.testing import tiny_model
from tests.qc_fixtures import docs_engine

DOCS = [f"Document {i}: " + " ".join(f"item{i}y{j}" for j in range(12)) for i in range(5)]
QUESTION = "Which document names item2y5?"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


class GivenRate(PrefillRate):
    """The scheduler's rate, fed `ms_per_row` for every row whatever the clock says."""

    def __init__(self, ms_per_row: float) -> None:
        super().__init__()
        self.given = ms_per_row

    def observe(self, ms: float, rows: int) -> None:
        super().observe(rows * self.given, rows)


def _prefill_rows_per_step(eng) -> list[int]:
    """Per scheduler step, the prefill rows it ran (0: a decode-only step)."""
    sched = eng._scheduler
    steps: list[int] = []
    real_step, real_run = sched.step, sched._run

    def step():
        steps.append(0)
        real_step()

    def run(job, rows):
        steps[-1] += rows
        return real_run(job, rows)

    sched.step, sched._run = step, run
    return steps


def _full_prompt_rows(eng) -> int:
    prompt, _, _ = eng._steps.fuse_pieces(eng.frame.rag_pieces(QUESTION, DOCS))
    return prompt.num_tokens


def _sliced(eng) -> list[int]:
    steps = _prefill_rows_per_step(eng)
    eng.answer(QUESTION, DOCS, method="full", max_new_tokens=2, ignore_eos=True)
    return [r for r in steps if r]


def test_the_time_budget_sizes_the_slices_from_the_measured_rate(tiny):
    """At 2 ms a row a 256 ms budget is 128 rows a step: a full prefill of T rows runs in
    ceil(T / 128) steps of at most 128 rows; at 4 ms a row (the machine got slower) 64 rows
    a step, twice the steps."""
    eng = docs_engine(tiny, DOCS, step_prefill_ms=256.0)
    sched = eng._scheduler
    T = _full_prompt_rows(eng)
    assert T > 3 * 128  # several slices at either rate
    sched.rate = GivenRate(2.0)
    sched.rate.observe(0.0, 100)  # as if a prefill had run
    got = _sliced(eng)
    assert sum(got) == T and max(got) <= 128 and len(got) == math.ceil(T / 128)
    slower = GivenRate(4.0)
    slower.observe(0.0, 100)
    sched.rate = slower
    got = _sliced(eng)
    assert sum(got) == T and max(got) <= 64 and len(got) == math.ceil(T / 64)
    assert sched.step_budget() == 64


def test_before_any_prefill_the_planners_rate_sizes_the_budget(tiny):
    """No prefill measured yet: the planner's `prefill_ms_per_token` gives the rows (270 ms at
    3 ms a token: 90 rows); without it, the fallback budget; the scheduler's own measure
    replaces the planner's once a prefill ran."""
    eng = docs_engine(tiny, DOCS, step_prefill_ms=270.0)
    sched = eng._scheduler
    assert sched.step_budget() == FALLBACK_STEP_PREFILL_TOKENS
    eng._steps.rates = Rates(prefill_ms_per_token=3.0, tier_gbps={"host": 1.0}, kv_bytes_per_token=64)
    assert sched.step_budget() == 90
    sched.rate = GivenRate(1.5)  # records nothing until a prefill runs
    T = _full_prompt_rows(eng)
    steps = _prefill_rows_per_step(eng)
    eng.answer(QUESTION, DOCS, method="full", max_new_tokens=2, ignore_eos=True)
    got = [r for r in steps if r]
    # sliced at the planner's rate when it was opened (slices of 90 rows); from the second step on
    # the measured rate grants 180 rows a step: two of its slices
    assert got[0] == 90 and max(got[1:]) == 180 and sum(got) == T and len(got) == 1 + math.ceil((T - 90) / 180)
    assert sched.step_budget() == 180  # now the measured 1.5 ms a row


def test_an_explicit_token_budget_overrides_the_time(tiny):
    """`step_prefill_tokens` fixes the rows whatever the rate and `step_prefill_ms`."""
    eng = docs_engine(tiny, DOCS, step_prefill_ms=256.0, step_prefill_tokens=40)
    sched = eng._scheduler
    sched.rate = GivenRate(2.0)
    sched.rate.observe(0.0, 100)
    T = _full_prompt_rows(eng)
    got = _sliced(eng)
    assert max(got) <= 40 and len(got) == math.ceil(T / 40)
    assert sched.step_budget() == 40


def test_the_measured_cost_and_the_rows():
    """The cost: a straight line through (rows, ms) of the prefills seen - a pass's fixed
    cost apart from its rows', so short prompts do not make long ones slice finely - or ms
    over rows where the sizes do not tell them apart; the rows: what the budget holds at that
    cost, at least MIN_STEP_PREFILL_TOKENS; the device defaults differ."""
    rate = PrefillRate()
    assert rate.cost() is None and rate.cost(2.0) == (0.0, 2.0)
    rate.observe(150.0, 100)  # 50 ms a pass + 1 ms a row
    assert rate.cost() == (0.0, 1.5)  # one size: through the origin
    rate.observe(1050.0, 1000)
    rate.observe(5.0, 0)  # no rows: nothing learned
    fixed, per_row = rate.cost()
    assert fixed == pytest.approx(50.0) and per_row == pytest.approx(1.0)
    assert step_rows(None, 550.0, rate.cost()) == 500
    assert step_rows(None, 500.0, (0.0, 2.0)) == 250
    assert step_rows(None, 1.0, (0.0, 2.0)) == MIN_STEP_PREFILL_TOKENS
    assert step_rows(None, 40.0, (50.0, 1.0)) == MIN_STEP_PREFILL_TOKENS  # a pass costs more than the budget
    assert step_rows(None, 500.0, None) == FALLBACK_STEP_PREFILL_TOKENS
    assert step_rows(17, 500.0, (0.0, 2.0)) == 17
    assert step_rows(None, None, (0.0, 2.0)) == FALLBACK_STEP_PREFILL_TOKENS  # no time budget (the GPU's default)
    assert default_step_ms("cpu") == CPU_STEP_PREFILL_MS and default_step_ms("cuda") == GPU_STEP_PREFILL_MS
    superlinear = PrefillRate()  # a negative pass cost (attention's growth): through the origin
    superlinear.observe(10.0, 100)
    superlinear.observe(400.0, 1000)
    assert superlinear.cost() == (0.0, pytest.approx((10.0 * DECAY + 400.0) / (100 * DECAY + 1000)))


@pytest.mark.parametrize("ms", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_a_bad_step_prefill_ms_is_refused(ms):
    with pytest.raises(ValueError, match="step_prefill_ms"):
        SchedulerConfig(step_prefill_ms=ms)


def test_deterministic_mode_never_times_the_budget(tiny):
    """A prefill's slices set its bits: in deterministic mode the rows are fixed (8192, or
    `step_prefill_tokens`) whatever the measured rate, and nothing is measured."""
    eng = docs_engine(tiny, DOCS, deterministic=True, step_prefill_ms=256.0)
    sched = eng._scheduler
    sched.rate = GivenRate(2.0)
    sched.rate.observe(0.0, 100)
    assert sched.step_budget() == FALLBACK_STEP_PREFILL_TOKENS
    eng.answer(QUESTION, DOCS, method="full", max_new_tokens=2, ignore_eos=True)
    assert sched.rate.cost() == (0.0, 2.0)  # the one observation made above, nothing more
    assert sched.stats().prefill_slices == 0
