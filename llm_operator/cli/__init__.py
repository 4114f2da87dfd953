"""The ``llm-operator`` command line: ``main`` (the commands and their options, and those other
packages add through entry points of group ``llm_operator.commands``), ``tables``,
``checkpoint`` (resumable runs), ``engines`` (local, Spark or Dask) and ``demo``."""

from llm_operator.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
