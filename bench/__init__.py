"""iterserve's benchmarks, run from the repository root as ``python -m bench.<suite>``.

The suites are this package's top-level modules; what they share is in :mod:`bench.toolkit`.
Their latest results are in ``bench/results/``, rendered into ``docs/benchmarks.md`` by
``python -m bench.docs``.
"""
