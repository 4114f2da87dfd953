"""A JSON schema as a column type (no Spark, no model): value_type and parse_value."""

from __future__ import annotations

import json

import pytest

from llm_operator.integrations.json_values import ANY, ValueType, parse_value, value_type
from llm_operator.integrations.worker import result_records
from llm_operator.results import GenerationResult

STRING, INTEGER = ValueType("string"), ValueType("integer")
NUMBER, BOOLEAN = ValueType("number"), ValueType("boolean")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20, "description": "kept out of the type"},
        "age": {"type": "integer", "minimum": 0},
        "height": {"type": "number"},
        "member": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city"],
        },
        "scores": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    },
    "required": ["name", "age"],
}


def test_types_of_every_supported_construct():
    node = value_type(PERSON)
    assert node.kind == "object" and node.required == {"name", "age"}
    fields = dict(node.properties)
    assert list(fields) == list(PERSON["properties"])  # the schema's order
    assert fields["name"] == STRING and fields["age"] == INTEGER
    assert fields["height"] == NUMBER and fields["member"] == BOOLEAN
    assert fields["size"] == ValueType("string", enum=("S", "M", "L"))
    assert fields["tags"] == ValueType("array", items=STRING)
    assert fields["address"].kind == "object" and fields["address"].required == {"city"}
    assert dict(fields["address"].properties) == {"city": STRING, "zip": INTEGER}
    assert fields["scores"].items.items == NUMBER
    # JSON text works as well as a dict
    assert value_type(json.dumps(PERSON)) == node


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": ["string", "null"]}, ValueType("string", nullable=True)),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, ValueType("integer", nullable=True)),
        ({"oneOf": [{"type": "null"}, {"type": "boolean"}]}, ValueType("boolean", nullable=True)),
        ({"allOf": [{"type": "number"}], "description": "d"}, NUMBER),
        ({"const": 3}, ValueType("integer", enum=(3,))),
        ({"enum": [1, 2.5]}, ValueType("number", enum=(1, 2.5))),
        ({"enum": ["a", None]}, ValueType("string", enum=("a", None), nullable=True)),
        ({"properties": {"a": {"type": "boolean"}}}, ValueType("object", properties=(("a", BOOLEAN),))),
        ({"items": {"type": "integer"}}, ValueType("array", items=INTEGER)),
    ],
)  # fmt: skip
def test_nullable_and_implied_types(schema, expected):
    assert value_type(schema) == expected


def test_refs_as_pydantic_writes_them():
    schema = {
        "$defs": {
            "Item": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
            }
        },
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
            "gift": {"anyOf": [{"$ref": "#/$defs/Item"}, {"type": "null"}], "default": None},
        },
    }
    node = value_type(schema)
    item = value_type(schema["$defs"]["Item"])
    assert dict(node.properties) == {
        "items": ValueType("array", items=item),
        "gift": ValueType("object", properties=item.properties, required=item.required,
                          nullable=True),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "json_schema: 'anyOf'"),
        ({"properties": {"a": {"oneOf": [{"type": "string"}, {"type": "integer"}]}}},
         "json_schema.properties.a: 'oneOf'"),
        ({"properties": {"a": {"not": {"type": "string"}}}}, "json_schema.properties.a: 'not'"),
        ({"type": "object"}, "free-form object"),
        ({"type": "object", "properties": {"a": {}}}, "properties.a: a schema that allows any"),
        ({"type": "array"}, "an array needs one schema in items"),
        ({"type": "array", "prefixItems": [{"type": "string"}]}, "'prefixItems'"),
        ({"type": ["string", "integer"]}, "type ['string', 'integer']"),
        ({"type": "null"}, "type 'null'"),
        ({"enum": ["a", 1]}, "not of one scalar type"),
        ({"type": "string", "enum": ["a", 1]}, "enum value 1 is not of type string"),
        ({"properties": {"n": {"$ref": "#"}}}, "$ref '#' is recursive"),
        ({"properties": {"n": {"$ref": "#/$defs/Nope"}}}, "points to nothing"),
        ({"properties": {"n": {"$ref": "other.json#/a"}}}, "does not point into this schema"),
        ({"properties": {"a": {"type": "string"}}, "required": ["b"]}, "undeclared"),
    ],
)  # fmt: skip
def test_an_untypable_schema_is_a_value_error_naming_the_construct(schema, named):
    with pytest.raises(ValueError, match="value=False") as raised:
        value_type(schema)
    assert named in str(raised.value)


