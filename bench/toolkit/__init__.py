"""What the benchmark suites share: the command line, the trace workload, prompts, the load
generator and its targets, the report, the servers and offline engines they compare, the
in-process engine, the live checks of the simulator, the step split and the CPU-load gauge.
Light to import: the offline engines' probe loop imports it in vLLM's venv, and the GPU check
on a machine with neither Ray nor FastAPI.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root: the suites run from it."""
RESULTS = REPO / "bench" / "results"
"""Where the suites write their results by default (the committed ones included)."""
