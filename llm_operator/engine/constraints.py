"""Constrained outputs: a row's next-token mask, applied in the sampling step (the
docs' guide "Constrained outputs" has the user's view).

- ``choices``: a token trie over the tokenized choices (``ChoiceTrie``). The mask allows
  the children of the row's node, and the end-of-sequence tokens where a choice ends.
- ``regex`` and ``json_schema``: xgrammar compiles each distinct constraint once against
  the tokenizer (JSON compact: no free whitespace); a ``GrammarMatcher`` per row yields
  the token bitmask each step.

A decided choice, or a grammar that allows nothing but the end, ends the row at once.
Jump-forward inside an output (``Constraints.jump_forward``; a state's ``forced`` gives the
tokens the run appends without sampling, which the backend feeds in the row's next step):

- ``"tokens"`` (the default): only a token the mask leaves alone (one allowed token, not
  an end token), so outputs are token for token those of stepping;
- ``"text"`` (SGLang's): the text the grammar forces (``find_jump_forward_string``) is
  tokenized with the model's tokenizer, which may split it otherwise than the model
  would. The row's sampled tokens are never re-split, and the forced text's last token
  is kept only when no token the grammar then allows reaches past it (``"`` before a
  string value, which ``"adults`` could merge with); else the model samples that
  boundary. Choices always jump as in ``"tokens"``, and to their end;
- ``"off"``: no jump inside an output.

``Constraints`` (one per operator) compiles and caches; ``start(params)`` gives a row's
state, which the ``Run`` masks logits with and feeds the accepted tokens.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Collection, Sequence

import torch

NO_CHOICE = -1
JUMP_FORWARD_MODES = ("text", "tokens", "off")
_BOUNDARY_CHECK_LIMIT = 256  # allowed tokens inspected at a forced text's end; more: not kept


def check_regex(regex: str) -> None:
    """ValueError naming the regex when the grammar engine cannot compile it."""
    _check_compiles(lambda grammar: grammar.from_regex(regex), f"regex {regex!r}")


def check_json_schema(schema: str) -> None:
    """ValueError naming the schema when the grammar engine cannot compile it."""
    _check_compiles(lambda grammar: grammar.from_json_schema(schema), "json_schema")


def _check_compiles(build: Callable, what: str) -> None:
    grammar = _xgrammar().Grammar
    try:
        build(grammar)
    except RuntimeError as error:
        raise ValueError(f"{what} cannot be compiled: {_reason(error)}") from None


class ChoiceTrie:
    """Nodes of the tokenized choices: ``children[node][token] -> node``; ``ends[node]``
    is the index of the choice that ends there (NO_CHOICE when none)."""

    def __init__(self, choices: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        self.choices = tuple(choices)
        self.token_ids = token_ids  # each choice's tokens
        self.children: list[dict[int, int]] = [{}]
        self.ends: list[int] = [NO_CHOICE]
        for index, ids in enumerate(token_ids):
            if not ids:
                raise ValueError(f"choice {choices[index]!r} has no tokens")
            node = 0
            for token in ids:
                if token not in self.children[node]:
                    self.children[node][token] = len(self.children)
                    self.children.append({})
                    self.ends.append(NO_CHOICE)
                node = self.children[node][token]
            if self.ends[node] != NO_CHOICE:
                other = choices[self.ends[node]]
                raise ValueError(
                    f"choices {other!r} and {choices[index]!r} have the same tokens; give "
                    "choices that differ as text the tokenizer keeps apart"
                )
            self.ends[node] = index

    def walk(self, node: int, limit: float = math.inf) -> tuple[list[int], int]:
        """The tokens of lone children from ``node`` on while no choice ends there (up to
        ``limit``), and the node they reach."""
        tokens: list[int] = []
        while (
            len(tokens) < limit and self.ends[node] == NO_CHOICE and len(self.children[node]) == 1
        ):
            ((token, node),) = self.children[node].items()
            tokens.append(token)
        return tokens, node

    def tail(self, node: int) -> list[int] | None:
        """The tokens from ``node`` to the one choice it leads to, or None when more than
        one choice (or stopping here) is still possible."""
        tokens, node = self.walk(node)
        return tokens if self.ends[node] != NO_CHOICE and not self.children[node] else None


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
        return [] if self.chosen != NO_CHOICE else self.trie.tail(self.node)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the trie forces next (a lone child where no choice ends;
        the only token the mask allows), without moving the row."""
        if self.chosen != NO_CHOICE or not self.jump:
            return []
        return self.trie.walk(self.node, limit)[0]

    def fork(self) -> ChoiceState:
        """A copy that walks on without moving this one."""
        return copy.copy(self)

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
        twin = copy.copy(self)
        twin.matcher, twin.bitmask, twin._filled = self.matcher.fork(), self.bitmask.clone(), False
        return twin

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

    def advance(self, token: int) -> bool:
        """Accept ``token`` if the grammar allows it; whether it did."""
        if not self.matcher.accept_token(token):
            return False
        self._filled = False
        return True

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

    def lone_token(self) -> int | None:
        """The one token the mask allows now, unless it ends the row (or more are allowed)."""
        allowed = self.allowed_tokens(limit=1)
        return allowed[0] if allowed and allowed[0] not in self.stop_token_ids else None

    def can_end(self) -> bool:
        if self.matcher.is_terminated():
            return True
        self._fill()
        words = self.bitmask[0]
        return any((int(words[t // 32]) >> (t % 32)) & 1 for t in self.stop_token_ids)

    def remaining(self) -> list[int] | None:
        return [] if self.only_stop_allowed() else None

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens to append without sampling (the module's jump-forward
        modes), worked out on a fork: the row's matcher does not move."""
        if self.jumps is None or limit <= 0 or self.matcher.is_terminated():
            return []
        if self.jumps.mode == "tokens":  # the row's own mask (filled for its next step)
            if self.lone_token() is None:
                return []
        elif not self.matcher.find_jump_forward_string():
            return []  # nothing forced (the common case inside a free value): no fork
        return self.jumps.walk(self.fork(), limit)

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
        if text not in self._tokens:
            if len(self._tokens) > 4096:
                self._tokens.clear()
            self._tokens[text] = list(self.tokenize(text))
        return self._tokens[text]

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
                token = probe.lone_token()
                if token is None or not probe.advance(token):
                    break
                forced.append(token)
        return forced

    def _forced_text(self, probe: GrammarState, text: str, forced: list[int], limit: int) -> None:
        """The forced text's tokens, all but a last one that the next text could merge with."""
        tokens = self.tokens_of(text)
        for token in tokens[:-1]:
            if len(forced) == limit or not probe.advance(token):
                return
            forced.append(token)
        if len(forced) == limit or not tokens:
            return
        tail = self._bytes(tokens[-1])
        allowed = probe.allowed_tokens(limit=_BOUNDARY_CHECK_LIMIT)

        def inside(token: int) -> bool:  # a token the model might pick ends inside the text
            piece = self._bytes(token)
            return token not in probe.stop_token_ids and bool(piece) and tail.startswith(piece)

        if tail and allowed is not None and all(map(inside, allowed)) and probe.advance(tokens[-1]):
            forced.append(tokens[-1])

    def _bytes(self, token: int) -> bytes:
        return self.decoded_vocab[token] if token < len(self.decoded_vocab) else b""


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
        if mode != "off" and mode not in self._jumps:
            self._grammar_compiler()
            self._jumps[mode] = _Jumps(mode, self._tokenize, self._tokenizer_info.decoded_vocab)
        return self._jumps.get(mode)

    def _jump_mode(self) -> str:
        mode = self.jump_forward
        if mode not in JUMP_FORWARD_MODES:
            raise ValueError(f"jump_forward must be one of {JUMP_FORWARD_MODES}, got {mode!r}")
        return mode

    def _tokenize(self, text: str) -> list[int]:
        """The tokens of ``text`` as the output spells it (no special tokens)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def trie(self, choices: tuple[str, ...]) -> ChoiceTrie:
        if choices not in self._tries:
            self._tries[choices] = ChoiceTrie(choices, [self._tokenize(c) for c in choices])
        return self._tries[choices]

    def choice_tokens(self, choices: tuple[str, ...]) -> list[list[int]]:
        """Each choice's tokens, as the output spells it (tokenized once per choice list)."""
        return self.trie(choices).token_ids

    def grammar(self, kind: str, value: str):
        if (kind, value) not in self._grammars:
            compiler = self._grammar_compiler()
            # compact JSON: no free whitespace between tokens, which small models can
            # otherwise spend their whole max_tokens on
            self._grammars[(kind, value)] = (
                compiler.compile_regex(value)
                if kind == "regex"
                else compiler.compile_json_schema(value, any_whitespace=False)
            )
        return self._grammars[(kind, value)]

    def _grammar_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info)
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
