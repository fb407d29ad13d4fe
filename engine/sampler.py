"""Token sampling: greedy, temperature, min-p, top-k and top-p, with per-request seeds,
after each request's logits processors (:mod:`engine.logits_processors`) and grammar
(:mod:`engine.structured`); and the prompt log-probabilities of requests that ask."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine import logits_processors, structured
from engine.request import Request


@dataclass(slots=True)
class SampleResult:
    """One sampled token; ``logprobs`` maps token id -> log-probability (None if not asked)."""

    token_id: int
    logprobs: dict[int, float] | None = None


class Sampler:
    """Samples one token per row of logits.

    A request with a seed owns a ``torch.Generator`` (kept on the request, so it survives
    preemption); its draws then depend only on its own logits, never on what else is in
    the batch. Requests without a seed share the engine's generator.
    """

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request],
               eos_token_ids: Collection[int] = ()) -> list[SampleResult]:
        """Sample one token per row.

        Args:
            logits: ``[S, V]`` logits of the last position of each request.
            requests: the ``S`` requests, in row order.
            eos_token_ids: what a request's ``min_tokens`` holds back (with its stop ids).

        Returns:
            One result per row; log-probabilities are the model's, before any processor.
        """
        raw = logits.float()
        logits = structured.mask(logits_processors.apply(raw, requests, eos_token_ids), raw,
                                 requests)
        params = [r.params for r in requests]
        token_ids = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            sub = self._filter(logits[rows], [params[i] for i in rows])
            probs = sub.softmax(dim=-1)
            # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) is a draw from
            # p, and each row's noise comes from its own generator.
            noise = torch.empty_like(probs)
            for j, i in enumerate(rows):
                noise[j].exponential_(generator=self._generator(requests[i]))
            token_ids[rows] = (probs / noise).argmax(dim=-1)
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

    @staticmethod
    def _filter(logits: torch.Tensor, params) -> torch.Tensor:
        """Apply temperature, then min-p, top-k, top-p (nucleus; Holtzman et al., ICLR 2020)."""
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
        if all(k == vocab for k in top_ks) and all(p >= 1.0 for p in top_ps):
            return logits
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        cut = ranks.unsqueeze(0) >= torch.tensor(top_ks, device=logits.device).unsqueeze(1)
        probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        cut |= mass_before >= torch.tensor(top_ps, device=logits.device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def prompt_logprob_rows(seqs, query_start_loc: list[int]
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


def record_prompt_logprobs(logits: torch.Tensor,
                           spans: list[tuple[Request, int, int]]) -> None:
    """Append each span's entries to its request: the log-probability of the prompt's
    next token, and the top ``prompt_logprobs`` of the distribution.

    Args:
        logits: ``[sum of counts, V]``, the spans' positions in order.
    """
    k = 0
    for req, first, count in spans:
        lp = logits[k:k + count].float().log_softmax(dim=-1)
        k += count
        targets = req.prompt_token_ids[first + 1:first + 1 + count]
        own = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1))[:, 0].tolist()
        top = req.params.prompt_logprobs
        top_v, top_i = lp.topk(max(top, 1), dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, t in enumerate(targets):
            entry = {t: own[j]}
            for v, i in zip(top_v[j][:top], top_i[j][:top]):
                entry.setdefault(i, v)
            req.prompt_logprobs.append(entry)
