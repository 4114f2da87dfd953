"""A JSON schema as a column type, and a row's JSON text as a value of that type.

``value_type(schema)`` maps the schema to a ``ValueType`` tree: Spark turns it into the
``value`` field's type (``spark.spark_value_type``), Dask keeps Python values. Supported:

- ``"type"``: string, integer (64-bit), number (double), boolean, array (with ``items``),
  object (with ``properties``; required or not, every field is nullable in the column);
- ``enum`` / ``const`` of one JSON type (their type when ``"type"`` is left out);
- null alternatives: ``"type": ["string", "null"]``, ``anyOf``/``oneOf`` of one schema and
  ``{"type": "null"}``; ``allOf`` of a single schema;
- ``$ref`` to a place in the same schema (``#/$defs/Name``, as pydantic writes), not
  recursive.

Keywords that only constrain values (``minLength``, ``maximum``, ``pattern``, ``format``,
``maxItems``, ...) or annotate (``title``, ``description``, ``default``) do not change the
type. Anything else that does (other ``anyOf``, ``not``, ``if``, ``prefixItems``,
``patternProperties``, a free-form object, ...) raises ValueError naming it and where it
is, unless ``untyped=True``: then that part is ``ANY`` (the parsed JSON as it is; Dask).

``parse_value(text, value_type)`` gives ``(value, None)`` or ``(None, why)``: the text
must be JSON whose every part fits its type (an integer where an integer is declared, a
required property present, an enum value among the enum's); nothing is coerced except an
integer where a number is declared (to a float) and an integral float where an integer is
declared. Properties the schema does not declare are left out of the value (the text
keeps them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

SCALARS = ("string", "integer", "number", "boolean")
KINDS = (*SCALARS, "array", "object", "any")
# keywords that change a value's type and that value_type does not handle (beyond the
# special cases above); every other keyword constrains or annotates only
STRUCTURAL = (
    "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "prefixItems",
    "patternProperties", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems",
    "additionalItems", "$dynamicRef", "$recursiveRef",
)  # fmt: skip
# keywords that give a type: a single-schema allOf beside them would have to be merged
TYPING = {"type", "properties", "items", "enum", "const", "$ref", "anyOf", "oneOf"}
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class ValueType:
    """One node of a schema's type. kind: one of KINDS; items: an array's element type;
    properties: an object's (name, type) pairs in schema order; required: the names that
    must be present; enum: the allowed values (None: any of the kind); nullable: JSON null
    is allowed."""

    kind: str
    items: ValueType | None = None
    properties: tuple[tuple[str, ValueType], ...] = ()
    required: frozenset[str] = frozenset()
    enum: tuple[Any, ...] | None = None
    nullable: bool = False

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"unknown kind {self.kind!r}"
        assert (self.items is not None) == (self.kind == "array"), "items iff an array"


ANY = ValueType("any", nullable=True)


def value_type(schema: str | Mapping[str, Any], *, untyped: bool = False) -> ValueType:
    """The schema's type (``schema``: a dict or JSON text). ValueError names any part
    that has no single type, and where it is, unless ``untyped`` (then that part is ANY)."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    if not isinstance(schema, Mapping):
        raise TypeError(f"json_schema must be a dict, got {type(schema).__name__}")
    return _Resolver(schema, untyped).node(schema, "json_schema", ())


