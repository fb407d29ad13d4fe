"""What the benchmark suites share: the trace workload, prompts, the load generator and its
targets, the report, the servers and offline engines they compare, the in-process engine, and
the CPU-load gauge. Light to import: the offline engines' probe loop imports it in vLLM's venv.
"""
