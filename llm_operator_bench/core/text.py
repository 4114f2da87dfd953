"""A seeded generator of natural-looking English for benchmark prompts.

Sentences come from hand-written templates per topic whose ``{slot}`` placeholders are filled
from small word lists (products, features, names, places, numbers, dates ...). Every function
takes an explicit ``random.Random``; the same generator state gives the same text, and nothing
here keeps module-level mutable state.

Token lengths are measured by a caller-supplied ``CountTokens``: a function that returns the
token count of each text in a list (one batched tokenizer call), so "N tokens" means tokens of
the caller's model.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "CATEGORY_PRODUCTS",
    "TOPICS",
    "CountTokens",
    "fill_template",
    "paragraph",
    "pick",
    "sentence",
    "sentence_with_slots",
    "sentences_with_tokens",
    "text_with_tokens",
    "words",
]

CountTokens = Callable[[Sequence[str]], list[int]]
"""Token count of each given text (no special tokens), in order."""


# -- word lists (comma-separated, parsed once into tuples) --------------------------------
def _split(items: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in items.split(","))


CATEGORY_PRODUCTS: dict[str, tuple[str, ...]] = {
    "kitchen": _split("blender, coffee maker, electric kettle, rice cooker, toaster"),
    "audio": _split("wireless headphones, bluetooth speaker, soundbar, turntable, earbuds"),
    "outdoor": _split("camping tent, hiking backpack, sleeping bag, headlamp, water filter"),
    "office": _split("standing desk, office chair, laptop stand, desk lamp, keyboard"),
    "home": _split("robot vacuum, air purifier, smart thermostat, security camera, heater"),
    "fitness": _split("running shoes, yoga mat, smart watch, rowing machine, kettlebell"),
}
_WORDS: dict[str, tuple[str, ...]] = {
    "product": sum(CATEGORY_PRODUCTS.values(), ()),
    "feature": _split(
        "battery life, sound quality, build quality, screen, setup process, companion app, "
        "design, fit, warranty, packaging, charging speed, grip, weight, display, "
        "touch controls, fabric, motor, lid"
    ),
    "praise": _split(
        "excellent, solid, impressive, reliable, comfortable, quiet, sturdy, intuitive, "
        "well made, easy to use"
    ),
    "complaint": _split(
        "disappointing, flimsy, confusing, too loud, unreliable, overpriced, uncomfortable, "
        "slow, poorly made, hard to clean"
    ),
    "first": _split(
        "Maria, James, Aisha, Tomasz, Yuki, Carlos, Priya, Liam, Fatima, Oskar, Mei, Daniel, "
        "Sofia, Kwame, Elena, Noah, Ingrid, Ravi"
    ),
    "last": _split(
        "Lopez, Okafor, Nowak, Tanaka, Singh, Berg, Moreau, Khan, Silva, Fischer, Chen, "
        "Murphy, Rossi, Haddad, Larsen, Kim, Mensah, Ortiz"
    ),
    "city": _split(
        "Lisbon, Denver, Osaka, Nairobi, Toronto, Lyon, Melbourne, Austin, Krakow, Seoul, "
        "Dublin, Porto, Chicago, Bergen, Valencia, Pune"
    ),
    "company": _split(
        "Northwind Supply, Brightline Labs, Cedar and Stone, Bluepeak Outfitters, "
        "Harbor Analytics, Maple Street Foods, Quantum Freight, Silverleaf Health, "
        "Redwood Software, Atlas Home Goods, Juniper Bank, Orbit Mobility"
    ),
    "brand": _split(
        "Aldenware, Brightforge, Calloway, Dunmore, Everline, Fjordic, Greyhaven, Halcyon, "
        "Ironbark, Juno, Kestrel, Lumen, Meridian, Northpeak, Oakridge, Pellucid, Quillon, "
        "Rivermark, Solstice, Tidewell"
    ),
    "model": _split("Pro, Lite, Max, Air, One, Plus, Mini, Go, Studio, Core"),
    "policy": _split(
        "remote work, expense, data retention, travel, password, parental leave, "
        "vendor onboarding, incident response, refund, equipment loan"
    ),
    "component": _split(
        "ingestion service, billing pipeline, cache layer, search index, nightly export job, "
        "authentication gateway, message queue, reporting dashboard, storage cluster, "
        "recommendation model"
    ),
    "metric": _split("latency, error rate, memory usage, disk usage, queue depth, CPU load"),
    "team": _split("finance, legal, platform, data, support, marketing, security"),
    "relative": _split("sister, father, roommate, neighbor, colleague, grandmother"),
    "month": _split(
        "January, February, March, April, May, June, July, August, September, October, "
        "November, December"
    ),
    "weekday": _split("Monday, Tuesday, Wednesday, Thursday, Friday, Saturday"),
    "screen": _split("settings, checkout, profile, order history, search"),
    "code": _split("SAVE10, SPRING20, WELCOME5, FREESHIP, LOYAL15"),
    "material": _split("aluminum, steel, bamboo, recycled plastic, glass, oak"),
    "color": _split("black, white, navy, sage green, sand, charcoal, red"),
}
_NUMBERS: dict[str, Callable[[random.Random], str]] = {
    "number": lambda r: str(r.randint(2, 12)),
    "days": lambda r: str(r.randint(2, 30)),
    "hours": lambda r: str(r.randint(2, 48)),
    "percent": lambda r: str(r.randint(3, 95)),
    "count": lambda r: str(r.randint(20, 900)),
    "year": lambda r: str(r.randint(2018, 2025)),
    "weight": lambda r: str(r.randint(120, 4800)),
    "card": lambda r: f"{r.randint(0, 9999):04d}",
    "price": lambda r: f"${r.randint(9, 499)}.{r.choice(('00', '49', '99'))}",
    "order": lambda r: f"#{r.randint(10000, 99999)}",
    "version": lambda r: f"{r.randint(1, 9)}.{r.randint(0, 20)}.{r.randint(0, 9)}",
    "error": lambda r: r.choice(("500", "403", "E-1042", "E-2271", "timeout")),
    "date": lambda r: f"{r.choice(_WORDS['month'])} {r.randint(1, 28)}",
    "name": lambda r: f"{r.choice(_WORDS['first'])} {r.choice(_WORDS['last'])}",
}

# -- sentence templates -------------------------------------------------------------------
_PRAISE = (
    "The {product} works exactly as described and the {feature} is {praise}.",
    "I have used this {product} every day for {days} days and it still feels {praise}.",
    "Setup took less than {number} minutes, and the {feature} is {praise}.",
    "My {relative} loved the {product} so much that we ordered a second one.",
    "For {price}, the {feature} beats models that cost twice as much.",
    "Delivery to {city} was fast and the {product} arrived well packed.",
    "Honestly, the {feature} surprised me; it is {praise} for a {product} at this price.",
    "Support in {city} replaced a missing part within {days} days.",
    "Five stars from me.",
    "It does the job well.",
    "Great {product}, no complaints so far.",
)
_COMPLAINT = (
    "The {feature} of the {product} is {complaint}, which I did not expect at {price}.",
    "After {days} days the {product} stopped working and the {feature} is {complaint}.",
    "I contacted support about order {order} twice and nobody replied.",
    "The {product} arrived with a scratch on the side and a missing cable.",
    "Returning it was {complaint}; the label only printed after {number} attempts.",
    "My old {product} lasted years, but this one feels {complaint} from day one.",
    "The instructions skip a step, so assembly took {hours} hours.",
    "Not worth the money.",
    "The {feature} broke within a week.",
)
_MIXED = (
    "The {product} is fine for occasional use, though the {feature} could be better.",
    "It looks like the photos, nothing more and nothing less.",
    "I bought the {product} in {month} as a gift for my {relative}.",
    "The {feature} is {praise}, but the {feature2} is {complaint}.",
    "It is an average {product}.",
)
_SUPPORT = {
    "billing": (
        "I was charged twice for order {order} on {date}.",
        "My invoice for {month} shows {price} instead of the price on the website.",
        "Please refund the duplicate payment to the card ending in {card}.",
        "The discount code {code} did not apply at checkout.",
        "Can you explain the extra fee of {price} on my last statement?",
    ),
    "shipping": (
        "My package for order {order} has been stuck in {city} for {days} days.",
        "The courier marked order {order} as delivered, but nothing arrived.",
        "Can I change the delivery address to {city} after the order has shipped?",
        "Two of the {number} items in my box arrived broken.",
        "The tracking page has not updated since {weekday}.",
    ),
    "account": (
        "I cannot log in since I changed my password on {date}.",
        "My account was locked after {number} failed attempts, but I did not try to log in.",
        "Please close my account and delete the data linked to it.",
        "The reset link in the email expired before I could use it.",
        "Please stop sending marketing emails; I unsubscribed on {date}.",
    ),
    "technical": (
        "The app crashes every time I open the {screen} page on version {version}.",
        "The {product} does not connect to Wi-Fi after the latest update.",
        "Since {weekday}, the dashboard takes {number} seconds to load.",
        "Error {error} appears when I try to export my data.",
        "The {feature} on my {product} resets itself every few hours.",
    ),
}
_SUPPORT_GENERAL = (
    "Hello, this is {name} from {city}.",
    "Thanks in advance for your help.",
    "I have written about this {number} times already.",
    "I need an answer before {weekday}, please.",
)
_TEMPLATES: dict[str, tuple[str, ...]] = {
    "praise": _PRAISE,
    "complaint": _COMPLAINT,
    "review": _PRAISE + _COMPLAINT + _MIXED,
    **{f"support-{team}": lines for team, lines in _SUPPORT.items()},
    "support": sum(_SUPPORT.values(), ()) + _SUPPORT_GENERAL,
    "policy": (
        "Under the {policy} policy, staff must submit requests at least {days} days in advance.",
        "Managers approve {policy} exceptions only with written sign-off from the {team} team.",
        "The policy applies to all staff in {city} from {date}, {year}.",
        "Requests above {price} require a second approval.",
        "Records related to {policy} requests are kept for {number} months and then deleted.",
        "Contractors follow the same rules unless their agreement says otherwise.",
        "Questions about this policy go to the {team} team, who answer within {days} days.",
        "Violations are reviewed case by case and may lead to the loss of {policy} privileges.",
        "The {year} revision shortened the approval window from {days} to {days2} days.",
        "Each team lead reviews the {policy} log on the first {weekday} of every month.",
    ),
    "technical": (
        "The {component} handles about {count} thousand events per minute at peak load.",
        "The {component} writes its output to the {component2} every {number} minutes.",
        "When {metric} rises above {percent} percent, the on-call engineer is paged.",
        "Version {version} of the {component} reduced {metric} by {percent} percent.",
        "The {team} team owns the {component} and reviews its alerts each {weekday}.",
        "A failed deployment on {date} rolled back automatically within {number} minutes.",
        "Configuration changes must pass a staging test before they reach production.",
        "Logs from the {component} are retained for {days} days.",
        "The {component} retries a failed request {number} times with exponential backoff.",
        "During the incident on {date}, {metric} on the {component} doubled for {hours} hours.",
    ),
    "company": (
        "{company} opened a new office in {city} in {month} {year}.",
        "Revenue from the {product} line grew by {percent} percent last quarter.",
        "{company} now employs about {count} people in {number} countries.",
        "The board appointed {name} as head of {team} on {date}.",
        "Customer satisfaction has improved for {number} months in a row.",
        "{company} plans to bring its {product} range to {city} next year.",
        "A partnership with {company2} will speed up delivery to customers in {city}.",
        "{name}, who leads the {team} team, said the results beat expectations.",
        "The company expects to hire {number} engineers in {city} before the end of {year}.",
    ),
    "product": (
        "The {product} has a {material} body and weighs {weight} grams.",
        "It comes with a {number}-month warranty and a {color} carrying case.",
        "Its {feature} is designed for daily use at home or in the office.",
        "A single charge lasts about {hours} hours under normal use.",
        "The box includes a quick start guide, a cable and spare parts.",
        "It is available in {color}, {color2} and {color3}.",
        "The {feature} can be adjusted from the companion app.",
        "Spare parts are easy to order.",
        "It was tested by {count} customers before launch.",
        "The design won a regional award in {year}.",
    ),
}
TOPICS: tuple[str, ...] = tuple(_TEMPLATES)
"""Valid ``topic`` values."""

_SLOT = re.compile(r"\{([a-z]+)(\d*)\}")


def pick(rng: random.Random, slot: str) -> str:
    """A random value for one slot kind (e.g. ``"name"``, ``"city"``, ``"price"``)."""
    if slot in _NUMBERS:
        return _NUMBERS[slot](rng)
    if slot in _WORDS:
        return rng.choice(_WORDS[slot])
    raise ValueError(
        f"unknown slot {slot!r}; choose from {', '.join(sorted(_WORDS) + sorted(_NUMBERS))}"
    )


def words(slot: str) -> tuple[str, ...]:
    """The word list of one slot kind (e.g. ``"brand"``, ``"model"``); ValueError if unknown."""
    if slot not in _WORDS:
        raise ValueError(f"slot={slot!r} has no word list; choose from {', '.join(sorted(_WORDS))}")
    return _WORDS[slot]


def _templates(topic: str) -> tuple[str, ...]:
    if topic not in _TEMPLATES:
        raise ValueError(f"topic={topic!r} is unknown; choose from {', '.join(TOPICS)}")
    return _TEMPLATES[topic]


def fill_template(
    rng: random.Random, template: str, fixed: Mapping[str, str] | None = None
) -> tuple[str, dict[str, str]]:
    """``template`` with its ``{slot}`` placeholders filled, and the slot values used.

    ``fixed`` pins slot values (e.g. ``{"product": "blender"}``); a slot used twice gets one
    value; ``feature2``, ``city2`` ... get a value different from ``feature``, ``city`` when
    the word list allows. The first letter is capitalised.
    """
    values: dict[str, str] = dict(fixed or {})

    def fill(match: re.Match[str]) -> str:
        key = match.group(1) + match.group(2)
        if key not in values:
            base = match.group(1)
            taken = {v for k, v in values.items() if k.rstrip("0123456789") == base}
            value = pick(rng, base)
            for _ in range(8):
                if value not in taken:
                    break
                value = pick(rng, base)
            values[key] = value
        return values[key]

    text = _SLOT.sub(fill, template)
    return text[:1].upper() + text[1:], values


def sentence_with_slots(
    rng: random.Random, topic: str, fixed: Mapping[str, str] | None = None
) -> tuple[str, dict[str, str]]:
    """One sentence on ``topic`` and the slot values it used (e.g. ``{"order": "#12345"}``)."""
    return fill_template(rng, rng.choice(_templates(topic)), fixed)


def sentence(rng: random.Random, topic: str, fixed: Mapping[str, str] | None = None) -> str:
    """One sentence on ``topic`` (see ``TOPICS``); ValueError on an unknown topic."""
    return sentence_with_slots(rng, topic, fixed)[0]


def paragraph(
    rng: random.Random,
    topic: str,
    sentences: int | None = None,
    fixed: Mapping[str, str] | None = None,
) -> str:
    """``sentences`` sentences on ``topic`` (3 to 6 when None), joined by spaces."""
    count = rng.randint(3, 6) if sentences is None else sentences
    return " ".join(sentence(rng, topic, fixed) for _ in range(count))


def sentences_with_tokens(
    rng: random.Random,
    topic: str,
    target_tokens: int,
    count_tokens: CountTokens,
    *,
    fixed: Mapping[str, str] | None = None,
    candidates: int = 3,
) -> list[str]:
    """Sentences whose space-joined text has at least ``target_tokens`` tokens.

    Sentences are appended until the count reaches the target, stopping at the first one
    that reaches it, so the text overshoots by less than one sentence. Each step draws
    ``candidates`` sentences (measured in one ``count_tokens`` call): the first one while
    all fit in what is still missing, else the one whose length is closest to it. A template
    is not reused until the topic's templates run out. Returns [] when ``target_tokens <= 0``.
    """
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1, got {candidates!r}")
    templates = _templates(topic)
    used: set[str] = set()
    chosen: list[str] = []
    total = 0
    while total < target_tokens:
        if len(used) == len(templates):
            used = set()
        fresh = [t for t in templates if t not in used]
        drawn = [rng.choice(fresh) for _ in range(candidates)]
        options = [fill_template(rng, template, fixed)[0] for template in drawn]
        counts = count_tokens([" " + o if chosen else o for o in options])
        missing = target_tokens - total
        best = 0
        if max(counts) >= missing:
            best = min(range(candidates), key=lambda i: (abs(missing - counts[i]), i))
        used.add(drawn[best])
        chosen.append(options[best])
        total += counts[best]
        if total >= target_tokens:  # sums can differ from the joined text; measure it
            total = count_tokens([" ".join(chosen)])[0]
    return chosen


def text_with_tokens(
    rng: random.Random,
    topic: str,
    target_tokens: int,
    count_tokens: CountTokens,
    *,
    fixed: Mapping[str, str] | None = None,
) -> str:
    """``sentences_with_tokens`` joined by spaces: about ``target_tokens`` tokens of text."""
    return " ".join(sentences_with_tokens(rng, topic, target_tokens, count_tokens, fixed=fixed))