class _Resolver:
    def __init__(self, root: Mapping[str, Any], untyped: bool) -> None:
        self.root = root
        self.untyped = untyped

    def fail(self, where: str, what: str) -> ValueType:
        if self.untyped:
            return ANY
        raise ValueError(
            f"{where}: {what}, so it has no column type for the typed value (see "
            "llm_operator.integrations.json_values); pass value=False to leave the value out"
        )

    def node(self, schema: Any, where: str, refs: tuple[str, ...]) -> ValueType:
        if schema is True or schema == {}:
            return self.fail(where, "a schema that allows any JSON has no type")
        if not isinstance(schema, Mapping):
            return self.fail(where, f"expected a schema object, got {schema!r:.60}")
        if "$ref" in schema:
            return self.reference(schema["$ref"], where, refs)
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                return self.null_alternative(schema, keyword, where, refs)
        if "allOf" in schema:
            parts = schema["allOf"]
            if isinstance(parts, list) and len(parts) == 1 and not set(schema) & TYPING:
                return self.node(parts[0], f"{where}.allOf[0]", refs)
            return self.fail(where, "'allOf' of more than one schema is not supported")
        for keyword in STRUCTURAL:
            if keyword in schema:
                return self.fail(where, f"'{keyword}' is not supported")
        kind, nullable, why = self.kind(schema)
        if kind is None:
            return self.fail(where, why)
        enum = self.enum(schema, kind, where)
        if kind == "array":
            if "items" not in schema or isinstance(schema["items"], (list, bool)):
                return self.fail(where, "an array needs one schema in items")
            items = self.node(schema["items"], f"{where}.items", refs)
            return ValueType("array", items=items, enum=enum, nullable=nullable)
        if kind == "object":
            properties = schema.get("properties")
            if not isinstance(properties, Mapping) or not properties:
                return self.fail(where, "an object needs properties (a free-form object)")
            required = schema.get("required", [])
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                return self.fail(where, f"required must be a list of names, got {required!r:.60}")
            fields = tuple(
                (str(name), self.node(sub, f"{where}.properties.{name}", refs))
                for name, sub in properties.items()
            )
            unknown = sorted(set(required) - set(properties))
            if unknown:
                return self.fail(where, f"required names undeclared properties {unknown}")
            return ValueType(
                "object", properties=fields, required=frozenset(required), nullable=nullable
            )
        return ValueType(kind, enum=enum, nullable=nullable or (enum is not None and None in enum))

    def kind(self, schema: Mapping[str, Any]) -> tuple[str | None, bool, str]:
        """(kind, nullable, ""), or (None, False, why there is no single kind)."""
        declared = schema.get("type")
        if declared is not None:
            names = [declared] if isinstance(declared, str) else declared
            kinds = [n for n in names if n != "null"] if isinstance(names, list) else []
            if len(kinds) != 1 or kinds[0] not in KINDS[:-1]:
                return (
                    None,
                    False,
                    f"type {declared!r} is not one of {', '.join(KINDS[:-1])} (or null)",
                )
            return kinds[0], "null" in names, ""
        if "properties" in schema:
            return "object", False, ""
        if "items" in schema:
            return "array", False, ""
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(values, list) and values:
            kinds = {_json_kind(v) for v in values} - {"null"}
            if kinds == {"integer", "number"}:
                kinds = {"number"}
            if len(kinds) == 1 and next(iter(kinds)) in SCALARS:
                return next(iter(kinds)), None in values, ""
            return None, False, f"enum values are not of one scalar type: {values!r:.80}"
        return None, False, "no type (give type, properties, items, enum or const)"

    def enum(self, schema: Mapping[str, Any], kind: str, where: str) -> tuple[Any, ...] | None:
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if values is None:
            return None
        if not isinstance(values, list) or not values:
            self.fail(where, f"enum must be a non-empty list, got {values!r:.60}")
            return None
        for value in values:
            if value is not None and not _fits_kind(value, kind):
                self.fail(where, f"enum value {value!r} is not of type {kind}")
                return None
        return tuple(values) if kind in SCALARS else None

    def null_alternative(
        self, schema: Mapping[str, Any], keyword: str, where: str, refs: tuple[str, ...]
    ) -> ValueType:
        options = schema[keyword]
        if not isinstance(options, list):
            return self.fail(where, f"{keyword} must be a list")
        typed = [o for o in options if not (isinstance(o, Mapping) and o.get("type") == "null")]
        if len(typed) != 1:
            return self.fail(where, f"'{keyword}' of more than one schema (besides null)")
        node = self.node(typed[0], f"{where}.{keyword}[{options.index(typed[0])}]", refs)
        if len(typed) == len(options) or node.nullable:
            return node
        return replace(node, nullable=True)

    def reference(self, ref: Any, where: str, refs: tuple[str, ...]) -> ValueType:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return self.fail(where, f"$ref {ref!r} does not point into this schema")
        if ref in refs:
            return self.fail(where, f"$ref {ref!r} is recursive")
        target: Any = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, Mapping) or part not in target:
                return self.fail(where, f"$ref {ref!r} points to nothing")
            target = target[part]
        return self.node(target, f"{where}({ref})", (*refs, ref))


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _fits_kind(value: Any, kind: str) -> bool:
    found = _json_kind(value)
    return found == kind or (kind == "number" and found == "integer")


