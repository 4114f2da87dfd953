"""Dataframe integrations (installed as ``llm_operator.integrations``).

Nothing lives here yet.
"""
