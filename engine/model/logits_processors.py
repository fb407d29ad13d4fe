"""Per-request logits processors: penalties, logit bias and ``min_tokens``.

Applied row by row, only to the rows of requests that ask for one, so a request's
penalties never touch its neighbours' logits and a plain request keeps the model's logits
bit for bit. Order, as vLLM applies them: ``min_tokens`` (EOS and stop token ids masked),
``logit_bias``, repetition penalty (CTRL, Keskar et al., 2019: over prompt and output),
then OpenAI's frequency and presence penalties (over the output). Temperature, min-p,
top-k and top-p follow in :class:`engine.model.sampler.Sampler`.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from engine.core.request import Request


def apply(
    logits: torch.Tensor, requests: list[Request], eos_token_ids: Collection[int]
) -> torch.Tensor:
    """``logits`` with each request's processors applied to its row.

    Args:
        logits: ``[S, V]`` float logits, one row per request (not modified).
        requests: the ``S`` requests, in row order.
        eos_token_ids: what ``min_tokens`` holds back, with each request's stop token ids.

    Returns:
        ``logits`` itself when no request has a processor, else a processed copy. A
        request whose processors raise keeps its row as far as they got and gets the
        exception in :attr:`Request.error` (the engine fails it after the step).
    """
    rows = [i for i, r in enumerate(requests) if r.params.penalized]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        try:
            _process_row(out[i], requests[i], eos_token_ids)
        except Exception as e:  # this request's own processors: it alone fails (Request.error)
            requests[i].error = e
    return out


def _process_row(row: torch.Tensor, req: Request, eos_token_ids: Collection[int]) -> None:
    """Apply ``req``'s processors to its ``[V]`` row in place."""
    p = req.params
    vocab = row.shape[0]
    if len(req.output_token_ids) < p.min_tokens:
        held = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
        row[held] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), device=row.device, dtype=row.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.token_ids)), device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
        out_ids = torch.tensor(req.output_token_ids, device=row.device)
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
