"""What a replica can ever run: one length check for the engine, the replica and the ingress.

The engine owns the numbers (its model's context, its KV cache, its token budget) and
publishes them as :class:`RequestLimits`; the ingress gets the same object from a replica,
so a request is measured against the same rule everywhere. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


class RequestRejectedError(ValueError):
    """A request can never run here: too long for the context or for the whole KV cache.

    ``num_tokens`` is what the request needs (prompt plus max_tokens) and ``limit`` the
    most it may use, both in tokens.
    """

    def __init__(self, message: str, num_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.num_tokens = num_tokens
        self.limit = limit


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """A replica's limits, in tokens.

    ``max_num_batched_tokens`` matters only without chunked prefill, where a prompt (and,
    after a preemption, its recompute) must fit one step whole.
    """

    max_model_len: int
    kv_capacity_tokens: int
    max_num_batched_tokens: int
    chunked_prefill: bool = True

    def check(self, prompt_len: int, max_tokens: int | None) -> int:
        """Return the effective max_tokens (None: up to the context or KV capacity; 0: a
        prompt that generates nothing, an embedding request's).

        Raises:
            RequestRejectedError: prompt plus max_tokens exceeds the context, the KV cache,
                or (without chunked prefill) one step's token budget.
        """
        limit = min(self.max_model_len, self.kv_capacity_tokens)
        if max_tokens is None:
            max_tokens = limit - prompt_len
            if max_tokens < 1:
                raise RequestRejectedError(
                    f"prompt has {prompt_len} tokens; the limit is {limit - 1} "
                    f"(max_model_len {self.max_model_len}, "
                    f"KV cache {self.kv_capacity_tokens} tokens)",
                    prompt_len + 1,
                    limit,
                )
        need = prompt_len + max_tokens
        asked = f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) = {need} tokens"
        if max_tokens == 0:  # an embedding: its prompt alone
            asked = f"prompt of {prompt_len} tokens"
        if need > self.max_model_len:
            raise RequestRejectedError(
                f"{asked} exceeds the model's context of {self.max_model_len} tokens",
                need,
                self.max_model_len,
            )
        if not self.chunked_prefill and need > self.max_num_batched_tokens:
            raise RequestRejectedError(
                f"{asked} exceeds max_num_batched_tokens ({self.max_num_batched_tokens}) "
                "with chunked prefill disabled",
                need,
                self.max_num_batched_tokens,
            )
        if need > self.kv_capacity_tokens:
            raise RequestRejectedError(
                f"{asked} exceeds the KV cache capacity of {self.kv_capacity_tokens} tokens",
                need,
                self.kv_capacity_tokens,
            )
        return max_tokens

    def fits(self, prompt_len: int, max_tokens: int | None) -> bool:
        """Whether :meth:`check` passes."""
        try:
            self.check(prompt_len, max_tokens)
        except RequestRejectedError:
            return False
        return True
