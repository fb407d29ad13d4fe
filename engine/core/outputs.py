"""What a caller request gets back after each step, in the shape its output kind asks for."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.params import RequestOutputKind
from engine.core.request import (
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)


@dataclass(slots=True)
class RequestGroup:
    """The ``n`` sequences of one caller request."""

    request_id: str
    prompt: str | None
    seqs: list[Request]
    arrival_time: float
    kind: RequestOutputKind
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(r.status is RequestStatus.FINISHED for r in self.seqs)


def make_output(group: RequestGroup, deltas: dict[str, tuple[str, int]]) -> RequestOutput | None:
    """The group's output after a step, or None when its kind has nothing to say yet.

    Args:
        deltas: per sequence id that got a token this step (or finished without one:
            an abort), ``(new text, new tokens)``; the new tokens are the last of its
            ``output_token_ids`` (and ``logprobs``). A ``DELTA`` output holds only these.
    """
    finished = group.finished
    if group.kind is RequestOutputKind.FINAL_ONLY and not finished:
        return None
    delta = group.kind is RequestOutputKind.DELTA
    completions = []
    for req in group.seqs:
        want_lp = req.params.logprobs is not None
        if delta and req.request_id not in deltas:
            continue  # nothing new: a finished sequence reports its finish_reason once
        if delta:
            text, new = deltas.get(req.request_id, ("", 0))
            token_ids = req.output_token_ids[len(req.output_token_ids) - new :]
            logprobs = req.logprobs[len(req.logprobs) - new :] if want_lp else None
        else:
            text, token_ids = req.detokenizer.text, list(req.output_token_ids)
            logprobs = list(req.logprobs) if want_lp else None
        completions.append(
            CompletionOutput(
                index=req.index,
                text=text,
                token_ids=token_ids,
                finish_reason=req.finish_reason.value if req.finish_reason else None,
                stop_reason=req.stop_reason,
                logprobs=logprobs,
            )
        )
    firsts = [r.first_token_time for r in group.seqs if r.first_token_time is not None]
    scheduled = [r.first_scheduled_time for r in group.seqs if r.first_scheduled_time is not None]
    plp = group.seqs[0].prompt_logprobs
    if plp is not None and (
        len(plp) < len(group.seqs[0].prompt_token_ids) or (delta and group.prompt_logprobs_sent)
    ):
        plp = None
    group.prompt_logprobs_sent |= plp is not None
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.seqs[0].prompt_token_ids,
        outputs=completions,
        finished=finished,
        prompt_logprobs=None if plp is None else list(plp),
        num_cached_tokens=group.seqs[0].num_cached_tokens,
        embedding=group.seqs[0].embedding,
        metrics=RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=min(scheduled) if scheduled else None,
            first_token_time=min(firsts) if firsts else None,
            finish_time=max(r.finish_time for r in group.seqs) if finished else None,
        ),
    )
