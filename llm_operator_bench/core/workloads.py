"""Deterministic benchmark workloads: prompts whose sharing structure is known by design.

    etl-fewshot  G tasks x D rows; each task's system prompt, instructions and few-shot turns
                 form one first-level prefix (BatchLLM's shape); rows arrive task by task
    doc-qa       one system prompt for all, then N documents asked K questions each (two levels)
    table-rows   a product/review table rendered field by field (Liu et al. 2024); the field
                 order decides how much is shared ("shared-first" or the "schema" order)
    short-rows   a ratings table in the shape of MovieLens (genre, film, user) under one
                 instruction: rows of a few tokens of their own, sharing three levels deep
    no-sharing   plain-string prompts that share no leading tokens (a control)
    long-answers doc-qa's shape with long documents and long answers: decode-heavy, EOS
                 ignored (``Workload.ignore_eos``) so every system decodes the same lengths
    classify     many short rows over a few labelling tasks (3-6 labels each), rows of the
                 tasks interleaved; each row carries its task's labels (``Workload.choices``)
                 and the label its input was written for (``Workload.gold``); free
                 generation ends at a newline (``Workload.stop``)

``make_workload(name, tokenizer, size=..., seed=..., **overrides)`` is a pure function of its
arguments: the tokenizer only measures text lengths, so "N tokens" means tokens of that model
(message contents only; chat-template tokens come on top). Tune sizes in ``PRESETS``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from llm_operator_bench.core import text
from llm_operator_bench.core.text import CountTokens

__all__ = [
    "DEFAULT_WORKLOADS",
    "IGNORE_EOS_WORKLOADS",
    "PRESETS",
    "SIZES",
    "WORKLOAD_NAMES",
    "WORKLOAD_SUMMARIES",
    "Workload",
    "make_workload",
    "shared_first_order",
]

Range = tuple[int, int]
# Token parameters are (lo, hi) ranges drawn uniformly; counts are plain ints.
# tiny: whole prompt (chat template included) <= ~150 tokens of the test tokenizer, 6-12 rows;
# quick: ~2-3k SmolLM2 prompt tokens per workload (about 2 minutes for the HF systems); default: ~20-30k (no-sharing: ~10k, unshared).
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "etl-fewshot": {
        "tiny": dict(groups=2, rows_per_group=4, prefix_tokens=(45, 60), input_tokens=(4, 10), max_tokens=(2, 6)),
        "quick": dict(groups=2, rows_per_group=4, prefix_tokens=(300, 360), input_tokens=(30, 60), max_tokens=(8, 24)),
        "default": dict(groups=3, rows_per_group=12, prefix_tokens=(400, 700), input_tokens=(30, 200), max_tokens=(16, 100)),
    },
    "doc-qa": {
        "tiny": dict(documents=2, questions_per_document=3, system_tokens=12, document_tokens=(30, 40), question_tokens=(6, 10), max_tokens=(2, 6)),
        "quick": dict(documents=2, questions_per_document=3, system_tokens=60, document_tokens=(300, 360), question_tokens=(10, 30), max_tokens=(8, 24)),
        "default": dict(documents=4, questions_per_document=6, system_tokens=80, document_tokens=(600, 900), question_tokens=(10, 30), max_tokens=(16, 100)),
    },
    "table-rows": {
        "tiny": dict(rows=8, categories=2, brands_per_category=1, products_per_brand=2, description_tokens=(4, 8), review_tokens=(4, 8), max_tokens=(2, 6), field_order="shared-first"),
        "quick": dict(rows=10, categories=2, brands_per_category=2, products_per_brand=2, description_tokens=(60, 90), review_tokens=(30, 60), max_tokens=(8, 24), field_order="shared-first"),
        "default": dict(rows=40, categories=3, brands_per_category=2, products_per_brand=2, description_tokens=(220, 320), review_tokens=(100, 220), max_tokens=(16, 100), field_order="shared-first"),
    },
    "short-rows": {
        "tiny": dict(rows=12, genres=2, films_per_genre=2, max_tokens=(1, 2)),
        "quick": dict(rows=48, genres=3, films_per_genre=3, max_tokens=(1, 2)),
        "default": dict(rows=480, genres=4, films_per_genre=6, max_tokens=(1, 2)),
    },
    "no-sharing": {
        "tiny": dict(rows=8, prompt_tokens=(50, 90), max_tokens=(2, 6)),
        "quick": dict(rows=8, prompt_tokens=(150, 250), max_tokens=(8, 24)),
        "default": dict(rows=32, prompt_tokens=(200, 400), max_tokens=(16, 100)),
    },
    "long-answers": {  # rows finish at different lengths, so decode batches shrink over the run
        "tiny": dict(documents=2, questions_per_document=3, system_tokens=12, document_tokens=(30, 40), question_tokens=(10, 14), max_tokens=(16, 24)),
        "quick": dict(documents=2, questions_per_document=3, system_tokens=60, document_tokens=(300, 400), question_tokens=(20, 40), max_tokens=(48, 64)),
        "default": dict(documents=2, questions_per_document=8, system_tokens=80, document_tokens=(1200, 1800), question_tokens=(20, 40), max_tokens=(192, 320)),
    },
    "classify": {  # max_tokens: a task's longest label in tokens plus extra_tokens
        "tiny": dict(tasks=2, rows=8, prefix_tokens=(45, 60), min_examples=1, input_tokens=(4, 10), extra_tokens=1),
        "quick": dict(tasks=4, rows=64, prefix_tokens=(200, 300), min_examples=6, input_tokens=(15, 40), extra_tokens=2),
        "default": dict(tasks=4, rows=2000, prefix_tokens=(300, 450), min_examples=6, input_tokens=(15, 60), extra_tokens=2),
    },
}  # fmt: skip
WORKLOAD_NAMES = (
    "etl-fewshot",
    "doc-qa",
    "table-rows",
    "short-rows",
    "no-sharing",
    "long-answers",
    "classify",
)
DEFAULT_WORKLOADS = WORKLOAD_NAMES[:-1]
"""What ``--workloads`` runs when not given: every workload but classify (thousands of rows:
``--workloads classify`` or ``all`` asks for it)."""
WORKLOAD_SUMMARIES = {
    "etl-fewshot": "tasks x rows; each task's system prompt, instructions and few-shot turns "
    "form one shared prefix (BatchLLM's shape)",
    "doc-qa": "one system prompt for all, then documents asked several questions each "
    "(two levels of sharing)",
    "table-rows": "a product/review table rendered field by field; the field order decides "
    "how much is shared",
    "short-rows": "ratings rows of a few tokens each under one instruction, grouped by "
    "genre and film (three levels of sharing, little of each row its own)",
    "no-sharing": "plain-string prompts that share no leading tokens (a control)",
    "long-answers": "doc-qa's shape with long documents and long answers: decode-heavy, "
    "EOS ignored",
    "classify": "short rows (2,000 at the default size) over four labelling tasks (3-6 "
    "labels, a shared "
    "instruction prefix each); free generation stops at a newline, the *-choices systems "
    "constrain each row to its task's labels; agreement with the label each input was "
    "written for (not run unless named: --workloads classify)",
}
"""One line per workload, for ``llm-operator bench --help`` (the module doc has more)."""
IGNORE_EOS_WORKLOADS = frozenset({"long-answers"})
"""Workloads whose rows decode exactly their max_tokens (every system runs with ignore_eos)."""
# large: the default sizes but etl-fewshot with 4 tasks of 32 rows (128 rows; the Gemma 3
# 270M comparison in docs/benchmarks.md)
for _presets in PRESETS.values():
    _presets["large"] = dict(_presets["default"])
PRESETS["etl-fewshot"]["large"].update(groups=4, rows_per_group=32)
SIZES = ("tiny", "quick", "default", "large")
_CHOICES = {"field_order": ("shared-first", "schema")}


@dataclass(frozen=True)
class Workload:
    """One benchmark batch: prompts in input order and one decode budget per prompt."""

    name: str
    prompts: list
    """Each a str or a chat message list ``[{"role": ..., "content": ...}]``."""
    max_tokens: list[int]
    params: dict
    """JSON-ready: every size parameter (ranges as [lo, hi]), ``size`` and ``seed``."""
    description: str
    ignore_eos: bool = False
    """Rows keep decoding past EOS up to their max_tokens (fixed decode lengths)."""
    stop: tuple[str, ...] = ()
    """Stop strings every system's free generation ends at."""
    choices: list[list[str]] | None = None
    """Per row, the labels its task allows (systems with ``choices`` constrain to them)."""
    gold: list[str] | None = None
    """Per row, the label its input was written for (agreement is measured against it)."""
    table: list[dict[str, str]] | None = None
    """table-rows: each row's fields (in the schema order ``TABLE_SCHEMA``) before rendering."""


