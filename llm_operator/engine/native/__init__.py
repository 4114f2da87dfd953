"""Native engine: the paged-KV block manager, the BatchLLM scheduler, prefix pins, sequences
and the backend that steps them over our Llama-family forward (``backend.NativeBackend``).

The block manager, scheduler, pins and sequences are pure Python: they import neither torch
nor CUDA.
"""