# -- parsing a row's text --------------------------------------------------------------
class Mismatch(ValueError):
    """A JSON value that does not fit its type; the message says where and why."""


def parse_value(text: Any, value_type: ValueType) -> tuple[Any, str | None]:
    """(the typed value, None), or (None, why the text has none)."""
    if not isinstance(text, str):
        return None, "the output has no text"
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as error:
        return None, f"the output is not valid JSON: {error}"
    try:
        return convert(data, value_type, "value"), None
    except Mismatch as error:
        return None, f"the output does not fit json_schema: {error}"


def convert(data: Any, node: ValueType, where: str) -> Any:
    """``data`` (parsed JSON) as a value of ``node``; Mismatch names the first misfit."""
    if node.kind == "any":
        return data
    if data is None:
        if node.nullable:
            return None
        raise Mismatch(f"{where}: expected {_expected(node)}, got null")
    if node.kind == "array":
        if not isinstance(data, list):
            raise Mismatch(f"{where}: expected an array, got {_shown(data)}")
        return [convert(item, node.items, f"{where}[{i}]") for i, item in enumerate(data)]
    if node.kind == "object":
        if not isinstance(data, dict):
            raise Mismatch(f"{where}: expected an object, got {_shown(data)}")
        missing = sorted(node.required - set(data))
        if missing:
            raise Mismatch(f"{where}: missing required properties {missing}")
        return {
            name: convert(data[name], sub, f"{where}.{name}") if name in data else None
            for name, sub in node.properties
        }
    value = _scalar(data, node, where)
    if node.enum is not None and not any(_same(value, allowed) for allowed in node.enum):
        raise Mismatch(f"{where}: {_shown(data)} is not one of {list(node.enum)}")
    return value


def _scalar(data: Any, node: ValueType, where: str) -> Any:
    kind = node.kind
    if kind == "string" and isinstance(data, str):
        return data
    if kind == "boolean" and isinstance(data, bool):
        return data
    if not isinstance(data, bool) and isinstance(data, (int, float)):
        if kind == "number":
            try:
                number = float(data)
            except OverflowError:  # an integer beyond the double range
                number = math.inf
            if not math.isfinite(number):  # 1e999 parses to inf
                raise Mismatch(f"{where}: {_shown(data)} does not fit a double")
            return number
        if kind == "integer" and (isinstance(data, int) or data.is_integer()):
            if INT64[0] <= data <= INT64[1]:
                return int(data)
            raise Mismatch(f"{where}: {_shown(data)} does not fit 64 bits")
    raise Mismatch(f"{where}: expected {_expected(node)}, got {_shown(data)}")


def _same(value: Any, allowed: Any) -> bool:
    return isinstance(value, bool) == isinstance(allowed, bool) and value == allowed


def _expected(node: ValueType) -> str:
    return {"integer": "an integer", "array": "an array", "object": "an object"}.get(
        node.kind, f"a {node.kind}"
    )


def _shown(data: Any) -> str:
    text = json.dumps(data)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
