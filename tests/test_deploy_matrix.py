"""The deployment matrix's bookkeeping (the matrix itself runs clusters: `python -m
llm_operator_bench.suites.deploy_matrix`, results in docs/results/deploy-matrix.md)."""

from __future__ import annotations

from llm_operator_bench.suites.deploy_matrix import CASES, compare, markdown, table_rows


def test_compare_counts_rows_equal_in_text_and_error():
    expected = {0: ["a", False], 1: ["", True], 2: ["b", False]}
    got = {"rows_out": 3, "texts": {"0": ["a", False], "1": ["", True], "2": ["c", False]}}
    assert compare(expected, {**got, "seconds": 1.0}) == {"rows_out": 3, "equal": 2, "seconds": 1.0}
    missing = {"rows_out": 2, "texts": {"0": ["a", False], "2": ["b", True]}, "seconds": 0.5}
    assert compare(expected, missing)["equal"] == 1  # row 1 absent, row 2's error differs
    failed = compare(expected, {"error": "boom", "seconds": 0.1})
    assert failed["equal"] == 0 and failed["error"] == "boom"


def test_markdown_has_a_cell_per_case_and_environment():
    rows = len(table_rows())
    ok = {name: {"rows_out": rows, "equal": rows, "seconds": 1.0} for name, _, _ in CASES}
    report = {"rows_in": rows, "envs": {"a": ok, "b": {"failed": "no server"}}}
    text = markdown(report).splitlines()
    assert text[2] == "| entry point | a | b |"
    body = text[4:]
    assert len(body) == len(CASES)
    assert all(line.endswith(f"| {rows} out, {rows}/{rows} equal | failed |") for line in body)