def make_workload(
    name: str, tokenizer: Any, *, size: str = "default", seed: int = 0, **overrides: Any
) -> Workload:
    """Build workload ``name`` at preset ``size`` with ``overrides`` replacing size parameters.

    Deterministic for equal (name, size, seed, overrides, tokenizer). Raises ValueError for
    an unknown name, size or override, or a bad override value (the message lists the valid
    choices). ``tokenizer`` is only called on text pieces to count their tokens.
    """
    if name not in PRESETS:
        raise ValueError(
            f"workload name={name!r} is unknown; choose from {', '.join(WORKLOAD_NAMES)}"
        )
    if size not in SIZES:
        raise ValueError(f"size={size!r} is unknown; choose from {', '.join(SIZES)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    params = _resolve(name, PRESETS[name][size], overrides)
    rng = random.Random(f"{name}/{seed}")
    count = _Tokens(tokenizer)
    if name == "classify":
        prompts, max_tokens, description, choices, gold = _classify(rng, count, params)
        labelled = dict(stop=CLASSIFY_STOP, choices=choices, gold=gold)
    else:
        prompts, max_tokens, description = _BUILDERS[name](rng, count, params)
        labelled = {}
    table = params.pop("_table", None)  # table-rows: the rows before rendering
    record = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
    record.update(size=size, seed=seed)
    return Workload(
        name,
        prompts,
        max_tokens,
        record,
        description,
        ignore_eos=name in IGNORE_EOS_WORKLOADS,
        table=table,
        **labelled,
    )


def _resolve(name: str, preset: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(preset))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for workload {name!r}; "
            f"valid: {', '.join(preset)}"
        )
    params = dict(preset)
    for key, value in overrides.items():
        default = preset[key]
        if key in _CHOICES:
            if value not in _CHOICES[key]:
                raise ValueError(
                    f"{key}={value!r} is invalid; choose from {', '.join(_CHOICES[key])}"
                )
        elif isinstance(default, tuple):
            pair = (value, value) if isinstance(value, int) else tuple(value)
            if len(pair) != 2 or not all(_positive_int(v) for v in pair) or pair[0] > pair[1]:
                raise ValueError(
                    f"{key}={value!r} must be an int >= 1 or a range (lo, hi), 1 <= lo <= hi"
                )
            value = pair
        elif not _positive_int(value):
            raise ValueError(f"{key}={value!r} must be an int >= 1")
        params[key] = value
    if name == "classify" and params["tasks"] > len(_CLASSIFY_TASKS):
        raise ValueError(f"tasks={params['tasks']!r} must be <= {len(_CLASSIFY_TASKS)} here")
    if name == "table-rows":  # distinct categories, brands and (model, product) names
        limits = dict(categories=len(text.CATEGORY_PRODUCTS), products_per_brand=50)
        limits["brands_per_category"] = len(text.words("brand")) // params["categories"]
        for key, limit in limits.items():
            if params[key] > limit:
                raise ValueError(f"{key}={params[key]!r} must be <= {limit} here")
    return params


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class _Tokens:
    """A ``CountTokens`` over a tokenizer (no special tokens): one batched call, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}

    def ids(self, texts: Sequence[str]) -> list[list[int]]:
        missing = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if missing:
            found = self.tokenizer(missing, add_special_tokens=False)["input_ids"]
            self.cache.update(zip(missing, map(list, found)))
        return [self.cache[t] for t in texts]

    def __call__(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self.ids(texts)]


def _draw(rng: random.Random, bounds: Range) -> int:
    return rng.randint(bounds[0], bounds[1])


def _append_while_under(
    head: str, pieces: Sequence[str], limit: float, count: CountTokens
) -> tuple[str, int]:
    """``head`` plus the leading ``pieces`` (space-joined) while the total stays <= limit."""
    used = count([head])[0]
    for piece, tokens in zip(pieces, count([" " + p for p in pieces])):
        if used + tokens > limit:
            break
        head, used = f"{head} {piece}", used + tokens
    return head, used


def _input_text(rng: random.Random, topic: str, target: int, count: _Tokens) -> str:
    """About ``target`` tokens on ``topic``, about one product (reviews name a single one)."""
    return text.text_with_tokens(
        rng, topic, target, count, fixed={"product": text.pick(rng, "product")}
    )


def _unique(make: Callable[[], str], seen: set[str], attempts: int = 50) -> str:
    """``make()`` redrawn until it is not in ``seen`` (at most ``attempts`` times); recorded."""
    made = make()
    for _ in range(attempts - 1):
        if made not in seen:
            break
        made = make()
    seen.add(made)
    return made


def _chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# -- etl-fewshot --------------------------------------------------------------------------
_MONEY, _ORDER = re.compile(r"\$\d+\.\d\d"), re.compile(r"#\d{5}")
_DATE = re.compile(
    r"(?:January|February|March|April|May|June|July|August|September|October|November|December) \d+"
)
Answer = Callable[[random.Random, str], str]


def _label(mapping: dict[str, str]) -> Callable[[random.Random], tuple[str, Answer]]:
    """A classification task: draw a label, write an input on its topic, answer the label."""

    def draw(rng: random.Random) -> tuple[str, Answer]:
        label = rng.choice(sorted(mapping))
        return mapping[label], lambda _rng, _text: label

    return draw


def _fixed(topic: str, answer: Answer) -> Callable[[random.Random], tuple[str, Answer]]:
    return lambda rng: (topic, answer)


def _first_sentence(text_: str) -> str:
    return re.split(r"(?<=[.?!])\s", text_, maxsplit=1)[0]


def _extract(_rng: random.Random, text_: str) -> str:
    found = {
        key: pattern.search(text_)
        for key, pattern in (("order", _ORDER), ("date", _DATE), ("amount", _MONEY))
    }
    return (
        "{"
        + ", ".join(f'"{k}": ' + (f'"{m.group(0)}"' if m else "null") for k, m in found.items())
        + "}"
    )


# (name, persona, instruction, input label, draw(rng) -> (input topic, answer(rng, text)), rules)
_TASKS: tuple[tuple[str, str, str, str, Callable[[random.Random], tuple[str, Answer]], tuple[str, ...]], ...] = (
    ("sentiment", "You classify customer reviews.", "Answer positive, negative or neutral.", "Review",
     _label({"positive": "praise", "negative": "complaint", "neutral": "review"}),
     ("Judge the overall tone, not single sentences.", "A review that praises and criticises in equal measure is neutral.", "Delivery problems count only when they are the main point.")),
    ("ticket-routing", "You route support tickets.", "Answer billing, shipping, account or technical.", "Ticket",
     _label({team: f"support-{team}" for team in ("billing", "shipping", "account", "technical")}),
     ("Pick the team that can solve the main problem.", "Refunds and discount codes belong to billing.", "Login and password problems belong to account.")),
    ("field-extraction", "You extract fields from customer messages.", "Return JSON with the keys order, date and amount.", "Message",
     _fixed("support", _extract),
     ("Use null for a field the message does not mention.", "Copy values exactly as written, including the # of order numbers.", "Report only the first value of each field.")),
    ("summarization", "You summarise internal documents.", "Write a one-sentence summary.", "Text",
     lambda rng: (rng.choice(("company", "technical", "policy")), lambda _rng, t: _first_sentence(t)),
     ("Keep the summary under twenty-five words.", "Lead with the most important fact.", "Keep names, numbers and dates exactly as written.")),
    ("tone-rewrite", "You rewrite complaints politely.", "Rewrite the message in a calm, friendly tone.", "Complaint",
     _fixed("complaint", lambda _rng, t: f"Hello, I would appreciate your help. {_first_sentence(t)} Thank you."),
     ("Keep every fact of the original message.", "Remove insults and exaggerations.", "Start with a greeting and end with a thank-you.")),
    ("quality-check", "You moderate product reviews.", "Answer publish or reject, then a short reason.", "Review",
     _fixed("review", lambda rng, t: "reject: it contains an order number" if _ORDER.search(t) else rng.choice(("publish: clear and on topic", "publish: specific and polite"))),
     ("Reject reviews that contain order numbers or personal data.", "Short reviews may be published if they are on topic.", "Harsh but fair criticism is allowed.")),
    ("urgency-rating", "You rate the urgency of support tickets.", "Answer with a number from 1 to 5.", "Ticket",
     _label({"5": "support-account", "4": "support-billing", "3": "support-shipping", "2": "support-technical"}),
     ("Five means the customer cannot use the service at all.", "Money charged by mistake is at least four.", "One means a question that can wait a week.")),
    ("topic-tagging", "You tag internal documents by topic.", "Answer policy, technical or company news.", "Document",
     _label({"policy": "policy", "technical": "technical", "company news": "company"}),
     ("Choose the tag that fits most of the text.", "Announcements about people or offices are company news.", "Rules that staff must follow are policy.")),
)  # fmt: skip
_COMPANY_KINDS = ("Foods", "Logistics", "Health", "Bank", "Retail", "Software", "Energy", "Travel")
_GENERAL_RULES = (
    "Answer only in the requested format.",
    "Do not repeat the input.",
    "Treat every input on its own.",
    "Never invent facts that are not in the input.",
    "If the input is unreadable, answer unknown.",
    "Leave personal data out of the answer.",
)


def _etl_fewshot(
    rng: random.Random, count: _Tokens, p: dict[str, Any]
) -> tuple[list, list[int], str]:
    groups, rows = p["groups"], p["rows_per_group"]
    lo, hi = p["max_tokens"]
    budgets = (
        rng.sample(range(lo, hi + 1), groups)
        if hi - lo + 1 >= groups
        else [_draw(rng, p["max_tokens"]) for _ in range(groups)]
    )
    # With more groups than tasks, each system prompt opens with its own employer, so the
    # groups of a repeated task still part right after "You work for" (up to 20 groups).
    brands = rng.sample(text.words("brand"), len(text.words("brand")))
    prompts: list = []
    max_tokens: list[int] = []
    for group in range(groups):
        _name, persona, instruction, field, draw, rules = _TASKS[group % len(_TASKS)]
        target = _draw(rng, p["prefix_tokens"])
        employer = f"{brands[group % len(brands)]} {rng.choice(_COMPANY_KINDS)}"
        head = f"{persona} {instruction}"
        if groups > len(_TASKS):
            head = f"You work for {employer}. {head}"
        system, used = _append_while_under(head, rules + _GENERAL_RULES, 0.3 * target, count)
        prefix = [{"role": "system", "content": system}]
        while used < target or len(prefix) == 1:  # few-shot turns fill the rest, at least one
            topic, answer = draw(rng)
            want = max(1, min(_draw(rng, p["input_tokens"]), target - used - 8))
            user = f"{field}: {_input_text(rng, topic, want, count)}"
            reply = answer(rng, user)
            used += sum(count([user, reply]))
            prefix += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        seen: set[str] = set()
        for _ in range(rows):
            topic, _answer = draw(rng)
            length = _draw(rng, p["input_tokens"])
            row = _unique(partial(_input_text, rng, topic, length, count), seen)
            prompts.append([*prefix, {"role": "user", "content": f"{field}: {row}"}])
            max_tokens.append(budgets[group])
    tasks = ", ".join(_TASKS[g % len(_TASKS)][0] for g in range(min(groups, len(_TASKS))))
    description = (
        f"{groups} few-shot tasks ({tasks}) x {rows} rows: each task's system prompt, "
        f"instructions and examples (~{p['prefix_tokens'][0]}-{p['prefix_tokens'][1]} tokens) "
        "are shared by its rows, then a short per-row input"
    )
    return prompts, max_tokens, description


# -- doc-qa -------------------------------------------------------------------------------
_DOCUMENTS = {  # topic: (slot pinned for the whole document, title template, questions)
    "policy": ("policy", "{policy} policy", (
        "How many days in advance must staff submit a {policy} request?", "Who approves exceptions to the {policy} policy?",
        "How long are {policy} records kept?", "Which team answers questions about the {policy} policy?",
        "Does the {policy} policy apply to contractors?", "What changed in the latest revision?", "Which requests need a second approval?")),
    "technical": ("component", "{component} operations guide", (
        "Which team owns the {component}?", "How long are logs from the {component} kept?", "What happens when {metric} rises too high?",
        "How often does the {component} retry a failed request?", "What happened during the last incident?",
        "How many events per minute does the {component} handle?", "Which version reduced {metric}?")),
    "company": ("company", "{company} quarterly update", (
        "Where did {company} open its new office?", "How much did revenue grow last quarter?", "Who was appointed to lead a team?",
        "How many people does {company} employ?", "What are the hiring plans of {company}?", "Which partnership does the update mention?",
        "What did the team lead say about the results?")),
}  # fmt: skip
_QUESTION_TAILS = (
    "Answer in one sentence.",
    "Quote the sentence that supports your answer.",
    "If the document does not say, answer that it is not stated.",
    "Keep the answer under twenty words.",
    "Include any number or date exactly as written.",
    "Say which paragraph you used.",
)
_DOC_RULES = (
    "Use only the document you are given.",
    "If the document does not contain the answer, say that it is not stated.",
    "Quote numbers and dates exactly as written.",
    "Answer in plain sentences without lists.",
    "Never guess a name that the document does not mention.",
)


def _doc_qa(
    rng: random.Random,
    count: _Tokens,
    p: dict[str, Any],
    tails: Sequence[str] = _QUESTION_TAILS,
) -> tuple[list, list[int], str]:
    """Documents under one system prompt, each asked questions lengthened by ``tails``."""
    head = "You answer questions about company documents."
    system, used = _append_while_under(head, _DOC_RULES, p["system_tokens"], count)
    if used < p["system_tokens"]:
        system += " " + text.text_with_tokens(rng, "company", p["system_tokens"] - used, count)
    # Each document is about its own policy / component / company (drawn without replacement
    # while the word list lasts), so titles differ from their first token on.
    unused = {slot: [] for slot, _, _ in _DOCUMENTS.values()}
    prompts: list = []
    for index in range(p["documents"]):
        topic = tuple(_DOCUMENTS)[index % len(_DOCUMENTS)]
        slot, title_template, questions = _DOCUMENTS[topic]
        unused[slot] = unused[slot] or rng.sample(text.words(slot), len(text.words(slot)))
        fixed = {slot: unused[slot].pop()}
        title, _ = text.fill_template(rng, title_template, fixed)
        body = text.sentences_with_tokens(
            rng, topic, _draw(rng, p["document_tokens"]) - count([title])[0], count, fixed=fixed
        )
        paragraphs = [" ".join(body[i : i + 5]) for i in range(0, len(body), 5)]
        document = "\n\n".join([title, *paragraphs])
        asked: set[str] = set()
        for _ in range(p["questions_per_document"]):
            for _attempt in range(20):  # distinct questions while the templates allow
                question, _ = text.fill_template(rng, rng.choice(questions), fixed)
                target = _draw(rng, p["question_tokens"])
                for tail in rng.sample(tails, len(tails)):
                    if count([question])[0] >= target:
                        break
                    question += " " + tail
                if question not in asked:
                    break
            asked.add(question)
            prompts.append(_chat(system, f"Document:\n{document}\n\nQuestion: {question}"))
    max_tokens = [_draw(rng, p["max_tokens"]) for _ in prompts]
    description = (
        f"{p['documents']} documents (~{p['document_tokens'][0]}-{p['document_tokens'][1]} tokens) x "
        f"{p['questions_per_document']} questions under one shared system prompt: two sharing levels"
    )
    return prompts, max_tokens, description


# -- long-answers -------------------------------------------------------------------------
_LONG_ANSWER_TAILS = (
    "Explain your answer in detail.",
    "Walk through every paragraph that is relevant, one by one.",
    "Then summarise the whole document in a few paragraphs.",
    "List every related fact, number and date the document gives.",
    "Describe what the document says before and after that point.",
    "Finish with the open questions the document leaves.",
)


def _long_answers(
    rng: random.Random, count: _Tokens, p: dict[str, Any]
) -> tuple[list, list[int], str]:
    """doc-qa's prompts with questions that ask for long answers (decoded with EOS ignored)."""
    prompts, max_tokens, _ = _doc_qa(rng, count, p, tails=_LONG_ANSWER_TAILS)
    description = (
        f"{p['documents']} long documents (~{p['document_tokens'][0]}-{p['document_tokens'][1]} "
        f"tokens) x {p['questions_per_document']} questions asking for long answers of "
        f"{p['max_tokens'][0]}-{p['max_tokens'][1]} tokens, EOS ignored (decode-heavy)"
    )
    return prompts, max_tokens, description


