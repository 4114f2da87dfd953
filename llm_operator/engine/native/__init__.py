"""Native engine: paged-KV block manager, BatchLLM scheduler and (elsewhere) the model runner.

The block manager and the scheduler are pure Python: they import neither torch nor CUDA.
"""
