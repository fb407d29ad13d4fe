"""Between OpenAI's request and response bodies and the replica's token ids, sampling
parameters and dicts.

Pure functions of a validated request (:mod:`router.schemas`) and the served tokenizer;
every error is an :class:`router.errors.ApiError` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ValidationError

from engine.core.params import ParamError, RequestOutputKind, SamplingParams
from router.errors import ApiError
from router.schemas import ApiRequest, unsupported_field
from router.tools import ChatTemplates, ToolUse, render

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

M = TypeVar("M", bound=BaseModel)


def validate(body: dict, schema: type[M]) -> M:
    """``body`` parsed as ``schema``. Raises ApiError 400 naming the first bad field: an
    unsupported OpenAI field, an unknown one, or a value out of range."""
    if (name := unsupported_field(body, schema.unsupported)) is not None:
        raise ApiError(
            400,
            f"`{name}` is not supported by this server",
            param=name,
            code="unsupported_parameter",
        )
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # pydantic names the member of a union it tried (prompt.str, stop.list[str]):
        # the API's param is the field's path alone.
        param = ".".join(str(p) for p in err["loc"] if not _union_member(p)) or None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            message = f"{param}: field required"
        elif err["type"] == "extra_forbidden":
            message = f"`{param}` is not a parameter of this endpoint"
        else:
            message = f"{param}: {msg} (got {err.get('input')!r})"
        raise ApiError(400, message, param=param, code="invalid_value") from None


def _union_member(loc: str | int) -> bool:
    return isinstance(loc, str) and (loc in ("str", "int", "float", "bool", "dict") or "[" in loc)


def check_served(req: ApiRequest, chat: bool, models: Sequence[str], max_n: int) -> None:
    """Whether this server can take ``req``.

    Args:
        models: the names it serves: the base model's, then its LoRA adapters'.

    Raises:
        ApiError: 404 for a model not in ``models``; 400 when ``n`` times the number of
            prompts is over ``max_n``.
    """
    check_model(req.model, models)
    num_prompts = 1 if chat else len(req.prompt)
    if req.n * num_prompts > max_n:
        raise ApiError(
            400,
            f"n={req.n} for {num_prompts} prompt(s) is over the server's cap of {max_n} choices",
            param="n",
            code="invalid_value",
        )


def check_model(model: str, models: Sequence[str]) -> None:
    """Whether ``model`` is one of the served ``models`` (the base model's name, then its
    LoRA adapters').

    Raises:
        ApiError: 404 ``model_not_found``, naming the served models.
    """
    if model not in models:
        served = ", ".join(repr(m) for m in models)
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )


def prompts(
    req: ApiRequest,
    chat: bool,
    tokenizer: PreTrainedTokenizerBase,
    templates: ChatTemplates | None = None,
    use: ToolUse | None = None,
) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and text (chat: one, through its chat template, with the
    tools of ``use``: :func:`router.tools.render`; ``templates`` None: the model's own).

    Raises:
        ApiError: 400 for an empty prompt or messages the template refuses.
    """
    if not chat:
        out = []
        for prompt in req.prompt:
            if isinstance(prompt, str):
                out.append((tokenizer.encode(prompt), prompt))
            else:
                out.append((list(prompt), tokenizer.decode(prompt)))
            if not out[-1][0]:
                raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
        return out
    text = render(req, use, tokenizer, templates or ChatTemplates.of(tokenizer, None))
    return [(tokenizer.encode(text, add_special_tokens=False), text)]


def scores_only(req: ApiRequest, chat: bool) -> bool:
    """A completions request with ``max_tokens: 0`` and ``echo``: the prompt (and its
    log-probabilities) only. The engine still samples one token, which is dropped.

    Raises:
        ApiError: 400 for ``max_tokens: 0`` without ``echo``.
    """
    if chat or req.max_tokens != 0:
        return False
    if not req.echo:
        raise ApiError(
            400,
            "max_tokens: 0 needs echo (it returns the prompt's scores)",
            param="max_tokens",
            code="invalid_value",
        )
    return True


def sampling_params(req: ApiRequest, chat: bool, use: ToolUse | None = None) -> SamplingParams:
    """The request's sampling parameters, built (and so checked) once here; the replica
    hands them to its engine as they are. Asks for ``DELTA`` outputs: each step item
    carries only that step's tokens (:class:`router.contract.StepItem`). ``use``: the
    request's tool calls, whose grammar constrains the output.

    Raises:
        ApiError: 400 ``invalid_value`` naming the field, for a combination the API schema
            lets through (``min_tokens`` over ``max_tokens``, ``response_format`` with
            ``ignore_eos``): :class:`engine.core.params.ParamError`'s message.
    """
    if chat:
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        # max_tokens 0 (scores only): one token is sampled and dropped (scores_only).
        max_tokens = None if req.max_tokens is None else max(1, req.max_tokens)
        logprobs = req.logprobs
    echo_logprobs = not chat and req.echo and req.logprobs is not None
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            prompt_logprobs=req.logprobs if echo_logprobs else None,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k is not None else 0,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias or {},
            min_tokens=req.min_tokens,
            stop_token_ids=req.stop_token_ids or [],
            json_schema=req.response_format.output_schema() if req.response_format else None,
            structural_tag=use.structural_tag() if use is not None else None,
            n=req.n,
            stop=req.stop or [],
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA,
        )
    except ParamError as e:
        param = "tools" if e.param == "structural_tag" else e.param  # the API's name
        raise ApiError(400, str(e), param=param, code="invalid_value") from None


def wants_logprobs(req: ApiRequest, chat: bool) -> bool:
    """Whether the response carries a logprobs object."""
    return bool(req.logprobs) if chat else req.logprobs is not None


def logprobs_object(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: list[int],
    entries: list[dict[int, float]],
    req: ApiRequest,
    chat: bool,
) -> dict:
    """OpenAI's logprobs object for these tokens (chat and legacy completion forms).

    ``entries[i]`` maps token id to log-probability and always holds ``token_ids[i]``
    (the sampler adds the sampled token to the top ones); it is None for an echoed
    prompt's first token, which has no log-probability (completions only).
    """

    def tok(t: int) -> str:
        return tokenizer.decode([t])

    if chat:
        k = req.top_logprobs or 0
        content = []
        for t, e in zip(token_ids, entries):
            s = tok(t)
            top = sorted(e.items(), key=lambda kv: -kv[1])[:k]
            content.append(
                {
                    "token": s,
                    "logprob": e[t],
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": tok(i), "logprob": lp, "bytes": list(tok(i).encode())}
                        for i, lp in top
                    ],
                }
            )
        return {"content": content}
    tokens, offsets, offset = [], [], 0
    for t in token_ids:
        s = tok(t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[t] for t, e in zip(token_ids, entries)],
        "top_logprobs": [
            None
            if e is None
            else {tok(i): lp for i, lp in sorted(e.items(), key=lambda kv: -kv[1])}
            for e in entries
        ],
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix
    cache (``prompt_tokens_details.cached_tokens``, as OpenAI and vLLM report it)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