# -- table-rows ---------------------------------------------------------------------------
_SCHEMA = ("review", "rating", "category", "brand", "product", "description")
_TABLE_INSTRUCTION = "Does the reviewer recommend it? Answer yes or no."
TABLE_SCHEMA, TABLE_INSTRUCTION = _SCHEMA, _TABLE_INSTRUCTION  # for bench/suites/fields.py
_SENTIMENT_RATINGS = {"praise": (4, 5), "complaint": (1, 2), "review": (3, 3)}


def shared_first_order(table: Sequence[dict[str, str]], fields: Sequence[str]) -> list[str]:
    """Fields with fewer distinct values first: greedily, the field that adds the fewest
    distinct value combinations to the fields already placed (so a field that another one
    determines follows it), ties broken by longer values, then by ``fields`` order.

    A cheap stand-in for Liu et al.'s GGR: it puts the columns that rows share in front.
    """
    keys: list[tuple[str, ...]] = [() for _ in table]
    order: list[str] = []
    remaining = list(fields)
    while remaining:
        costs = {
            field: (
                len({(*key, row[field]) for key, row in zip(keys, table)}),
                -sum(len(row[field]) for row in table) / max(len(table), 1),
                position,
            )
            for position, field in enumerate(fields)
            if field in remaining
        }
        best = min(remaining, key=costs.__getitem__)
        order.append(best)
        remaining.remove(best)
        keys = [(*key, row[best]) for key, row in zip(keys, table)]
    return order


