"""The scheduler's step budget in time: how many prefill rows one step may run.

A running answer waits for every prefill row of the step before its next token, so the stall
a user feels is the step's prefill time, not its rows. With `SchedulerConfig.step_prefill_ms`
the scheduler sizes each step's rows from the measured prefill rate:

    rows = (step_prefill_ms - ms_per_pass) / ms_per_row     (at least MIN_STEP_PREFILL_TOKENS)

    ms_per_pass, ms_per_row   the scheduler's own measure of its prefills: a straight line
                 through (rows recomputed, ms) of the prefills it ran, least squares with the
                 earlier ones decayed by DECAY at each new one, so it follows the machine's
                 load; a pass over the weights costs something whatever its rows, so a rate
                 taken from short prompts alone would slice long ones too finely. Where the
                 prefills' sizes do not tell the two apart: ms over rows, through the origin.
                 Before any prefill ran: the planner's rate (`Rates.prefill_ms_per_token`,
                 `qcfuse bench ttft` measures it), else FALLBACK_STEP_PREFILL_TOKENS rows.

An explicit `step_prefill_tokens` overrides the time budget: the rows are fixed. The
defaults differ by device (`default_step_ms`): a CPU pass over the weights costs little beside
a prompt's rows, a GPU's step must stay near its decode step's few milliseconds.
"""

from __future__ import annotations

# CPU: a 2,807-token prompt beside a running answer (SmolLM2-135M, 2-core machine) is sliced
# so that answer's largest gap stays under half the prompt's prefill alone, and `bench load`
# at 4 clients keeps its throughput (docs/benchmarks.md, "A step budget in time").
CPU_STEP_PREFILL_MS = 1000.0
# GPU: no time budget by default until one is measured on the card (benchmarks/gpu.sh, step
# `crowd`, runs 50 and 100 ms beside it): a GPU keeps the fixed FALLBACK_STEP_PREFILL_TOKENS,
# the budget the H100 figures of docs/benchmarks.md were measured with.
GPU_STEP_PREFILL_MS: float | None = None
FALLBACK_STEP_PREFILL_TOKENS = 8192  # no rate measured yet (neither the planner's nor the scheduler's)
MIN_STEP_PREFILL_TOKENS = 64  # a slice never smaller: below it a pass over the weights costs more than its rows
DECAY = 0.9  # weight of the earlier prefills in the measure at each new one (about the last ten count)


def default_step_ms(device_type: str) -> float | None:
    """The step budget in ms where `SchedulerConfig.step_prefill_ms` is None."""
    return GPU_STEP_PREFILL_MS if device_type == "cuda" else CPU_STEP_PREFILL_MS


class PrefillRate:
    """The scheduler's measured prefill cost (module docstring); its worker thread's only."""

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums over (rows, ms)

    def observe(self, ms: float, rows: int) -> None:
        """A prefill recomputed `rows` rows in `ms` milliseconds."""
        if rows <= 0 or ms < 0:
            return
        d = DECAY
        self._n, self._x, self._y = self._n * d + 1, self._x * d + rows, self._y * d + ms
        self._xx, self._xy = self._xx * d + rows * rows, self._xy * d + rows * ms

    def cost(self, prior: float | None = None) -> tuple[float, float] | None:
        """(ms per pass, ms per row): a straight line through the prefills seen (least squares,
        decayed), or through the origin where their sizes do not tell the two apart; before
        any prefill, `prior` ms per row (the planner's); else None."""
        if self._n == 0:
            return (0.0, prior) if prior is not None and prior > 0 else None
        spread = self._n * self._xx - self._x * self._x
        if spread > 1e-6 * self._x * self._x:
            per_row = (self._n * self._xy - self._x * self._y) / spread
            fixed = (self._y - per_row * self._x) / self._n
            if per_row > 0 and fixed >= 0:
                return fixed, per_row
        return 0.0, self._y / self._x


def step_rows(fixed: int | None, ms: float | None, cost: tuple[float, float] | None) -> int:
    """The rows one step may run: `fixed` where given, else as many as `ms` of prefill holds
    at `cost` (ms per pass, ms per row; at least MIN_STEP_PREFILL_TOKENS; no cost known, or
    no time budget: FALLBACK_STEP_PREFILL_TOKENS)."""
    if fixed is not None:
        return fixed
    if cost is None or ms is None:
        return FALLBACK_STEP_PREFILL_TOKENS
    per_pass, per_row = cost
    return max(MIN_STEP_PREFILL_TOKENS, int((ms - per_pass) / per_row))
