"""The ``llm-operator`` command line.

- ``main``: the commands (``run``, ``plan``, ``bench``, ``demo``, ...) and their options,
  derived from the option table (``llm_operator.options``);
- ``tables``: reading and writing Parquet, CSV and JSONL tables;
- ``checkpoint``: resumable runs (finished chunks written atomically);
- ``engines``: running a list of prompts locally, on Spark or on Dask.

``llm-operator bench`` and ``llm-operator demo`` run ``llm_operator_bench``, installed
beside the library but never imported by it.
"""

from llm_operator.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
