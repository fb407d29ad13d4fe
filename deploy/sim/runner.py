"""A model runner that runs no model: each step advances a virtual clock by a cost model.

With it, :class:`engine.LLMEngine` runs its real scheduler, block manager, policies and
TPOT guard in virtual time (``tests/test_engine_seams.py`` shows the seam). Requests may
name LoRA adapters: :class:`SimLoRAs` stands in for the runner's adapter manager, without
files.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.interfaces import SampleResult
from engine.core.params import LoRARequest
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


@dataclass(frozen=True, slots=True)
class SimAdapter:
    """A simulated adapter: its name, the path it was named with, and its identity."""

    name: str
    path: str
    key: bytes
    """What the prefix cache salts the adapter's block hashes with, as
    ``engine.lora.LoRAAdapter.key``: one prompt under two adapters has two KV."""


class SimLoRAs:
    """The runner's adapters without files, in the place of :class:`engine.lora.LoRAManager`
    (the engine reads ``runner.lora``: :meth:`get` when it checks a request,
    :meth:`loaded` and :attr:`mean_load_s` for its load snapshot, :meth:`remove`).

    As the manager, it keeps the ``max_cpu_loras`` adapters used last (None:
    ``max_loras``; at least ``max_loras``), the least recently used evicted, and each step
    uses those of its sequences (:meth:`prepare`). A read takes no time here, so
    :attr:`mean_load_s` is 0.

    Raises:
        ValueError: a size below 1.
    """

    mean_load_s = 0.0
    """Seconds a read of an adapter took: none are read."""

    def __init__(self, max_loras: int = 4, max_cpu_loras: int | None = None) -> None:
        if max_loras < 1 or (max_cpu_loras is not None and max_cpu_loras < 1):
            raise ValueError("max_loras and max_cpu_loras must be >= 1")
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self._held: OrderedDict[str, SimAdapter] = OrderedDict()
        self.num_loads = 0
        """Adapters taken in so far: first uses, and uses again after eviction."""

    def get(self, lora: LoRARequest) -> SimAdapter:
        """The adapter ``lora`` names, kept as the most recently used."""
        adapter = self._held.get(lora.name)
        if adapter is None or adapter.path != str(lora.path):
            digest = hashlib.sha256(f"{lora.name}\0{lora.path}".encode()).digest()
            adapter = SimAdapter(lora.name, str(lora.path), digest)
            self._held[lora.name] = adapter
            self.num_loads += 1
        self._held.move_to_end(lora.name)
        while len(self._held) > self.max_cpu_loras:
            self._held.popitem(last=False)
        return adapter

    def prepare(self, loras: Iterable[LoRARequest | None]) -> None:
        """A step uses ``loras`` (None: the base model).

        Raises:
            RuntimeError: more distinct adapters than ``max_loras`` (the scheduler admits
                no more).
        """
        names = {lo.name: lo for lo in loras if lo is not None}
        if len(names) > self.max_loras:
            raise RuntimeError(f"{len(names)} adapters in one step; max_loras {self.max_loras}")
        for lo in names.values():
            self.get(lo)

    def remove(self, name: str) -> bool:
        """Forget adapter ``name``; True if kept."""
        return self._held.pop(name, None) is not None

    def loaded(self) -> list[str]:
        """The adapters kept, least recently used first."""
        return list(self._held)


class SimTokenizer:
    """Decodes every token to nothing: simulated requests have no text."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


class SimRunner:
    """:class:`engine.core.interfaces.ModelRunner` over a cost model (``num_kv_blocks``,
    ``max_model_len`` and ``vocab_size`` come from it).

    ``steps`` counts executed steps; ``busy_s`` sums their seconds. ``lora`` holds the
    adapters its requests name (default: :class:`SimLoRAs` of the engine config's defaults).
    """

    eos_token_ids = frozenset()

    def __init__(self, cost, clock: SimClock, lora: SimLoRAs | None = None) -> None:
        self.cost: CostModel = cost
        self.clock = clock
        self.lora = lora or SimLoRAs()
        self.num_kv_blocks = cost.num_kv_blocks
        self.max_model_len = cost.max_model_len
        self.vocab_size = cost.vocab_size
        self.steps = 0
        self.busy_s = 0.0

    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        shape = StepShape.of(out)
        if shape.adapters:
            self.lora.prepare(s.request.lora for s in out.seqs)
        seconds = self.cost.step_seconds(shape)
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
    runner = SimRunner(cost, clock, SimLoRAs(config.max_loras, config.max_cpu_loras))
    if config.num_kv_blocks is not None:
        runner.num_kv_blocks = config.num_kv_blocks
    if config.max_model_len is not None:
        runner.max_model_len = min(runner.max_model_len, config.max_model_len)
    return LLMEngine(config, runner=runner, tokenizer=SimTokenizer(), clock=clock)
