"""Rows to prompts to token ids.

- ``encode``: a row's prompt (string or chat messages) to token ids, per-row checks (null,
  empty, too long for the context) and per-row sampling parameters;
- ``table``: prompts built from a table's columns (a template, or ``name: value`` lines
  after an instruction), and which of their lines may move;
- ``field_order``: the field order that shares the most prompt prefix over a whole table;
- ``dedupe``: identical prompts computed once (the CLI's ``--dedupe``, each partition's);
- ``options``: ``PromptOptions``, the options of how a column value becomes a prompt.

Importing this package imports nothing heavy (no torch, no tokenizer).
"""
