"""Giving the C heap's free memory back to the system (glibc's ``malloc_trim``).

glibc's malloc keeps the memory a program frees in its arenas for reuse; it returns to the
system only free space at the top of the main heap, and only beyond a threshold. Loading a
model frees hundreds of MiB of temporaries (the file's tensors, conversion and packing
copies) that would stay resident for the replica's whole life, and a long run of varied
requests leaves free holes across the arenas. ``malloc_trim(0)`` walks every arena and
returns each free page to the system (``madvise(MADV_DONTNEED)``); the memory stays
reserved, so later allocations reuse it without new mappings.

The engine calls :func:`release_free_memory` once its model is loaded, and its loop
whenever it goes idle, at most every :data:`IDLE_RELEASE_S`
(:class:`engine.async_engine.AsyncLLMEngine`). Where the C library is not glibc (musl,
macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

IDLE_RELEASE_S = 10.0
"""The least time between two releases by an idle engine loop: a release after a long run
walks the whole heap (tens of milliseconds per GiB), one soon after finds little."""


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library is another."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Return the C heap's free pages to the system now; True if glibc did (False: nothing
    to return, or not glibc). Takes a few milliseconds, more after a heap was churned."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))


class IdleRelease:
    """Calls :func:`release_free_memory` when :meth:`idle` is called, at most every
    ``every_s`` seconds.

    Args:
        every_s: the least time between two releases, in seconds.
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(
        self, every_s: float = IDLE_RELEASE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last = -float("inf")
        self.releases = 0
        """Releases made so far."""

    def idle(self) -> None:
        """The caller has nothing to do: release, unless one was made less than
        ``every_s`` ago."""
        now = self.clock()
        if now - self._last < self.every_s:
            return
        self._last = now
        self.releases += 1
        release_free_memory()
