"""Constrained outputs: a row's next-token mask, applied in the sampling step.

- ``choices``: a token trie over the tokenized choices. The mask allows the children of
  the row's node (and the end-of-sequence tokens where a choice ends and a longer one
  goes on). Once the tokens so far leave a single choice, its remaining tokens are
  appended without model steps (jump-forward; ``RunStats.forced_tokens`` counts them).
- ``regex`` and ``json_schema``: xgrammar (the grammar engine vLLM uses) compiles the
  constraint against the tokenizer once per distinct constraint; a ``GrammarMatcher`` per
  row yields the token bitmask each step (JSON compact: no free whitespace). When only end-of-sequence tokens remain allowed,
  the row ends at once instead of spending a step on the end token.

Jump-forward (``Constraints.jump_forward``; ``forced`` below gives a row's forced tokens,
which the run appends without sampling and the backend feeds to the model together in the
row's next step, like a small prefill chunk):

- ``"tokens"`` (the default): only tokens the mask leaves alone (exactly one allowed
  token, not an end token). Sampling could not pick anything else, so outputs are token
  for token the ones of stepping (and of HF ``generate`` under the same mask). With a BPE
  vocabulary this rarely fires inside JSON (after ``{"`` the mask admits ``a``, ``aud``,
  ``audience``...).
- ``"text"`` (SGLang's jump-forward): the text the grammar forces (xgrammar's
  ``find_jump_forward_string``: keys, punctuation, the closing brace) is tokenized with
  the model's tokenizer and fed. The text is what stepping would write, but
  its tokens may be split otherwise than the model would have split them, so later free
  values can differ. Token healing: the row's sampled tokens are never re-split (the model
  chose where its last token ended); at the far end, the last token of the forced text is
  kept only when no token the grammar then allows reaches past the forced text (e.g. ``"``
  before a string value, which ``"adults`` could merge with); otherwise the model samples
  that boundary itself. Choices always jump as in ``"tokens"`` (a lone trie child is the
  only allowed token) and to their end. On the extraction job (SmolLM2-135M, 48 rows,
  ``llm_operator_bench.suites.jump_forward``) it forced 677 of 1,097 output tokens; parsed values
  differed from stepping in 11 rows, so it is not the default.
- ``"off"``: no jump inside an output (a decided choice and a finished grammar still end
  the row at once).

``Constraints`` (one per operator) compiles and caches; ``start(params)`` gives a row's
state, which the ``Run`` masks logits with and feeds the accepted tokens.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence

import torch

NO_CHOICE = -1
JUMP_FORWARD_MODES = ("text", "tokens", "off")
_BOUNDARY_CHECK_LIMIT = 256  # allowed tokens inspected at a forced text's end; more: not kept


def check_regex(regex: str) -> None:
    """ValueError naming the regex when the grammar engine cannot compile it."""
    xgr = _xgrammar()
    try:
        xgr.Grammar.from_regex(regex)
    except RuntimeError as error:
        raise ValueError(f"regex {regex!r} cannot be compiled: {_reason(error)}") from None


def check_json_schema(schema: str) -> None:
    """ValueError naming the schema when the grammar engine cannot compile it."""
    xgr = _xgrammar()
    try:
        xgr.Grammar.from_json_schema(schema)
    except RuntimeError as error:
        raise ValueError(f"json_schema cannot be compiled: {_reason(error)}") from None


class ChoiceTrie:
    """Nodes of the tokenized choices: ``children[node][token] -> node``; ``ends[node]``
    is the index of the choice that ends there (NO_CHOICE when none)."""

    def __init__(self, choices: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        self.choices = tuple(choices)
        self.children: list[dict[int, int]] = [{}]
        self.ends: list[int] = [NO_CHOICE]
        for index, ids in enumerate(token_ids):
            if not ids:
                raise ValueError(f"choice {choices[index]!r} has no tokens")
            node = 0
            for token in ids:
                child = self.children[node].get(token)
                if child is None:
                    child = len(self.children)
                    self.children[node][token] = child
                    self.children.append({})
                    self.ends.append(NO_CHOICE)
                node = child
            if self.ends[node] != NO_CHOICE:
                other = choices[self.ends[node]]
                raise ValueError(
                    f"choices {other!r} and {choices[index]!r} have the same tokens; give "
                    "choices that differ as text the tokenizer keeps apart"
                )
            self.ends[node] = index

    def tail(self, node: int) -> list[int] | None:
        """The tokens from ``node`` to the one choice it leads to, or None when more than
        one choice (or stopping here) is still possible."""
        tokens: list[int] = []
        while True:
            children = self.children[node]
            if self.ends[node] != NO_CHOICE:
                return tokens if not children else None
            if len(children) != 1:
                return None
            ((token, node),) = children.items()
            tokens.append(token)


class ChoiceState:
    """A row walking the trie."""

    kind = "choices"

    def __init__(
        self, trie: ChoiceTrie, stop_token_ids: Collection[int], *, jump: bool = True
    ) -> None:
        self.trie = trie
        self.stop_token_ids = list(stop_token_ids)
        self.node = 0
        self.chosen = NO_CHOICE
        self.jump = jump  # whether lone trie children are appended without sampling

    def mask(self, logits: torch.Tensor) -> None:
        """logits: [vocab], masked in place to the allowed tokens."""
        allowed = list(self.trie.children[self.node])
        if self.trie.ends[self.node] != NO_CHOICE:
            allowed += self.stop_token_ids
        keep = logits[allowed].clone()
        logits.fill_(float("-inf"))
        logits[allowed] = keep

    def accept(self, token: int) -> None:
        if self.chosen != NO_CHOICE:
            return
        child = self.trie.children[self.node].get(token)
        if child is not None:
            self.node = child
            if not self.trie.children[child]:
                self.chosen = self.trie.ends[child]
        elif token in self.stop_token_ids and self.trie.ends[self.node] != NO_CHOICE:
            self.chosen = self.trie.ends[self.node]

    def remaining(self) -> list[int] | None:
        """Tokens that complete the row's choice ([] when complete), None if undecided."""
        if self.chosen != NO_CHOICE:
            return []
        return self.trie.tail(self.node)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the trie forces next (a lone child where no choice ends;
        the only token the mask allows), without moving the row."""
        tokens: list[int] = []
        node = self.node
        if self.chosen != NO_CHOICE or not self.jump:
            return tokens
        while len(tokens) < limit and self.trie.ends[node] == NO_CHOICE:
            children = self.trie.children[node]
            if len(children) != 1:
                break
            ((token, node),) = children.items()
            tokens.append(token)
        return tokens

    def fork(self) -> ChoiceState:
        """A copy that walks on without moving this one."""
        copy = ChoiceState(self.trie, self.stop_token_ids, jump=self.jump)
        copy.node, copy.chosen = self.node, self.chosen
        return copy

    def choose(self, index: int) -> None:
        """The row's text is choice ``index`` (an engine that spelled it in other tokens)."""
        self.chosen = index

    def complete(self, tokens: Sequence[int]) -> None:
        """``tokens`` (from ``remaining``) were appended: the choice is made."""
        for token in tokens:
            self.node = self.trie.children[self.node][token]
        self.chosen = self.trie.ends[self.node]

    def result(self, text: str) -> tuple[str | None, str | None]:
        """(the chosen string, None) or (None, why there is none)."""
        if self.chosen == NO_CHOICE:
            return None, "the output stopped before it completed one of the choices"
        return self.trie.choices[self.chosen], None


