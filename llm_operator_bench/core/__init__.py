"""The side-by-side run of ``llm-operator bench``: workloads, systems, runner, records, report."""