def _render(row: dict[str, str], fields: Sequence[str]) -> str:
    return "\n".join(f"{field.capitalize()}: {row[field]}" for field in fields)


def _table_rows(
    rng: random.Random, count: _Tokens, p: dict[str, Any]
) -> tuple[list, list[int], str]:
    categories = rng.sample(sorted(text.CATEGORY_PRODUCTS), p["categories"])
    brands = iter(rng.sample(text.words("brand"), p["categories"] * p["brands_per_category"]))
    products: list[dict[str, str]] = []
    for category in categories:
        for brand in [next(brands) for _ in range(p["brands_per_category"])]:
            pairs = [(m, n) for m in text.words("model") for n in text.CATEGORY_PRODUCTS[category]]
            for model, noun in rng.sample(pairs, p["products_per_brand"]):
                length = _draw(rng, p["description_tokens"])
                about = {"product": noun}
                description = text.text_with_tokens(rng, "product", length, count, fixed=about)
                name = f"{brand} {model} {noun}"
                products.append(dict(category=category, brand=brand, product=name, noun=noun))
                products[-1]["description"] = description
    assignment = [products[i % len(products)] for i in range(p["rows"])]  # several rows per product
    rng.shuffle(assignment)
    table: list[dict[str, str]] = []
    reviews: set[str] = set()
    for product in assignment:
        sentiment = rng.choice(sorted(_SENTIMENT_RATINGS))
        length, about = _draw(rng, p["review_tokens"]), {"product": product["noun"]}
        review = _unique(
            partial(text.text_with_tokens, rng, sentiment, length, count, fixed=about), reviews
        )
        rating = f"{rng.randint(*_SENTIMENT_RATINGS[sentiment])}/5"
        table.append({**{f: product[f] for f in _SCHEMA[2:]}, "review": review, "rating": rating})
    fields = (
        shared_first_order(table, _SCHEMA) if p["field_order"] == "shared-first" else list(_SCHEMA)
    )
    p["fields"] = fields  # recorded in Workload.params
    p["_table"] = [{field: row[field] for field in _SCHEMA} for row in table]  # Workload.table
    prompts = [
        # No system message: the instruction and the record form one user turn (a model's
        # template may add its default system prompt, shared by every row).
        [{"role": "user", "content": _TABLE_INSTRUCTION + "\n\n" + _render(row, fields)}]
        for row in table
    ]
    max_tokens = [_draw(rng, p["max_tokens"]) for _ in prompts]
    description = (
        f"{p['rows']} rows of a product-review table ({len(products)} products) rendered field by "
        f"field in {p['field_order']} order ({', '.join(fields)})"
    )
    return prompts, max_tokens, description