def test_untyped_keeps_the_typable_parts():
    schema = {
        "properties": {
            "a": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "b": {"type": "integer"},
        }
    }
    node = value_type(schema, untyped=True)
    assert dict(node.properties) == {"a": ANY, "b": INTEGER}
    assert parse_value('{"a": [1, {"x": 2}], "b": 3}', node) == ({"a": [1, {"x": 2}], "b": 3}, None)
    value, why = parse_value('{"a": 1, "b": "3"}', node)
    assert value is None and "value.b: expected an integer" in why


def test_parse_value_types_every_field():
    node = value_type(PERSON)
    text = json.dumps(
        {
            "name": "Ada",
            "age": 36.0,  # an integral float is an integer
            "height": 2,  # an integer is a number
            "size": "M",
            "tags": ["a", "b"],
            "address": {"city": "London"},
            "scores": [[1, 2.5], []],
            "undeclared": "dropped",
        }
    )
    value, why = parse_value(text, node)
    assert why is None
    assert value == {
        "name": "Ada",
        "age": 36,
        "height": 2.0,
        "member": None,  # optional and absent: None
        "size": "M",
        "tags": ["a", "b"],
        "address": {"city": "London", "zip": None},
        "scores": [[1.0, 2.5], []],
    }
    assert type(value["age"]) is int and type(value["height"]) is float
    assert type(value["scores"][0][0]) is float


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"name": "Ada", "age": 3', "not valid JSON"),
        ('{"name": "Ada", "age": NaN}', "NaN is not a JSON number"),
        ("", "not valid JSON"),
        ('{"name": "Ada"}', "value: missing required properties ['age']"),
        ('{"name": "Ada", "age": "3"}', 'value.age: expected an integer, got "3"'),
        ('{"name": "Ada", "age": 2.5}', "value.age: expected an integer, got 2.5"),
        ('{"name": "Ada", "age": true}', "value.age: expected an integer, got true"),
        ('{"name": "Ada", "age": 9223372036854775808}', "does not fit 64 bits"),
        ('{"name": "Ada", "age": null}', "value.age: expected an integer, got null"),
        ('{"name": "Ada", "age": 1, "member": 1}', "value.member: expected a boolean"),
        ('{"name": "Ada", "age": 1, "size": "XL"}', "value.size: \"XL\" is not one of"),
        ('{"name": "Ada", "age": 1, "tags": ["a", 2]}', "value.tags[1]: expected a string"),
        ('{"name": "Ada", "age": 1, "tags": "a"}', "value.tags: expected an array"),
        ('{"name": "Ada", "age": 1, "address": {"zip": 1}}',
         "value.address: missing required properties ['city']"),
        ('{"name": "Ada", "age": 1, "scores": [[1, "2"]]}', "value.scores[0][1]: expected a number"),
        ('["Ada"]', "value: expected an object"),
        ("1e999", "value: expected an object"),
        ('{"name": "Ada", "age": 1, "height": 1e999}', "value.height: Infinity does not fit"),
        ('{"name": "Ada", "age": 1, "height": 1%s}' % ("0" * 400), "does not fit a double"),
    ],
)  # fmt: skip
def test_parse_value_says_why_a_text_has_no_value(text, why):
    value, message = parse_value(text, value_type(PERSON))
    assert value is None
    assert why in message, message


def test_result_records_parse_only_rows_the_engine_finished():
    node = value_type({"properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    results = [
        GenerationResult('{"ok": true}', (1,), "stop", 3, 1, logprob=-1.5),
        GenerationResult('{"ok": "yes"}', (1,), "stop", 3, 1),
        GenerationResult('{"ok', (1,), "length", 3, 1, "the output is not valid: it stopped"),
        GenerationResult.failed("prompt is null"),
    ]
    records = result_records(results, node)
    assert [r["value"] for r in records] == [{"ok": True}, None, None, None]
    assert records[0]["error"] is None and records[0]["logprob"] == -1.5
    assert "value.ok: expected a boolean" in records[1]["error"]
    assert records[2]["error"] == "the output is not valid: it stopped"  # the engine's kept
    assert records[3]["error"] == "prompt is null"
    assert "value" not in result_records(results)[0]  # no value without a type
