"""The ``vllm`` backend: our plan run by vLLM's engine (``backend``); ``driver`` starts the
engine in this process and drives its requests (also for ``llm-operator bench``)."""
