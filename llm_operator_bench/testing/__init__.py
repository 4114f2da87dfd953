"""Test fixtures: tiny random models and tokenizers, a fault-injecting proxy, a model server."""
