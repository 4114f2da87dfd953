"""The systems the operator is measured against: HF generate on static batches, vLLM."""
