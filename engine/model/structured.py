"""Structured output: JSON-schema constrained decoding through xgrammar.

xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models", MLSys 2025; vLLM's default backend) compiles a schema into a
grammar over the tokenizer's vocabulary once, then gives each sequence a matcher that
fills a bitmask of the tokens allowed next. The sampler masks only the rows of requests
that asked for a schema, so their neighbours in the batch are untouched; the engine
advances each matcher with the token it kept.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

from engine.core.params import ParamError
from engine.core.request import Request

FIELD = "response_format"
"""The API field a schema comes from, named in errors."""


GRAMMAR_CACHE = 64
"""Compiled grammars kept, the most recently used: clients that send a new schema with
each request must not grow the replica's memory without bound."""


class StructuredOutput:
    """Compiles schemas for one tokenizer (the last :data:`GRAMMAR_CACHE` used are kept)
    and makes matchers.

    Args:
        tokenizer: the served transformers tokenizer.
        vocab_size: rows of the model's logits (may exceed the tokenizer's vocabulary).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def compile(self, schema: dict[str, Any]) -> Any:
        """The compiled grammar of a JSON schema (no whitespace beyond one space, so a
        small model cannot wander into endless indentation).

        Raises:
            ParamError: the schema is not one xgrammar can compile.
        """
        key = json.dumps(schema, sort_keys=True)
        grammar = self._cache.get(key)
        if grammar is not None:
            self._cache.move_to_end(key)
            return grammar
        try:
            grammar = self._get_compiler().compile_json_schema(key, any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ParamError(FIELD, f"{FIELD}: cannot compile the JSON schema: {e}") from e
        self._cache[key] = grammar
        while len(self._cache) > GRAMMAR_CACHE:
            self._cache.popitem(last=False)
        return grammar

    @property
    def cached(self) -> int:
        """Compiled grammars held now (at most :data:`GRAMMAR_CACHE`)."""
        return len(self._cache)

    def matcher(self, schema: dict[str, Any]) -> Any:
        """A fresh matcher (one sequence's grammar state) for ``schema``."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(schema))

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


def mask(logits: torch.Tensor, raw: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits`` with disallowed tokens at -inf in the rows of requests with a grammar.

    Args:
        logits: ``[S, V]`` float logits after the logits processors.
        raw: the model's logits; never modified (log-probabilities come from them).
        requests: the ``S`` requests, in row order; one whose matcher raises gets the
            exception in :attr:`Request.error` (the engine fails it after the step).
    """
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    if logits is raw:
        logits = logits.clone()
    bitmask = xgr.allocate_token_bitmask(len(requests), logits.shape[-1])
    for i in rows:
        try:
            requests[i].grammar.fill_next_token_bitmask(bitmask, i)
        except Exception as e:  # this request's matcher: it alone fails (Request.error)
            requests[i].error = e
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits
