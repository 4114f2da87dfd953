"""Triton kernels, their launchers and torch references (installed as ``llm_operator.kernels``).

Nothing lives here yet: the ``hf`` backend uses Hugging Face attention.
"""
