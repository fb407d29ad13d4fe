"""Incremental detokenization with stop strings, for streaming one sequence's output.

Byte-level BPE splits a multi-byte UTF-8 character across tokens, so decoding each token
alone yields U+FFFD. Re-decoding the whole output every step would fix that but costs
O(output length) per step. Instead a short window of recent tokens is decoded: text is
released only once the window no longer ends in U+FFFD (the character is complete).
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
# A partial UTF-8 character is complete within a few tokens; a window that still ends in
# U+FFFD after this many holds invalid bytes, which are released as U+FFFD (as a full decode
# shows them) rather than letting the window, and the per-step decode cost, grow unbounded.
MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer:
    """Turns one sequence's sampled token ids into text deltas, holding back stop strings.

    Args:
        tokenizer: a transformers tokenizer (anything with ``decode(ids, skip_special_tokens)``).
        stop: stop strings; the sequence ends before the first occurrence of any of them.
        skip_special_tokens: drop special tokens (such as EOS) from the text.

    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(
        self, tokenizer, stop: list[str] | tuple[str, ...] = (), skip_special_tokens: bool = True
    ):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._skip_special = skip_special_tokens
        self._token_ids: list[int] = []
        # Tokens [prefix_offset, read_offset) were already turned into text; they are decoded
        # again only as context, so the new tokens decode as they would inside the full text.
        self._prefix_offset = 0
        self._read_offset = 0
        self._pending = ""  # decoded but held back: it might be the start of a stop string
        self._chunks: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far (the joined deltas), in characters."""
        # Joined lazily and kept joined, so reading it once per step stays cheap when idle.
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def output_token_ids(self) -> list[int]:
        """Every token id fed so far, including any that completed a stop string."""
        return list(self._token_ids)

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> tuple[str, str | None]:
        """Feed the newly sampled token ids of this sequence (usually one per step).

        ``check_stop=False`` (a request's ``min_tokens`` not yet reached) emits the text
        without looking for stop strings.

        Returns:
            ``(delta_text, stop_string)``: the text that may now be emitted (possibly empty),
            and the stop string that matched, else None. After a match the sequence must
            finish with finish_reason "stop"; the stop string and what follows are never
            emitted.

        Raises:
            RuntimeError: the sequence already finished (a stop string matched, or flush()).
        """
        if self._finished:
            raise RuntimeError("update() after the sequence finished")
        self._token_ids.extend(new_token_ids)
        new_text = self._decode_window(force=False)
        if not check_stop:
            delta, self._pending = self._pending + new_text, ""
            self._chunks.append(delta)
            return delta, None
        return self._release(new_text)

    def flush(self) -> str:
        """The sequence finished for another reason (EOS, length, abort): emit the held text.

        A trailing incomplete character is emitted as U+FFFD, as a full decode would show it.
        Text is still cut before a stop string, should one complete only here.

        Raises:
            RuntimeError: the sequence already finished.
        """
        if self._finished:
            raise RuntimeError("flush() after the sequence finished")
        delta, stop = self._release(self._decode_window(force=True))
        if stop is None:
            delta += self._pending
            self._chunks.append(self._pending)
            self._pending = ""
        self._finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_window(self, force: bool) -> str:
        """Text of the tokens not yet read, up to the last token that ends a character."""
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        # A partial character's bytes (at most 3) lie in the last 3 tokens, so when several
        # tokens arrive at once the text before them can still be released now.
        for end in range(len(ids), max(self._read_offset, len(ids) - 4), -1):
            text = self._decode(ids[self._prefix_offset : end])
            if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                return self._advance(end, text[len(prefix_text) :])
            if end == len(ids) and (force or end - self._read_offset >= MAX_PENDING_TOKENS):
                return self._advance(end, text[len(prefix_text) :])
        return ""

    def _advance(self, end: int, new_text: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, end
        return new_text

    def _release(self, new_text: str) -> tuple[str, str | None]:
        """Add decoded text to the held-back tail; emit what can no longer start a stop."""
        pending = self._pending + new_text
        matches = [(i, s) for s in self._stop if (i := pending.find(s)) >= 0]
        if matches:
            cut, stop = min(matches)
            self._pending = ""
            self._chunks.append(pending[:cut])
            self._finished = True
            return pending[:cut], stop
        # Hold back the longest tail that is a prefix of some stop string; pending therefore
        # stays under max_stop_len characters plus one step's delta, keeping find() cheap.
        hold = 0
        for k in range(min(len(pending), self._max_stop_len - 1), 0, -1):
            if any(s.startswith(pending[-k:]) for s in self._stop):
                hold = k
                break
        delta, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self._chunks.append(delta)
        return delta, None