class GrammarState:
    """A row under a compiled regex or JSON schema (an xgrammar matcher)."""

    def __init__(
        self,
        kind: str,
        compiled,
        vocab_size: int,
        stop_token_ids: Collection[int],
        jumps: _Jumps | None = None,
    ):
        xgr = _xgrammar()
        self.kind = kind
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.stop_token_ids = list(stop_token_ids)
        self.vocab_size = vocab_size
        self.jumps = jumps  # how to jump forward (None: not inside the output)
        self._filled = False

    def fork(self) -> GrammarState:
        """A copy (its own matcher and bitmask) that walks on without moving this one."""
        copy = object.__new__(GrammarState)
        copy.kind, copy.stop_token_ids, copy.vocab_size, copy.jumps = (
            self.kind, self.stop_token_ids, self.vocab_size, self.jumps
        )  # fmt: skip
        copy.matcher, copy.bitmask, copy._filled = self.matcher.fork(), self.bitmask.clone(), False
        return copy

    def _fill(self) -> None:
        if not self._filled:
            self.matcher.fill_next_token_bitmask(self.bitmask)
            self._filled = True

    def mask(self, logits: torch.Tensor) -> None:
        """logits: [vocab], masked in place to the tokens the grammar allows next."""
        self._fill()
        _xgrammar().apply_token_bitmask_inplace(logits.unsqueeze(0), self.bitmask)

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)
            self._filled = False

    def only_stop_allowed(self) -> bool:
        """Whether the grammar is complete and allows nothing but ending."""
        if self.matcher.is_terminated():
            return True
        allowed = self.allowed_tokens(limit=len(self.stop_token_ids))
        return bool(allowed) and all(t in self.stop_token_ids for t in allowed)

    def allowed_tokens(self, limit: int) -> list[int] | None:
        """The tokens the mask allows now, or None when more than ``limit``."""
        self._fill()
        words = self.bitmask[0]
        nonzero = torch.nonzero(words).flatten().tolist()
        if len(nonzero) > limit:
            return None
        tokens: list[int] = []
        for index in nonzero:
            word = int(words[index]) & 0xFFFFFFFF
            while word:
                low = word & -word
                token = index * 32 + low.bit_length() - 1
                if token < self.vocab_size:
                    tokens.append(token)
                    if len(tokens) > limit:
                        return None
                word ^= low
        return tokens

    def can_end(self) -> bool:
        if self.matcher.is_terminated():
            return True
        self._fill()
        return any(_is_set(self.bitmask, t) for t in self.stop_token_ids)

    def remaining(self) -> list[int] | None:
        return [] if self.only_stop_allowed() else None

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens to append without sampling (the module's jump-forward
        modes), worked out on a fork: the row's matcher does not move."""
        if self.jumps is None or limit <= 0 or self.matcher.is_terminated():
            return []
        if self.jumps.mode == "tokens":  # the row's own mask (filled for its next step)
            allowed = self.allowed_tokens(limit=1)
            if allowed is None or len(allowed) != 1 or allowed[0] in self.stop_token_ids:
                return []
        elif not self.matcher.find_jump_forward_string():
            return []  # nothing forced (the common case inside a free value): no fork
        probe = self.fork()
        return self.jumps.walk(probe, limit)

    def complete(self, tokens: Sequence[int]) -> None:
        assert not tokens, "a grammar row jumps forward only to its end"

    def result(self, text: str) -> tuple[str | None, str | None]:
        """(None, None) when the text is complete under the grammar, else (None, why not)."""
        if not self.can_end():
            what = "regex" if self.kind == "regex" else "JSON schema"
            return None, f"the output is not valid: it stopped before its {what} was complete"
        if self.kind == "json_schema":
            try:
                json.loads(text)
            except json.JSONDecodeError as error:
                return None, f"the output is not valid JSON: {error}"
        return None, None


