"""Token sampling: greedy, temperature, min-p, top-k and top-p, with per-request seeds,
after each request's logits processors (:mod:`engine.model.logits_processors`) and grammar
(:mod:`engine.model.structured`); and the prompt log-probabilities of requests that ask."""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F

from engine.core.interfaces import SampleResult
from engine.core.request import Request
from engine.model import logits_processors, structured


class Sampler:
    """Samples one token per row of logits.

    A request with a seed owns a ``torch.Generator`` (kept on the request, so it survives
    preemption); its draws then depend only on its own logits, never on what else is in
    the batch. Requests without a seed share the engine's generator.
    """

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, requests: list[Request], eos_token_ids: Collection[int] = ()
    ) -> list[SampleResult]:
        """Sample one token per row.

        Args:
            logits: ``[S, V]`` logits of the last position of each request.
            requests: the ``S`` requests, in row order.
            eos_token_ids: what a request's ``min_tokens`` holds back (with its stop ids).

        Returns:
            One result per row; log-probabilities are the model's, before any processor.
        """
        raw = logits.float()
        logits = structured.mask(
            logits_processors.apply(raw, requests, eos_token_ids), raw, requests
        )
        params = [r.params for r in requests]
        token_ids = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            sub = _filter(logits[rows], [params[i] for i in rows])
            token_ids[rows] = self._draw(sub, [requests[i] for i in rows])
        ids = token_ids.tolist()
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list[dict[int, float] | None] = [None] * len(ids)
        if want:
            lp = raw[want].log_softmax(dim=-1)
            k = max(params[i].logprobs for i in want)
            top_v, top_i = lp.topk(max(k, 1), dim=-1)
            for j, i in enumerate(want):
                d = {ids[i]: float(lp[j, ids[i]])}
                for t in range(params[i].logprobs):
                    d.setdefault(int(top_i[j, t]), float(top_v[j, t]))
                logprobs[i] = d
        return [SampleResult(t, lp_) for t, lp_ in zip(ids, logprobs)]

    def _generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        if req.generator is None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return req.generator

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row of ``logits`` (``[R, V]``, removed tokens at -inf) from its
        softmax, by inverse transform sampling: one uniform draw per row, from the row's
        generator, located in the row's cumulative distribution (:func:`_locate`). An
        exponential race over the whole vocabulary would draw ``V`` numbers a row; one draw
        keeps a sampled step's cost near a greedy one's
        (``bench/results/experiments/sampling_cost.json``). Returns ``[R]`` int64.
        """
        u = torch.stack(
            [
                torch.rand(
                    (), dtype=torch.float64, device=logits.device, generator=self._generator(r)
                )
                for r in requests
            ]
        )
        # 1 - u lies in (0, 1]: the target mass is never 0, so the token found has
        # positive probability.
        return _locate(logits.softmax(dim=-1), 1.0 - u)


DRAW_BLOCK = 1024
"""Tokens per block of :func:`_locate`'s two-level cumulative sum."""


