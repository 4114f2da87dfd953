"""``llm-operator bench host``: the GPU's proxies measured on the CPU (host milliseconds per
decode step, ops per layer of a decode step on the path CUDA takes)."""

from __future__ import annotations

import statistics

from llm_operator_bench.suites.host import count_ops, markdown, measure_host


def test_host_milliseconds_come_from_decode_steps_of_all_rows(tiny_llama_dir):
    host = measure_host(tiny_llama_dir, rows=24, max_tokens=5, repeat=2)
    assert len(host["runs"]) == 2
    for run in host["runs"]:
        # 5 tokens a row: the first comes from the prefill, 4 decode steps of all 24 rows
        assert run["decode_steps"] == 4
        assert 0 < run["host_ms"] < 1000
        assert run["iterations"] >= run["decode_steps"] + 1
    assert host["host_ms"] == statistics.median(r["host_ms"] for r in host["runs"])


def test_ops_per_layer_on_the_cuda_path_are_fused(tiny_llama_dir):
    ops = count_ops(tiny_llama_dir)
    assert ops["elementwise_ops"] == "TritonOps"
    assert ops["layers"] == 2 and ops["rows"] == 16
    # the elementwise work is in Triton launches, not ATen ops: no norm or RoPE pieces left
    for eager in ("pow", "rsqrt", "mean", "neg", "silu", "add"):
        assert eager not in ops["aten"], eager
    assert ops["triton"]["_qkv_rope_kernel"] == 2  # one a layer, K/V stored in it
    assert "_store_kv_kernel" not in ops["triton"] and "_merge_kernel" not in ops["triton"]
    assert ops["per_layer"] == (ops["per_step"]) / 2
    assert ops["per_layer"] < 40
    table = markdown({"cpu": "x", "threads": 2, "torch": "t", "host": {
        "rows": 24, "host_ms": 1.0, "schedule_ms": 2.0, "sample_ms": 3.0}, "ops": ops})  # fmt: skip
    assert "| host ms per decode step, 24 rows (median) | 1.00 |" in table
