"""The ``hf`` backend: a Hugging Face model over a dense batch cache (BATON): ``backend``,
``batch_cache`` (the running batch's K/V; rows enter and leave) and ``prefix_store``."""
