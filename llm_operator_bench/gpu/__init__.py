"""``llm-operator bench gpu`` and the attention kernels' check and timing on a CUDA GPU."""
