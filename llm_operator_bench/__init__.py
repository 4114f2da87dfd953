"""Benchmarks: workloads, baselines and reports."""
