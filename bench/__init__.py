"""iterserve's benchmarks, run from the repository root as ``python -m bench.<suite>``.

The suites are this package's top-level modules, except :mod:`bench.docs` (which renders
their results into ``docs/benchmarks.md``) and two parts of a suite: :mod:`bench.peers_packed`
(a phase of :mod:`bench.peers`) and :mod:`bench.gpu_estimate` (the estimate on paper of
:mod:`bench.gpu_check`). What they share is in :mod:`bench.toolkit`: one command line
(:mod:`bench.toolkit.cli`) and one writer of result files
(:func:`bench.toolkit.report.write_report`) among them. Their latest results are in
``bench/results/``.
"""