# -- short-rows ---------------------------------------------------------------------------
_GENRES = ("Comedy", "Drama", "Thriller", "Animation", "Documentary", "Romance", "Western")
_TITLE_WORDS = (
    ("Silent", "Last", "Golden", "Broken", "Hidden", "Frozen", "Wild", "Midnight", "Paper"),
    ("River", "Garden", "Empire", "Letter", "Voyage", "Harbor", "Summer", "Promise", "Road"),
)
_OCCUPATIONS = ("teacher", "nurse", "student", "engineer", "farmer", "artist", "lawyer", "chef")
_SHORT_ROWS_INSTRUCTION = (
    "Predict the rating from 1 to 5 that this user gives the film. Answer with one digit."
)


def _short_rows(
    rng: random.Random, count: _Tokens, p: dict[str, Any]
) -> tuple[list, list[int], str]:
    """Rows (genre, film, user) in shuffled order; each row's own part is the user (age and
    occupation, a few tokens), so aligning shared segments to KV blocks would cost each row
    up to a block of recomputed tokens per level."""
    if p["genres"] > len(_GENRES):
        raise ValueError(f"genres={p['genres']!r} must be <= {len(_GENRES)} here")
    titles = [f"The {a} {b}" for a in _TITLE_WORDS[0] for b in _TITLE_WORDS[1]]
    films = [
        (genre, title, rng.randint(1950, 2024))
        for genre in rng.sample(_GENRES, p["genres"])
        for title in rng.sample(titles, p["films_per_genre"])
    ]
    prompts, seen = [], set()
    for row in range(p["rows"]):
        genre, title, year = films[row % len(films)]
        film = f"Genre: {genre}\nFilm: {title} ({year})\nUser: "

        def draw(film: str = film) -> str:
            return f"{film}{rng.randint(18, 80)}-year-old {rng.choice(_OCCUPATIONS)}"

        record = _unique(draw, seen)
        prompts.append([{"role": "user", "content": _SHORT_ROWS_INSTRUCTION + "\n\n" + record}])
    rng.shuffle(prompts)
    max_tokens = [_draw(rng, p["max_tokens"]) for _ in prompts]
    description = (
        f"{p['rows']} ratings rows of {len(films)} films in {p['genres']} genres under one "
        "instruction, each row's own part a user of a few tokens"
    )
    return prompts, max_tokens, description


