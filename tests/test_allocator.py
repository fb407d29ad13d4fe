"""engine.core.heap_trim: the C heap's free pages go back to the system."""

from __future__ import annotations

import ctypes
import platform

import psutil
import pytest

from engine.core.heap_trim import IdleRelease, release_free_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_freed_heap_memory_leaves_the_resident_set():
    """Blocks below glibc's mmap threshold, freed in a pattern that leaves the top of the
    heap in use, stay resident until released."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 4096  # 256 MiB in blocks under the default mmap threshold
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # make the pages resident
    for b in blocks[:-1]:
        libc.free(b)  # the last block pins the top of the heap
    me = psutil.Process()
    before = me.memory_info().rss
    assert release_free_memory()
    after = me.memory_info().rss
    libc.free(blocks[-1])
    assert before - after > 128 * 2**20, (before, after)


def test_idle_releases_are_spaced():
    t = [0.0]
    idle = IdleRelease(every_s=10.0, clock=lambda: t[0])
    for step in range(30):
        t[0] = step  # one idle call a second
        idle.idle()
    assert idle.releases == 3  # at 0, 10 and 20 s
