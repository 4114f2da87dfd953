"""The ``hf`` backend: a Hugging Face model over a dense batch cache (BATON).

- ``backend``: ``HFBackend``, prefill and decode through the model's own forward;
- ``batch_cache``: the dense KV cache of the running batch (rows enter and leave);
- ``prefix_store``: K/V of shared prefix segments, computed once, held until the last
  member is admitted.
"""
