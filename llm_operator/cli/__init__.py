"""The ``llm-operator`` command line.

- ``main``: the commands (``run``, ``plan``, ``demo``) and their options, derived from
  the option table (``llm_operator.options``), and the commands other installed packages
  add through entry points of group ``llm_operator.commands`` (the benchmarks' ``bench``,
  never imported by the library);
- ``tables``: reading and writing Parquet, CSV and JSONL tables;
- ``checkpoint``: resumable runs (finished chunks written atomically);
- ``engines``: running a list of prompts locally, on Spark or on Dask;
- ``demo`` and ``demo_data``: ``llm-operator demo`` (``make demo``), the bundled reviews and
  tickets classified with SmolLM2.
"""

from llm_operator.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
