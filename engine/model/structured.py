"""Structured output: JSON-schema and structural-tag constrained decoding through xgrammar.

xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models", MLSys 2025; vLLM's default backend) compiles a schema into a
grammar over the tokenizer's vocabulary once, then gives each sequence a matcher that
fills a bitmask of the tokens allowed next. The sampler masks only the rows of requests
that asked for a schema, so their neighbours in the batch are untouched; the engine
advances each matcher with the token it kept.

A structural tag (xgrammar's format for tool calls) is free text in which a trigger string
opens a tagged span whose content must follow a JSON schema; the router builds them from a
request's ``tools`` (:mod:`router.tools`). Grammars of both kinds share one cache.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

from engine.core.params import ParamError, SamplingParams
from engine.core.request import Request

FIELD = "response_format"
"""The API field a schema comes from, named in errors."""
TAG_FIELD = "tools"
"""The API field a structural tag comes from (tool calls), named in errors."""


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
        return self._compiled("schema", schema)

    def compile_tag(self, tag: dict[str, Any]) -> Any:
        """The compiled grammar of an xgrammar structural tag (``SamplingParams.structural_tag``).

        Raises:
            ParamError: the tag (or a schema in it) is not one xgrammar can compile.
        """
        return self._compiled("tag", tag)

    def for_params(self, params: SamplingParams) -> Any:
        """A fresh matcher for ``params``' grammar; None when it has none."""
        import xgrammar as xgr

        if params.json_schema is not None:
            return xgr.GrammarMatcher(self.compile(params.json_schema))
        if params.structural_tag is not None:
            return xgr.GrammarMatcher(self.compile_tag(params.structural_tag))
        return None

    def check(self, params: SamplingParams) -> None:
        """Compile ``params``' grammar, if any (kept for its matchers).

        Raises:
            ParamError: it does not compile.
        """
        if params.json_schema is not None:
            self.compile(params.json_schema)
        if params.structural_tag is not None:
            self.compile_tag(params.structural_tag)

    def _compiled(self, kind: str, spec: dict[str, Any]) -> Any:
        text = json.dumps(spec, sort_keys=True)
        key = f"{kind}:{text}"
        grammar = self._cache.get(key)
        if grammar is not None:
            self._cache.move_to_end(key)
            return grammar
        field = FIELD if kind == "schema" else TAG_FIELD
        what = "the JSON schema" if kind == "schema" else "the tools' grammar"
        try:
            if kind == "schema":
                grammar = self._get_compiler().compile_json_schema(text, any_whitespace=False)
            else:
                compact = json.dumps(_compact_json(spec))
                grammar = self._get_compiler().compile_structural_tag(compact)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ParamError(field, f"{field}: cannot compile {what}: {e}") from e
        self._cache[key] = grammar
        while len(self._cache) > GRAMMAR_CACHE:
            self._cache.popitem(last=False)
        return grammar

    @property
    def cached(self) -> int:
        """Compiled grammars held now (at most :data:`GRAMMAR_CACHE`)."""
        return len(self._cache)

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


def _compact_json(node: Any) -> Any:
    """A structural tag with each JSON-schema content replaced by its grammar without
    free whitespace, as :meth:`StructuredOutput.compile` compiles a schema: xgrammar's
    structural tags otherwise admit any whitespace between JSON tokens."""
    if isinstance(node, list):
        return [_compact_json(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        import xgrammar as xgr

        schema = json.dumps(node["json_schema"])
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        return {"type": "grammar", "grammar": str(grammar)}
    return {k: _compact_json(v) for k, v in node.items()}


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
