"""Dataframe integrations (installed as ``llm_operator.integrations``).

- ``spark``: ``llm_infer`` (an LLM struct column over a Spark DataFrame) and ``co_locate``;
- ``spark_ml``: ``LLMTransformer``, ``llm_infer`` as a Spark ML pipeline stage (saved and
  loaded with the pipeline);
- ``dask``: ``llm_infer`` (generated columns on a dask DataFrame) and ``co_locate``;
- ``infer_options``, ``worker``, ``co_location``: what both share: the options, one engine
  per worker process and running a partition, and the co-location scheme (rows sharing a
  prompt prefix meet in one partition);
- ``devices``: which GPU a Spark task or a Dask worker runs on;
- ``estimate_frames``: ``llm_estimate`` on a frame's sample;
- ``spark_session``: the local-mode SparkSession the CLI uses, with startup noise quieted;
- ``spark_tables``, ``dask_tables``: prompts from columns on each (field order, dedupe);
- ``json_values``: a column's values to and from JSON-safe Python values.

Importing this package imports neither pyspark nor dask.
"""
