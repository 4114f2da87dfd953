"""Reading a whole completion from an engine that stops rows by itself (``vllm``, ``openai``)
the way hf/native end theirs, for ``Run.replay``.

- A constrained row whose constraint left nothing but the end before the engine's final
  end-of-sequence token (a whole choice, a complete JSON value) loses that token: hf and
  native end such a row without a step, so ``token_ids`` and ``logprob`` then match theirs.
- vLLM's choice grammar allows any tokenization of a choice string: a row the engine ended
  ("stop") whose text is a choice is that choice even when its tokens are not the
  choice's canonical ones (which the ``Run``'s trie follows), and its end token is
  dropped when no other choice extends that text (the grammar then allowed nothing else).
- The text: the engine's for rows with stop strings (it cut them), else decoded here and
  only when the engine stopped before our rules end the row (``Run.replay`` takes the
  decoder's text otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

from llm_operator.engine.run import Request, Run


def read_completion(
    run: Run, request: Request, token_ids: Sequence[int], reason: str, text: str
) -> tuple[list[int], str, str]:
    """(tokens, finish reason, text) of a generated row for ``run.replay`` (module doc);
    ``text``: the engine's text (used for rows with stop strings)."""
    tokens = list(token_ids)
    constraint = request.constraint
    if constraint is not None and reason == "stop" and not request.params.stop:
        ended = bool(tokens) and tokens[-1] in request.decoder.eos_token_ids
        body = tokens[:-1] if ended else tokens
        only_end = ended and ends_after(constraint, body)
        if constraint.kind == "choices":
            choices = constraint.trie.choices
            chosen = run.tokenizer.decode(body, skip_special_tokens=True)
            if chosen in choices:  # the engine ended it: a whole choice, in any tokenization
                constraint.choose(choices.index(chosen))
                # the grammar too allows only the end after a choice no other extends
                only_end = ended and (
                    only_end or not any(c != chosen and c.startswith(chosen) for c in choices)
                )
        if only_end:
            tokens = body
    return tokens, reason, _text(run, request, text, tokens)


def _text(run: Run, request: Request, text: str, tokens: list[int]) -> str:
    if request.params.stop:
        return text
    decoder = request.decoder
    if len(tokens) >= decoder.max_tokens or not decoder.eos_token_ids.isdisjoint(tokens):
        return ""  # our rules end it: replay takes the decoder's text
    return run.tokenizer.decode(tokens, skip_special_tokens=True)


def ends_after(constraint, tokens: Sequence[int]) -> bool:
    """Whether ``constraint`` (a row's ``constraints`` state, not yet fed), after
    ``tokens``, leaves nothing but the end: hf/native end the row there without a step.
    Walks a copy; the row's own state is fed by ``run.replay``."""
    probe = constraint.fork()
    for token in tokens:
        probe.accept(token)
    return probe.remaining() == []
