"""``llm-operator bench embed --quick`` on the tiny Llama: native, native-noshare and hf.

Checks the records, not the speed: every system embeds every row of both workloads, the
native vectors agree with hf's (cosine >= 0.99999, fp32), and sharing computes fewer
tokens than computing every row whole. The documents are capped by the tiny model's
256-token context.
"""

from __future__ import annotations

import json

import pytest

from llm_operator.cli.main import main
from llm_operator_bench.suites.embed import CHUNKS, INSTRUCTION, SIZES, WORKLOADS

SYSTEMS = ("native", "native-noshare", "hf")


@pytest.fixture(scope="module")
def report(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-embed")
    code = main(
        ["bench", "embed", "--quick", "--model", str(tiny_llama_dir), "--systems",
         ",".join(SYSTEMS), "--repeat", "2", "--out", str(out), "--name", "quick"]
    )  # fmt: skip
    assert code == 0
    return out, json.loads((out / "quick.json").read_text())


def test_records_cover_every_system_and_workload(report) -> None:
    out, data = report
    assert data["suite"] == "embed" and data["size"] == "quick" and data["pooling"] == "last"
    sizes = SIZES["quick"]
    rows = {w["name"]: w["rows"] for w in data["workloads"]}
    assert rows == {
        "contextual-chunks": sizes["documents"] * CHUNKS,
        "query-instruction": sizes["queries"],
    }
    assert sorted((r["system"], r["name"]) for r in data["records"]) == sorted(
        (s, w) for s in SYSTEMS for w in WORKLOADS
    )
    for record in data["records"]:
        assert record["rows"] == rows[record["name"]] and record["error_rows"] == 0
        assert record["seconds"] > 0 and record["rows_per_s"] > 0
        assert len(record["runs"]) == 2 and min(record["runs"]) <= record["seconds"]
        assert record["seconds"] <= max(record["runs"])  # the median of the runs
        assert record["linear_gflops"] > 0
        assert record["prompt_tokens"] == next(
            w["prompt_tokens"] for w in data["workloads"] if w["name"] == record["name"]
        )
        assert record["peak_rss_bytes"] > 0
        assert 0 < record["tokens_computed"] <= record["prompt_tokens"]
    assert data["repeat"] == 2 and data["rates"]["float32"]["gflops"] > 0
    markdown = (out / "quick.md").read_text()
    assert data["machine"]["cpu"] in markdown
    assert "the median of 2 runs" in markdown and "torch linear float32" in markdown
    assert markdown.count("| contextual-chunks | native") == 2


def test_native_agrees_with_hf_and_shares(report) -> None:
    _, data = report
    by_key = {(r["system"], r["name"]): r for r in data["records"]}
    for workload in WORKLOADS:
        for system in ("native", "native-noshare"):
            assert by_key[(system, workload)]["agreement_with_hf"]["min"] >= 0.99999
        assert by_key[("hf", workload)]["agreement_with_hf"]["min"] >= 0.999999
        shared = by_key[("native", workload)]["tokens_computed"]
        whole = by_key[("native-noshare", workload)]["tokens_computed"]
        assert whole == by_key[("native-noshare", workload)]["prompt_tokens"]
        assert shared < whole
    # a document's tokens are computed once, not once per chunk
    chunks = by_key[("native", "contextual-chunks")]
    assert chunks["tokens_computed"] < chunks["prompt_tokens"] / 4


def test_workload_rows_have_their_shapes(tiny_llama_dir) -> None:
    from llm_operator import LLMOperator
    from llm_operator_bench.suites.embed import _tokenizer, build_workloads

    op = LLMOperator(tiny_llama_dir, progress=False)
    first = build_workloads(_tokenizer(op), size="quick", context=op.max_context)
    again = build_workloads(_tokenizer(op), size="quick", context=op.max_context)
    assert first == again  # deterministic
    chunks, queries = first
    document = chunks["texts"][0].split("\n\n")[0]
    assert all(row.startswith(document + "\n\n") for row in chunks["texts"][:CHUNKS])
    assert len(chunks["texts"]) == SIZES["quick"]["documents"] * CHUNKS
    assert len(set(chunks["texts"])) == len(chunks["texts"])  # no row merged with another
    assert all(row.startswith(INSTRUCTION) for row in queries["texts"])
    assert max(len(ids) for ids in chunks["token_ids"]) <= op.max_context
