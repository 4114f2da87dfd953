"""Sampling parameters: how to pick each next token, and when to stop.

Importing this module imports neither torch nor xgrammar (a Spark or Dask driver builds
``SamplingParams`` without them); the sampler itself is ``llm_operator.engine.sampler``.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_operator.option_fields import (
    boolean,
    check_fields,
    cli_text,
    distinct_strings,
    documented,
    integer,
    json_schema_text,
    json_text_or_file,
    non_negative,
    option,
    optional,
    probability_mass,
    regex_pattern,
    split_commas,
    stop_strings,
)

CONSTRAINTS = ("choices", "regex", "json_schema")


@documented
@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop."""

    max_tokens: int = option(64, doc="most tokens to generate", check=integer(1))
    temperature: float = option(
        0.0,
        doc="0 is greedy; otherwise logits are divided by it",
        check=non_negative,
        cli_type=float,
    )
    top_p: float = option(
        1.0,
        doc="nucleus sampling mass in (0, 1]; 1 keeps every token",
        check=probability_mass,
        cli_type=float,
    )
    top_k: int = option(
        0, doc="keep the k most likely tokens; 0 keeps every token", check=integer(0)
    )
    # a string or a list of strings, kept as a tuple
    stop: tuple[str, ...] = option(
        (),
        doc="strings that end generation (the text stops before them)",
        check=stop_strings,
        cli="append",
        cli_type=cli_text,
    )
    seed: int | None = option(
        None,
        doc="makes sampling reproducible per row, in any batch, partition or retry",
        check=optional(integer(None)),
    )
    ignore_eos: bool = option(
        False, doc="keep generating past the end-of-sequence token", check=boolean, cli="flag"
    )
    # a list of strings, kept as a tuple
    choices: tuple[str, ...] | None = option(
        None,
        doc="the output is exactly one of these strings (a token trie; decided rows stop at once)",
        check=distinct_strings("string"),
        cli_type=split_commas,
    )
    regex: str | None = option(
        None, doc="the output matches this regular expression", check=regex_pattern
    )
    # a dict or JSON text, kept as JSON text
    json_schema: str | None = option(
        None,
        doc="the output is JSON valid under this schema (a dict or JSON text; CLI: inline JSON or a file)",
        check=json_schema_text,
        cli_type=json_text_or_file,
    )
    logprobs: bool = option(
        False,
        doc="return the log-probability of the output under the unconstrained model (and, "
        "with choices, of every choice)",
        check=boolean,
        cli="flag",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of choices, regex and json_schema; got {' and '.join(given)}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, object] | None:
        """("choices" | "regex" | "json_schema", its value), or None when unconstrained."""
        for name in CONSTRAINTS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None
