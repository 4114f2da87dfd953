"""Dataframe integrations (installed as ``llm_operator.integrations``).

- ``spark``: ``llm_infer`` (an LLM struct column over a Spark DataFrame) and ``co_locate``;
- ``dask``: ``llm_infer`` (generated columns on a dask DataFrame) and ``co_locate``;
- ``_partition``: what both share: options, one engine per worker, running a partition,
  and the co-location scheme (rows sharing a prompt prefix meet in one partition);
- ``spark_session``: the local-mode SparkSession the CLI uses, with startup noise quieted;
- ``engines``: the CLI's engines, running a list of prompts locally, on Spark or on Dask.

Importing this package imports neither pyspark nor dask.
"""