# -- no-sharing ---------------------------------------------------------------------------
_NO_SHARING_TOPICS = ("review", "support", "policy", "technical", "company", "product")
_ENDINGS = (
    "Summarize the text above in one sentence.",
    "List the two most important facts in the text above.",
    "What is the main point of the text above? Answer in one sentence.",
    "Write a one-line title for the text above.",
)
_DISTINCT_LEADING_TOKENS = 3


def _no_sharing(
    rng: random.Random, count: _Tokens, p: dict[str, Any]
) -> tuple[list, list[int], str]:
    """Each prompt opens with a sentence whose first 3 tokens no other prompt starts with
    (redrawn up to 200 times, which suffices for hundreds of rows)."""
    openers: list[str] = []
    seen: set[tuple[int, ...]] = set()
    for row in range(p["rows"]):
        for attempt in range(200):
            topic = _NO_SHARING_TOPICS[(row + attempt) % len(_NO_SHARING_TOPICS)]
            opener = text.sentence(rng, topic)
            key = tuple(count.ids([opener])[0][:_DISTINCT_LEADING_TOKENS])
            if len(key) == _DISTINCT_LEADING_TOKENS and key not in seen:
                break
        seen.add(key)
        openers.append(opener)
    prompts: list = []
    for row, opener in enumerate(openers):
        topic = _NO_SHARING_TOPICS[row % len(_NO_SHARING_TOPICS)]
        ending = rng.choice(_ENDINGS)
        rest = _draw(rng, p["prompt_tokens"]) - sum(count([opener, "\n\n" + ending]))
        body = " ".join([opener, _input_text(rng, topic, rest, count)]).strip()
        prompts.append(f"{body}\n\n{ending}")
    max_tokens = [_draw(rng, p["max_tokens"]) for _ in prompts]
    description = (
        f"{p['rows']} unrelated plain-string prompts of ~{p['prompt_tokens'][0]}-"
        f"{p['prompt_tokens'][1]} tokens that share no prefix (a control)"
    )
    return prompts, max_tokens, description