def _locate(probs: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` (``[R, V]``), the first token at which the cumulative
    probability reaches ``frac`` (``[R]`` float64 in (0, 1]) of the row's total.

    Two levels: float32 sums within blocks of :data:`DRAW_BLOCK` tokens, float64 sums
    across blocks and within the located block. A float32 sum over a whole 50k-token
    vocabulary drifts by about 1e-4, and a float64 one over the whole row costs more.
    """
    rows, vocab = probs.shape
    pad = -vocab % DRAW_BLOCK
    within = F.pad(probs, (0, pad)).view(rows, -1, DRAW_BLOCK).cumsum(dim=-1)
    across = within[:, :, -1].double().cumsum(dim=-1)  # [R, blocks]
    target = frac * across[:, -1]
    block = torch.searchsorted(across, target.unsqueeze(1)).squeeze(1)
    block = block.clamp_(max=across.shape[1] - 1)
    before = torch.where(
        block > 0, across.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0
    )
    inner = within[torch.arange(rows, device=probs.device), block].double()  # [R, BLOCK]
    # Capped at the block's total: then the first index reaching it is the block's last
    # token of positive probability, never padding.
    rest = torch.minimum(target - before, inner[:, -1])
    return block * DRAW_BLOCK + torch.searchsorted(inner, rest.unsqueeze(1)).squeeze(1)


TOP_CANDIDATES = 1024
"""Tokens :func:`torch.topk` ranks for top-k and top-p rows, instead of a sort of the whole
vocabulary, which costs milliseconds a row at a 49,152-token vocabulary. A top-p row whose
candidates hold less than its ``top_p`` of the probability falls back to the sort."""


def _filter(logits: torch.Tensor, params) -> torch.Tensor:
    """Apply temperature, then min-p, top-k, top-p (nucleus; Holtzman et al., ICLR 2020)
    to ``[R, V]`` logits, one row per request's params; removed tokens become -inf."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps.unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        min_ps = torch.tensor([p.min_p for p in params], device=logits.device)
        floor = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    todo = [i for i, (k, p) in enumerate(zip(top_ks, top_ps)) if k < vocab or p < 1.0]
    if not todo:
        return logits
    out = logits.clone()
    sub, ks, ps = logits[todo], [top_ks[i] for i in todo], [top_ps[i] for i in todo]
    kept, covered = _top_k_top_p_candidates(sub, ks, ps)
    if not all(covered):
        rest = [j for j, c in enumerate(covered) if not c]
        kept[rest] = _top_k_top_p_sorted(sub[rest], [ks[j] for j in rest], [ps[j] for j in rest])
    out[todo] = kept
    return out


def _top_k_top_p_candidates(
    logits: torch.Tensor, top_ks: list[int], top_ps: list[float]
) -> tuple[torch.Tensor, list[bool]]:
    """Top-k then top-p over each row's :data:`TOP_CANDIDATES` (or ``max(top_ks)``) best
    tokens. Returns the filtered ``[R, V]`` logits and, per row, whether the candidates
    held the whole kept set; rows that did not need :func:`_top_k_top_p_sorted`."""
    vocab, dev = logits.shape[-1], logits.device
    # Enough candidates for every row's top-k; TOP_CANDIDATES for a row without one.
    n = max((k for k in top_ks if k < vocab), default=0)
    n = min(vocab, max(n, TOP_CANDIDATES if vocab in top_ks else 0))
    vals, idx = logits.topk(n, dim=-1)  # sorted, largest first
    has_k = torch.tensor([k < vocab for k in top_ks], device=dev)
    cut = torch.arange(n, device=dev).unsqueeze(0) >= torch.tensor(
        [min(k, n) for k in top_ks], device=dev
    ).unsqueeze(1)
    kept_vals = vals.masked_fill(cut, float("-inf"))
    # Top-p applies to the distribution after top-k: renormalised over the top k, or over
    # the whole vocabulary for a row without top-k.
    lse = torch.where(has_k, kept_vals.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (kept_vals - lse.unsqueeze(1)).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_ps, device=dev)
    cut |= mass_before >= p.unsqueeze(1)
    cut[:, 0] = False  # a top_p under fp32's range rounds to 0: the top token still stays
    covered = (has_k | (probs.sum(dim=-1) >= p)).tolist()
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(-1, idx, vals.masked_fill(cut, float("-inf")))
    return out, covered


def _top_k_top_p_sorted(
    logits: torch.Tensor, top_ks: list[int], top_ps: list[float]
) -> torch.Tensor:
    """Top-k then top-p by a sort of each whole row (``[R, V]`` in and out)."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    cut = ranks.unsqueeze(0) >= torch.tensor(top_ks, device=logits.device).unsqueeze(1)
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    cut |= mass_before >= torch.tensor(top_ps, device=logits.device).unsqueeze(1)
    cut[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def prompt_logprob_rows(
    seqs, query_start_loc: list[int]
) -> tuple[list[tuple[Request, int, int]], list[int]]:
    """Which positions of a step's flat tokens give prompt log-probabilities.

    Position ``p`` of a request's prompt predicts token ``p + 1``; a request that asked
    (``Request.prompt_logprobs`` not None) needs each such position once, in order, so a
    recompute after preemption adds none twice.

    Returns:
        ``(request, first position, count)`` per request, and the flat row indices, in
        that order.
    """
    spans, rows = [], []
    for seq, q0 in zip(seqs, query_start_loc):
        req = seq.request
        if req.prompt_logprobs is None:
            continue
        first = max(seq.start, len(req.prompt_logprobs) - 1)
        end = min(seq.start + seq.num_tokens, len(req.prompt_token_ids) - 1)
        if end > first:
            spans.append((req, first, end - first))
            rows.extend(range(q0 + first - seq.start, q0 + end - seq.start))
    return spans, rows


def record_prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Request, int, int]]) -> None:
    """Append each span's entries to its request: the log-probability of the prompt's
    next token, and the top ``prompt_logprobs`` of the distribution.

    Args:
        logits: ``[sum of counts, V]``, the spans' positions in order.
    """
    k = 0
    for req, first, count in spans:
        lp = logits[k : k + count].float().log_softmax(dim=-1)
        k += count
        targets = req.prompt_token_ids[first + 1 : first + 1 + count]
        own = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1))[:, 0].tolist()
        top = req.params.prompt_logprobs
        top_v, top_i = lp.topk(max(top, 1), dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, t in enumerate(targets):
            entry = {t: own[j]}
            for v, i in zip(top_v[j][:top], top_i[j][:top]):
                entry.setdefault(i, v)
            req.prompt_logprobs.append(entry)