class _Jumps:
    """One tokenizer's jump-forward: the mode and the forced strings' tokens (cached)."""

    def __init__(self, mode: str, tokenize, decoded_vocab: Sequence[bytes]) -> None:
        self.mode = mode
        self.tokenize = tokenize  # text -> token ids, as the model's tokenizer splits it
        self.decoded_vocab = decoded_vocab  # token id -> its bytes (xgrammar's view)
        self._tokens: dict[str, list[int]] = {}

    def tokens_of(self, text: str) -> list[int]:
        tokens = self._tokens.get(text)
        if tokens is None:
            if len(self._tokens) > 4096:
                self._tokens.clear()
            tokens = self._tokens[text] = list(self.tokenize(text))
        return tokens

    def walk(self, probe: GrammarState, limit: int) -> list[int]:
        """Forced tokens from the probe's state on (the probe accepts them)."""
        forced: list[int] = []
        while len(forced) < limit and not probe.matcher.is_terminated():
            before = len(forced)
            text = probe.matcher.find_jump_forward_string()
            if not text:
                break
            if self.mode == "text":
                self._forced_text(probe, text, forced, limit)
            if len(forced) == before:  # "tokens", or no text token could be kept
                allowed = probe.allowed_tokens(limit=1)
                if allowed is None or len(allowed) != 1 or allowed[0] in probe.stop_token_ids:
                    break
                if not probe.matcher.accept_token(allowed[0]):
                    break
                probe._filled = False
                forced.append(allowed[0])
        return forced

    def _forced_text(self, probe: GrammarState, text: str, forced: list[int], limit: int) -> None:
        """The forced text's tokens, all but a last one that the next text could merge with."""
        tokens = self.tokens_of(text)
        for token in tokens[:-1]:
            if len(forced) == limit or not probe.matcher.accept_token(token):
                return
            probe._filled = False
            forced.append(token)
        if len(forced) == limit or not tokens:
            return
        last = tokens[-1]
        tail = self.decoded_vocab[last] if last < len(self.decoded_vocab) else b""
        allowed = probe.allowed_tokens(limit=_BOUNDARY_CHECK_LIMIT)
        if not tail or allowed is None:
            return
        for token in allowed:
            piece = self.decoded_vocab[token] if token < len(self.decoded_vocab) else b""
            if token in probe.stop_token_ids or not piece or not tail.startswith(piece):
                return  # a token the model might pick reaches past the forced text
        if probe.matcher.accept_token(last):
            probe._filled = False
            forced.append(last)


