"""What goes over the wire to an OpenAI-compatible server, and what is read back.

``api="completions"`` (the default on a vLLM server) sends the token ids the plan was built
from (chat template applied here), so the server computes exactly the planned tokens;
``api="chat"`` sends the rows' messages (a string prompt as one user message). A server
of kind "vllm" (``client.Served.kind``) also takes vLLM's extra fields
(``return_token_ids``, ``structured_outputs``, ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``prompt_logprobs``, ``logprob_token_ids``), asked for as
``engine.vllm.driver`` asks its engine; other servers only the API's own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from llm_operator.engine.openai.client import Served
from llm_operator.engine.run import Request, Run
from llm_operator.engine.vllm.driver import request_seed, scoring_prompt, structured_outputs

CANNOT_CONSTRAIN = (
    "{what}: the model server at {url} is not a vLLM server, and an OpenAI-compatible "
    "server constrains outputs only with a JSON schema on the chat API (api='chat'); "
    "serve the model with vLLM, or drop the constraint"
)


class BadAnswer(Exception):
    """An answer without what the request asked for."""


class Completion(NamedTuple):
    token_ids: list[int]
    finish_reason: str
    text: str
    token_logprobs: list[float] | None


def check_run(run: Run, kind: str, api: str, url: str = "") -> None:
    """ValueError before any row is sent when the server cannot do what rows ask."""
    if kind == "vllm" and api == "completions":
        return
    for request in run.requests:
        constraint = request.params.constraint
        if request.forced is not None or (request.params.logprobs and constraint is not None):
            raise ValueError(
                "choice scores and constrained log-probabilities need a vLLM server's "
                f"prompt log-probabilities and api='completions' (here api={api!r})"
            )
        if kind == "vllm" and constraint is not None and constraint[0] != "json_schema":
            raise ValueError(
                f"{constraint[0]}: with api='chat' only json_schema is sent (as "
                "response_format); use api='completions'"
            )
        if constraint is not None and not (constraint[0] == "json_schema" and api == "chat"):
            raise ValueError(CANNOT_CONSTRAIN.format(what=constraint[0], url=url or "this url"))


def request_body(
    served: Served, api: str, request: Request, run: Run, max_context: int
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) generating one planned request."""
    params = request.params
    prompt = list(request.planned.token_ids)
    max_tokens = max(1, min(params.max_tokens, max_context - len(prompt)))
    body: dict[str, Any] = {"model": served.model, "max_tokens": int(max_tokens), "stream": False}
    body["temperature"] = float(params.temperature)
    if params.top_p < 1:
        body["top_p"] = float(params.top_p)
    if params.stop:
        body["stop"] = list(params.stop)
    if (seed := request_seed(request)) is not None:  # the same in any batch or partition
        body["seed"] = seed % 2**63
    constraint = params.constraint
    if params.logprobs and constraint is None:
        body["logprobs"] = 0 if api == "completions" else True
    if served.kind == "vllm":
        body["return_token_ids"] = True
        if params.top_k:
            body["top_k"] = int(params.top_k)
        if params.ignore_eos:
            body["ignore_eos"] = True
        elif run.eos_token_ids:
            body["stop_token_ids"] = sorted(run.eos_token_ids)
        if constraint is not None and api == "completions":
            body["structured_outputs"] = structured_outputs(*constraint)
    if api == "completions":
        return "/completions", {**body, "prompt": prompt}
    if run.sources is None:
        raise ValueError("api='chat' needs the rows' prompts (run through LLMOperator.generate)")
    source = run.sources[request.request_id]
    body["messages"] = (
        [{"role": "user", "content": source}]
        if isinstance(source, str)
        else [dict(message) for message in source]
    )
    if constraint is not None:  # json_schema (check_run refused the others)
        schema = {"name": "row", "schema": json.loads(constraint[1]), "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return "/chat/completions", body


def scoring_body(model: str, prompt: Sequence[int], tokens: Sequence[int]) -> dict[str, Any]:
    """A vLLM completion scoring ``tokens`` after ``prompt`` (``driver.scoring_prompt``):
    one greedy step reporting the last token's log-probability, and the prompt's
    log-probabilities for the others."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": scoring_prompt(prompt, tokens),
        "max_tokens": 1,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "logprob_token_ids": [int(tokens[-1])],
        "return_tokens_as_token_ids": True,
    }
    if len(tokens) > 1:
        body["prompt_logprobs"] = 0
    return body


def scored_logprob(answer: dict[str, Any], prompt_length: int, tokens: Sequence[int]) -> float:
    """The log-probability of ``tokens`` after ``prompt_length`` prompt tokens, from the
    answer to ``scoring_body``."""
    choice = _choice(answer)
    total = 0.0
    if len(tokens) > 1:
        entries = choice.get("prompt_logprobs")
        for position, token in enumerate(tokens[:-1], start=prompt_length):
            entry = (entries or [None] * (position + 1))[position] or {}
            value = entry.get(str(int(token)))
            if value is None:
                raise BadAnswer(f"no prompt log-probability for position {position}")
            total += float(value["logprob"] if isinstance(value, dict) else value)
    top = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0] or {}
    last = top.get(f"token_id:{int(tokens[-1])}")
    if last is None:
        raise BadAnswer("no log-probability for the scored token")
    return total + float(last)


def read_answer(answer: dict[str, Any], api: str, tokenizer) -> Completion:
    """The completion of a generation answer: token ids (vLLM's, else the text's
    tokenization), finish reason, text, and the sampled tokens' log-probabilities."""
    choice = _choice(answer)
    logprobs = choice.get("logprobs") or {}
    if api == "completions":
        text = choice.get("text") or ""
        token_logprobs = logprobs.get("token_logprobs")
    else:
        text = (choice.get("message") or {}).get("content") or ""
        entries = logprobs.get("content")
        token_logprobs = None if entries is None else [entry["logprob"] for entry in entries]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
    reason = choice.get("finish_reason") or "stop"
    if reason not in ("stop", "length"):
        raise BadAnswer(f"the server ended the row: {reason}")
    return Completion(list(token_ids), reason, text, token_logprobs)


def sum_logprobs(completion: Completion, count: int) -> float:
    """The log-probability of the first ``count`` tokens of a completion."""
    if completion.token_logprobs is None:
        raise BadAnswer("no log-probabilities in the answer")
    return float(sum(float(value or 0.0) for value in completion.token_logprobs[:count]))


def _choice(answer: dict[str, Any]) -> dict[str, Any]:
    try:
        return answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise BadAnswer(f"no choices in the answer: {str(answer)[:200]}") from None
