"""Prompts to token ids: input checks, chat templates, per-row sampling parameters.

A row that cannot run (null, empty, not a prompt, a bad chat message list, no tokens,
longer than the model's context) gets an error message instead of token ids; it never
fails the batch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from llm_operator.sampling import SamplingParams

Prompt = str | Sequence[Mapping[str, Any]]


class PreparedPrompts(NamedTuple):
    token_ids: list[list[int] | None]  # per input row; None for error rows
    params: list[SamplingParams]  # per input row
    errors: dict[int, str]  # input row -> why it cannot run
    seconds: float


def prepare_prompts(
    tokenizer, prompts: Sequence[Prompt], sampling, max_context: int
) -> PreparedPrompts:
    """Token ids per row (chat template applied), params per row, errors by row."""
    started = time.perf_counter()
    prompts = _as_list(prompts)
    params = params_per_row(sampling, len(prompts))
    errors: dict[int, str] = {}
    plain: dict[int, str] = {}
    chat: dict[int, str] = {}
    for row, prompt in enumerate(prompts):
        if prompt is None:
            errors[row] = "prompt is null"
        elif isinstance(prompt, str):
            if prompt == "":
                errors[row] = "prompt is empty"
            elif (problem := invalid_text(prompt)) is not None:
                errors[row] = f"prompt {problem}"
            else:
                plain[row] = prompt
        elif is_messages(prompt):
            try:
                chat[row] = render_chat(tokenizer, prompt)
            except ValueError as error:
                errors[row] = str(error)
        elif isinstance(prompt, (bytes, bytearray)):
            errors[row] = bytes_error(prompt)
        else:
            errors[row] = (
                f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}"
            )
    token_ids: list[list[int] | None] = [None] * len(prompts)
    for texts, special in ((plain, True), (chat, False)):
        if texts:
            encoded = tokenizer(list(texts.values()), add_special_tokens=special)["input_ids"]
            for row, ids in zip(texts, encoded):
                token_ids[row] = ids
    for row, ids in enumerate(token_ids):
        if ids is None:
            continue
        if len(ids) == 0:
            errors[row] = "prompt has no tokens"
        elif len(ids) > max_context:
            errors[row] = (
                f"prompt has {len(ids)} tokens, more than the model's context of {max_context}"
            )
        if row in errors:
            token_ids[row] = None
    return PreparedPrompts(token_ids, params, errors, time.perf_counter() - started)


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat messages need a chat template, and this model's tokenizer has none")
    for message in messages:
        if not isinstance(message.get("content"), str) or not isinstance(message.get("role"), str):
            raise ValueError("each chat message needs a string 'role' and a string 'content'")
        for key in ("role", "content"):
            problem = invalid_text(message[key])
            if problem is not None:
                raise ValueError(f"chat message {key} {problem}")
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
    except Exception as error:  # the template's own checks (e.g. role order)
        raise ValueError(f"chat template failed: {error}") from error


def bytes_error(value: bytes | bytearray) -> str:
    """Why a bytes prompt cannot run: where it is not UTF-8 (the file's encoding is
    another one), or that it is bytes at all."""
    try:
        bytes(value).decode("utf-8")
    except UnicodeDecodeError as error:
        return (
            f"prompt is not UTF-8 text: byte 0x{value[error.start]:02X} at byte {error.start}; "
            "the input is in another encoding (the CLI reads it with --encoding, for example "
            "--encoding latin-1)"
        )
    return "prompt is bytes, not text: decode it to a string"


def invalid_text(text: str) -> str | None:
    """Why ``text`` cannot be tokenized (a lone surrogate, which no UTF-8 text holds: what a
    JSON file with a bad ``\\ud800`` escape gives Python), or None when it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (
            f"is not valid text: it holds a lone surrogate "
            f"(U+{ord(text[error.start]):04X}) at character {error.start}"
        )
    return None


def as_chat(
    values: Sequence[Any],
    *,
    chat: bool | str = False,
    system: str | None = None,
    chat_template: bool = True,
) -> list[Any]:
    """The prompt options applied to column values: with ``chat`` (or a ``system``
    message) each non-empty string becomes a user message after the system one;
    ``chat="auto"`` does so when the model has a chat template (``chat_template``)."""
    if chat == "auto":
        chat = chat_template
    if not (chat or system is not None):
        return list(values)
    head = [{"role": "system", "content": system}] if system else []
    return [
        [*head, {"role": "user", "content": v}] if isinstance(v, str) and v else v for v in values
    ]


def is_messages(prompt: object) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (str, bytes))
        and len(prompt) > 0
        and all(isinstance(m, Mapping) for m in prompt)
    )


def params_per_row(sampling, rows: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * rows
    if isinstance(sampling, SamplingParams):
        return [sampling] * rows
    if isinstance(sampling, Sequence) and all(isinstance(p, SamplingParams) for p in sampling):
        if len(sampling) != rows:
            raise ValueError(
                f"sampling has {len(sampling)} SamplingParams for {rows} prompts; give one or one per prompt"
            )
        return list(sampling)
    raise TypeError(
        f"sampling must be a SamplingParams or a list of them, got {type(sampling).__name__}"
    )


def _as_list(prompts) -> list:
    if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        return list(prompts)
    if hasattr(prompts, "tolist"):  # numpy, pandas
        return prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise TypeError(
            f"prompts must be a list of strings or chat message lists, got {type(prompts).__name__}"
        )
    return list(prompts)
