"""The ``openai`` backend: an OpenAI-compatible model server fed in plan order."""