class Constraints:
    """Compiles constraints for one tokenizer (once per distinct constraint) and starts
    row states. vocab_size: the width of the model's logits."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Collection[int],
        *,
        jump_forward: str = "tokens",
    ) -> None:
        """jump_forward: ``"text"``, ``"tokens"`` or ``"off"`` (the module's doc); the
        attribute may be changed between runs (rows started after it take it)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.jump_forward = jump_forward
        self._tokenizer_info = None
        self._jumps: dict[str, _Jumps] = {}
        self._tries: dict[tuple[str, ...], ChoiceTrie] = {}
        self._choice_tokens: dict[tuple[str, ...], list[list[int]]] = {}
        self._grammars: dict[tuple[str, str], object] = {}
        self._compiler = None

    @classmethod
    def for_model(cls, tokenizer, model_info, *, jump_forward: str = "tokens") -> Constraints:
        """Constraints for a model (``models.info.ModelInfo``): its logits' width (the
        text config's vocab_size, else the tokenizer's) and end-of-sequence ids."""
        config = model_info.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab_size = getattr(text, "vocab_size", None) or len(tokenizer)
        return cls(tokenizer, vocab_size, model_info.eos_token_ids, jump_forward=jump_forward)

    def start(self, params, *, ignore_eos: bool = False):
        """A row's constraint state, or None for an unconstrained row."""
        constraint = params.constraint
        if constraint is None:
            return None
        kind, value = constraint
        stops = () if ignore_eos else self.stop_token_ids
        if kind == "choices":
            return ChoiceState(self.trie(value), stops, jump=self._jump_mode() != "off")
        compiled = self.grammar(kind, value)
        return GrammarState(kind, compiled, self.vocab_size, stops, self.jumps())

    def jumps(self) -> _Jumps | None:
        """The grammars' jump-forward in the current ``jump_forward`` mode (None when off)."""
        mode = self._jump_mode()
        if mode == "off":
            return None
        jumps = self._jumps.get(mode)
        if jumps is None:
            self._grammar_compiler()
            tokenizer = self.tokenizer

            def tokenize(text: str) -> list[int]:
                return tokenizer(text, add_special_tokens=False)["input_ids"]

            vocab = self._tokenizer_info.decoded_vocab
            jumps = self._jumps[mode] = _Jumps(mode, tokenize, vocab)
        return jumps

    def _jump_mode(self) -> str:
        mode = self.jump_forward
        if mode not in JUMP_FORWARD_MODES:
            raise ValueError(f"jump_forward must be one of {JUMP_FORWARD_MODES}, got {mode!r}")
        return mode

    def trie(self, choices: tuple[str, ...]) -> ChoiceTrie:
        trie = self._tries.get(choices)
        if trie is None:
            trie = self._tries[choices] = ChoiceTrie(choices, self.choice_tokens(choices))
        return trie

    def choice_tokens(self, choices: tuple[str, ...]) -> list[list[int]]:
        """Each choice's tokens, as the output spells it (no special tokens); tokenized
        once per distinct choice list."""
        tokens = self._choice_tokens.get(choices)
        if tokens is None:
            tokens = self._choice_tokens[choices] = [
                self.tokenizer(c, add_special_tokens=False)["input_ids"] for c in choices
            ]
        return tokens

    def grammar(self, kind: str, value: str):
        compiled = self._grammars.get((kind, value))
        if compiled is None:
            compiler = self._grammar_compiler()
            if kind == "regex":
                compiled = compiler.compile_regex(value)
            else:
                # compact JSON: no free whitespace between tokens, which small models can
                # otherwise spend their whole max_tokens on
                compiled = compiler.compile_json_schema(value, any_whitespace=False)
            self._grammars[(kind, value)] = compiled
        return compiled

    def _grammar_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._tokenizer_info = info
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


def _xgrammar():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - a core dependency
        raise ImportError(
            "regex and json_schema need the xgrammar package: pip install xgrammar"
        ) from None
    return xgrammar


def _reason(error: Exception) -> str:
    """xgrammar's message without its source location prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def _is_set(bitmask: torch.Tensor, token: int) -> bool:
    word = int(bitmask[0, token // 32])
    return bool((word >> (token % 32)) & 1)
