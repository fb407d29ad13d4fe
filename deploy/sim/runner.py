"""A model runner that runs no model: each step advances a virtual clock by a cost model.

With it, :class:`engine.LLMEngine` runs its real scheduler, block manager, policies and
TPOT guard in virtual time (``tests/test_engine_seams.py`` shows the seam).
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.interfaces import SampleResult
from engine.core.schedule_output import SchedulerOutput
from engine.core.step_cost import CostModel, StepShape
from engine.llm_engine import LLMEngine

SIM_TOKEN_ID = 1
"""The token every simulated step samples (requests are ``ignore_eos``: its id is moot)."""


class SimClock:
    """Virtual seconds; the runner advances it, the simulator sets it between steps."""

    __slots__ = ("t", "_after_read")

    def __init__(self, t: float = 0.0) -> None:
        self.t = t
        self._after_read = 0.0

    def __call__(self) -> float:
        t = self.t
        if self._after_read:
            self.t += self._after_read
            self._after_read = 0.0
        return t

    def advance_after_next_read(self, seconds: float) -> None:
        """Move ``seconds`` on once the next reading is taken: a runner whose step goes on
        after its tokens are stamped (the engine reads the clock for the stamp, then for
        the step's end)."""
        self._after_read += seconds


class SimTokenizer:
    """Decodes every token to nothing: simulated requests have no text."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


class SimRunner:
    """:class:`engine.core.interfaces.ModelRunner` over a cost model (``num_kv_blocks``,
    ``max_model_len`` and ``vocab_size`` come from it).

    ``steps`` counts executed steps; ``busy_s`` sums their seconds.
    """

    eos_token_ids = frozenset()

    def __init__(self, cost, clock: SimClock) -> None:
        self.cost: CostModel = cost
        self.clock = clock
        self.num_kv_blocks = cost.num_kv_blocks
        self.max_model_len = cost.max_model_len
        self.vocab_size = cost.vocab_size
        self.steps = 0
        self.busy_s = 0.0

    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        seconds = self.cost.step_seconds(StepShape.of(out))
        self.clock.t += seconds
        self.steps += 1
        self.busy_s += seconds
        return self.samples(out)

    @staticmethod
    def samples(out: SchedulerOutput) -> dict[str, SampleResult]:
        """The fixed token for every sequence whose chunk reached its last token."""
        sample = SampleResult(SIM_TOKEN_ID, None)
        return {s.request.request_id: sample for s in out.seqs if s.samples}

    def take_tail(self) -> float:
        """Seconds of the last step that fall after its tokens were stamped (the
        simulator adds them once the step's outputs are out); 0 here: a cost model's
        step ends when its tokens are stamped."""
        return 0.0


def sim_engine(config: EngineConfig, cost, clock: SimClock | None = None) -> LLMEngine:
    """An engine of ``config`` whose steps cost what ``cost`` says, on ``clock``.

    ``config.num_kv_blocks`` wins over the cost model's (a smaller cache, say).
    """
    clock = clock or SimClock()
    runner = SimRunner(cost, clock)
    if config.num_kv_blocks is not None:
        runner.num_kv_blocks = config.num_kv_blocks
    if config.max_model_len is not None:
        runner.max_model_len = min(runner.max_model_len, config.max_model_len)
    return LLMEngine(config, runner=runner, tokenizer=SimTokenizer(), clock=clock)
