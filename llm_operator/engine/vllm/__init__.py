"""The ``vllm`` backend: our plan (order, groups, prefix pins) run by vLLM's engine.

- ``backend``: ``VLLMBackend``, the plan's groups fed to vLLM in decode-first order;
- ``driver``: starting vLLM's engine in this process and driving its requests
  (``start_engine`` is also what ``llm-operator bench`` uses for plain vLLM).
"""
