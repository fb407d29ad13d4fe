"""Real English prompts of an exact token length, for benchmarks that send text.

The corpus is the docstrings of this Python's standard library (parsed with ``ast``, never
imported): deterministic and present on every machine with CPython.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import sysconfig
from pathlib import Path

CORPUS_DESCRIPTION = (
    "docstrings (module, class, function; >= 40 chars) of the top-level *.py files of this "
    "Python's standard library, files in sorted order, nodes in ast.walk order, joined by "
    "blank lines"
)


def corpus_text() -> str:
    """Deterministic English text that every CPython 3.11 has (see ``CORPUS_DESCRIPTION``)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    parts: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, kinds))]
        parts.extend(d for d in map(ast.get_docstring, nodes) if d and len(d) >= 40)
    return "\n\n".join(parts)


class PromptMaker:
    """Prompts of an exact token count, cut from the corpus; cached per (row, tokens)."""

    def __init__(self, tokenizer_dir: str, seed: int) -> None:
        from transformers import AutoTokenizer  # slow import; only when prompts are needed

        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        text = corpus_text()
        self.corpus_sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.ids = self.tok.encode(text, add_special_tokens=False, verbose=False)
        # The server calls encode(text), which may prepend BOS (Llama): count it in the length.
        self.special = len(self.tok.encode("hi")) - len(
            self.tok.encode("hi", add_special_tokens=False)
        )
        self.seed = seed
        self._cache: dict[tuple[int, int, int], tuple[str, int]] = {}

    def make(self, row: int, n: int, replay: int = 0) -> tuple[str, int]:
        """(text, actual token count) for a prompt of ``n`` tokens for trace ``row``.

        ``replay`` picks a different text of the same length, so that replaying a window
        at several rates never sends a prompt twice (a server's prefix cache would
        otherwise serve every later rate's prefills from the first rate's KV).
        """
        if (row, n, replay) not in self._cache:
            self._cache[(row, n, replay)] = self._build(row, n, replay)
        return self._cache[(row, n, replay)]

    def _build(self, row: int, n: int, replay: int) -> tuple[str, int]:
        rng = random.Random(f"{self.seed}:prompt:{replay}:{row}")
        first = rng.randrange(max(1, len(self.ids) - 2 * n - 16))
        best: tuple[str, int] | None = None
        # Decode/re-encode rarely round-trips exactly at slice edges: correct the length a
        # few times, and if it oscillates around n, move the slice by one token.
        for start in range(first, first + 4):
            k = max(1, n - self.special)
            for _ in range(6):
                text = self.tok.decode(self.ids[start : start + k], skip_special_tokens=True)
                got = len(self.tok.encode(text))
                if best is None or abs(got - n) < abs(best[1] - n):
                    best = (text, got)
                if got == n:
                    return best
                k = max(1, k + n - got)
        return best


@functools.lru_cache(maxsize=4)
def prompt_maker(tokenizer_dir: str, seed: int) -> PromptMaker:
    """A shared :class:`PromptMaker` (loading the tokenizer and corpus costs seconds of CPU)."""
    return PromptMaker(tokenizer_dir, seed)
