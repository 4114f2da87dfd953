"""Benchmarks: core (workloads, systems, runner, report), baselines, suites, gpu, testing."""