# -- classify -----------------------------------------------------------------------------
CLASSIFY_STOP = ("\n",)
"""Where free generation of a classify row ends (the answer is one line)."""
Writer = Callable[[random.Random, _Tokens, int], str]


def _topic_writer(topic: str, *, about_product: bool = False) -> Writer:
    """About ``target`` tokens on ``topic`` (about one product when ``about_product``)."""

    def write(rng: random.Random, count: _Tokens, target: int) -> str:
        if about_product:
            return _input_text(rng, topic, target, count)
        return text.text_with_tokens(rng, topic, target, count)

    return write


def _mixed_review(rng: random.Random, count: _Tokens, target: int) -> str:
    """Praise and complaint sentences in turn, half the tokens each: a neutral review."""
    fixed = {"product": text.pick(rng, "product")}
    praise = text.sentences_with_tokens(rng, "praise", max(1, target // 2), count, fixed=fixed)
    complaint = text.sentences_with_tokens(
        rng, "complaint", max(1, target - target // 2), count, fixed=fixed
    )
    turns = [s for pair in zip(praise, complaint) for s in pair]
    longer = praise if len(praise) > len(complaint) else complaint
    return " ".join(turns + longer[len(turns) // 2 :])


def _category_review(category: str) -> Writer:
    """A review that names a product of ``category`` (``Product: <noun>`` on its first line)."""

    def write(rng: random.Random, count: _Tokens, target: int) -> str:
        noun = rng.choice(text.CATEGORY_PRODUCTS[category])
        tone = rng.choice(("praise", "complaint"))
        review = text.text_with_tokens(rng, tone, target, count, fixed={"product": noun})
        return f"{noun}\nReview: {review}"

    return write


# (name, persona, input field, {label: writer of an input with that label}, rules)
_CLASSIFY_TASKS: tuple[tuple[str, str, str, dict[str, Writer], tuple[str, ...]], ...] = (
    ("sentiment", "You classify customer reviews by sentiment.", "Review",
     {"positive": _topic_writer("praise", about_product=True),
      "negative": _topic_writer("complaint", about_product=True), "neutral": _mixed_review},
     ("Judge the overall tone, not single sentences.", "A review that praises and criticises in equal measure is neutral.")),
    ("ticket-routing", "You route customer support tickets to a team.", "Ticket",
     {team: _topic_writer(f"support-{team}") for team in ("billing", "shipping", "account", "technical")},
     ("Pick the team that can solve the main problem.", "Refunds and discount codes belong to billing.", "Login and password problems belong to account.")),
    ("product-category", "You sort product reviews into shop categories.", "Product",
     {category: _category_review(category) for category in text.CATEGORY_PRODUCTS},
     ("The product name decides the category, not the tone of the review.", "Headphones, speakers and earbuds are audio.")),
    ("document-topic", "You tag internal documents by topic.", "Document",
     {"policy": _topic_writer("policy"), "technical": _topic_writer("technical"), "company news": _topic_writer("company")},
     ("Choose the tag that fits most of the text.", "Rules that staff must follow are policy.", "Announcements about offices, people and results are company news.")),
)  # fmt: skip


def _classify(
    rng: random.Random, count: _Tokens, p: dict[str, Any]
) -> tuple[list, list[int], str, list[list[str]], list[str]]:
    """Rows of ``p["tasks"]`` tasks in turn (row i: task i % tasks), each input written for a
    label drawn uniformly; returns prompts, max_tokens, description, choices and gold."""
    tasks = _CLASSIFY_TASKS[: p["tasks"]]
    prefixes, budgets = [], []
    for _name, persona, field, writers, rules in tasks:
        labels = list(writers)
        target = _draw(rng, p["prefix_tokens"])
        head = f"{persona} Answer with exactly one of: {', '.join(labels)}."
        system, used = _append_while_under(head, rules + _GENERAL_RULES, 0.3 * target, count)
        prefix = [{"role": "system", "content": system}]
        # few-shot turns fill the rest, at least min_examples: every label once, then again
        shown = rng.sample(labels, len(labels))
        while used < target or len(prefix) <= 2 * p["min_examples"]:
            label = shown[(len(prefix) // 2) % len(shown)]
            want = max(1, min(_draw(rng, p["input_tokens"]), target - used - 8))
            user = f"{field}: {writers[label](rng, count, want)}"
            used += sum(count([user, label]))
            prefix += [{"role": "user", "content": user}, {"role": "assistant", "content": label}]
        prefixes.append(prefix)
        budgets.append(max(count(labels)) + p["extra_tokens"])
    seen: list[set[str]] = [set() for _ in tasks]
    prompts: list = []
    max_tokens: list[int] = []
    choices: list[list[str]] = []
    gold: list[str] = []
    for row in range(p["rows"]):
        task = row % len(tasks)
        _name, _persona, field, writers, _rules = tasks[task]
        label = rng.choice(list(writers))
        length = _draw(rng, p["input_tokens"])
        written = _unique(partial(writers[label], rng, count, length), seen[task])
        prompts.append([*prefixes[task], {"role": "user", "content": f"{field}: {written}"}])
        max_tokens.append(budgets[task])
        choices.append(list(writers))
        gold.append(label)
    names = ", ".join(f"{t[0]} ({len(t[3])} labels)" for t in tasks)
    description = (
        f"{p['rows']} short rows over {len(tasks)} labelling tasks in turn ({names}): each "
        f"task's system prompt, instructions and examples (~{p['prefix_tokens'][0]}-"
        f"{p['prefix_tokens'][1]} tokens) are shared by its rows; each input is written for "
        "one of its task's labels"
    )
    return prompts, max_tokens, description, choices, gold


_BUILDERS: dict[
    str, Callable[[random.Random, _Tokens, dict[str, Any]], tuple[list, list[int], str]]
] = {
    "etl-fewshot": _etl_fewshot,
    "doc-qa": _doc_qa,
    "table-rows": _table_rows,
    "short-rows": _short_rows,
    "no-sharing": _no_sharing,
    "long-answers": _long_answers,
}
