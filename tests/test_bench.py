"""``llm-operator bench`` end to end on a tiny model: every field of the JSON, not the speed;
and the figures it derives (work in FLOP, matmul rate, decode steps) on hand-checked inputs.

One run (``quick_report``) serves every end-to-end check, the classify workload's too
(tests/test_bench_classify.py has its hand-checked figures): each system is a process of
its own that costs seconds to start, while its runs of the tiny workloads cost
milliseconds, so more workloads in one run are nearly free and another run is not."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest

from llm_operator.cli import main
from llm_operator_bench.core.decode_steps import backend_decode_profile, summarize_decode_steps
from llm_operator_bench.core.flops import ModelShape, attention_keys, model_shape, work_flop
from llm_operator_bench.core.rate import measure_matmul_rate, rate_for
from llm_operator_bench.core.report import decode_table, markdown_table
from llm_operator_bench.core.runner import vllm_engine_settings
from llm_operator_bench.core.systems import SYSTEMS, SystemSpec
from llm_operator_bench.core.worker import peak_rss_bytes

OUR_SYSTEMS = ("hf", "hf-noshare", "native", "native-noshare")  # the other ablations alike
BF16_SYSTEMS = ("native-bf16", "hf-static-bf16")  # other arithmetic: its greedy answers may differ
STATIC_SYSTEMS = ("hf-static", "hf-static-shuffled")
VLLM_SYSTEMS = ("vllm", "vllm-plan")  # plain vLLM, and our backend="vllm" (both need the venv)
# constrained to each row's labels: they run the workloads with labels only (classify)
CHOICES_SYSTEMS = ("native-choices", "vllm-choices")
ALL_SYSTEMS = (*STATIC_SYSTEMS, *OUR_SYSTEMS, *BF16_SYSTEMS, *VLLM_SYSTEMS, *CHOICES_SYSTEMS)
RECORD_FIELDS = (
    "system",
    "workload",
    "status",
    "rows",
    "prompt_tokens",
    "min_prefill_tokens",
    "load_seconds",
    "seconds",
    "seconds_all",
    "output_tokens",
    "output_tokens_per_second",
    "rows_per_second",
    "prefill_tokens_computed",
    "prefill_vs_min",
    "peak_rss_bytes",
    "agreement_with_hf_static",
    "speedup_vs_hf_static",
    "dtype",
    "torch_threads",
    "work_gflop",
    "gflop_per_second",
    "rate_fraction",
)
WORKLOADS = (
    "etl-fewshot",
    "doc-qa",
    "table-rows",
    "short-rows",
    "no-sharing",
    "long-answers",
    "classify",
)
LABELLED = ("classify",)


def has_record(system: str, workload: str) -> bool:
    """Whether a system of this run has a record for the workload (a choices system runs
    the labelled workloads only)."""
    return system not in CHOICES_SYSTEMS or workload in LABELLED


@pytest.fixture(scope="module")
def quick_report(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(
        [
            "bench",
            "--quick",
            "--size",
            "tiny",
            "--model",
            str(tiny_llama_dir),
            "--systems",
            ",".join(ALL_SYSTEMS),
            "--workloads",
            ",".join(WORKLOADS),
            "--repeat",
            "2",
            "--out",
            str(out),
            "--name",
            "tiny",
            "--vllm-python",
            str(out / "no-such-venv" / "python"),
        ]
    )
    assert code == 0
    return out, json.loads((out / "tiny.json").read_text())


def test_quick_run_writes_every_field(quick_report):
    out, report = quick_report
    for key in ("name", "created", "model", "size", "repeat", "machine", "workloads", "results"):
        assert report[key] is not None, key
    assert report["size"] == "tiny" and report["repeat"] == 2
    names = [w["name"] for w in report["workloads"]]
    assert names == list(WORKLOADS)
    expected = [(s, w) for s in ALL_SYSTEMS for w in WORKLOADS if has_record(s, w)]
    assert sorted((r["system"], r["workload"]) for r in report["results"]) == sorted(expected)
    for record in report["results"]:
        if record["system"] in (*VLLM_SYSTEMS, "vllm-choices"):
            continue
        assert record["status"] == "ok", record
        for field in RECORD_FIELDS:
            assert record[field] is not None, (record["system"], record["workload"], field)
        assert len(record["seconds_all"]) == 2
        assert record["seconds"] > 0 and record["output_tokens"] > 0
        # a measurement, not a threshold: test_peak_rss_measures_an_allocation checks it
        assert isinstance(record["peak_rss_bytes"], int) and record["peak_rss_bytes"] > 0
    # a row in each workload's table, and in the labels table of each labelled workload
    assert (out / "tiny.md").read_text().count("| hf-static |") == len(names) + len(LABELLED)
    assert (out / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["chart"] == str(out / "tiny.png")


# Run in a fresh process (as the worker is): touch a known number of pages after a reset and
# read the peak back; then free a bigger buffer and check that a reset forgets it.
PEAK_RSS_PROBE = """
import json, os
from llm_operator_bench.core.worker import peak_rss_bytes, reset_peak_rss
MIB = 2**20
def touched(size):
    buffer = bytearray(size)
    buffer[::4096] = b"x" * len(range(0, size, 4096))  # every page resident
    return buffer
reset_peak_rss()
base = peak_rss_bytes()
buffer = touched(64 * MIB)
grown = peak_rss_bytes()
del buffer
big = touched(128 * MIB)
del big
before_reset = peak_rss_bytes()
reset_peak_rss()
after_reset = peak_rss_bytes()
resettable = os.access("/proc/self/clear_refs", os.W_OK)
print(json.dumps([base, grown, before_reset, after_reset, resettable]))
"""


def test_peak_rss_measures_an_allocation():
    if peak_rss_bytes() is None:
        pytest.skip("no VmHWM in /proc/self/status on this system")
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_PROBE], capture_output=True, text=True, check=True
    )
    base, grown, before_reset, after_reset, resettable = json.loads(done.stdout)
    mib = 2**20
    # 64 MiB touched after the reset show in the peak (a margin for pages the OS reclaims)
    assert grown - base >= 48 * mib, (base, grown)
    if resettable:
        # the 128 MiB buffer, freed, stays in the peak until a reset brings it back to the RSS
        assert before_reset - base >= 96 * mib, (base, before_reset)
        assert before_reset - after_reset >= 96 * mib, (before_reset, after_reset)


def test_default_workloads_are_all_but_classify(tiny_llama_dir, monkeypatch):
    """``quick_report`` names its workloads; without --workloads the bench runs the default
    ones: every workload but classify."""
    from llm_operator_bench.core import suite
    from llm_operator_bench.core.workloads import WORKLOAD_NAMES

    seen = {}

    def fake(**options):
        seen.update(options)
        return {"results": [], "workloads": []}

    monkeypatch.setattr(suite, "run_benchmark", fake)
    assert main(["bench", "--size", "tiny", "--model", str(tiny_llama_dir)]) == 0
    assert seen["workloads"] is None
    assert suite.parse_workloads(None) == [w for w in WORKLOAD_NAMES if w != "classify"]
    assert suite.parse_workloads("all") == list(WORKLOAD_NAMES)
    assert set(WORKLOADS) <= set(WORKLOAD_NAMES)


def test_vllm_without_its_venv_is_skipped_with_the_reason(quick_report):
    _, report = quick_report
    vllm = (*VLLM_SYSTEMS, "vllm-choices")
    skipped = [r for r in report["results"] if r["system"] in vllm]
    assert len(skipped) == sum(has_record(s, w["name"]) for s in vllm for w in report["workloads"])
    for record in skipped:
        assert record["status"] == "skipped"
        assert "vllm-env" in record["error"]


def test_every_system_gives_hf_static_answers(quick_report):
    """Greedy outputs are token-identical to the baseline: sharing, order and batching
    change the speed, never the answer."""
    _, report = quick_report
    for record in report["results"]:
        if record["status"] == "ok" and record["system"] not in (*BF16_SYSTEMS, *CHOICES_SYSTEMS):
            assert record["agreement_with_hf_static"] == 1.0, record


def test_machine_rate_and_work_figures(quick_report):
    """The rate is measured per dtype before the systems run; each record's GFLOP follows
    work_flop on the workload's token counts, and % rate divides by its own dtype's rate."""
    out, report = quick_report
    rates = report["machine"]["matmul_rate"]
    assert rates["tokens"] == 1024 and rates["threads"] == report["machine"]["torch_threads"]
    assert [name for name, _, _ in rates["shapes"]] == ["qkv", "o_proj", "gate_up", "down"]
    for dtype in ("float32", "bfloat16"):
        assert rates[dtype]["gflops"] > 0, rates
    shape = ModelShape(**report["model_shape"])
    assert shape.num_layers == 2 and shape.hidden_size == 64
    by = {(r["system"], r["workload"]): r for r in report["results"]}
    for (system, _), record in by.items():
        if record["status"] != "ok":
            continue
        assert record["dtype"] == ("bfloat16" if system in BF16_SYSTEMS else "float32")
        rate = rates[record["dtype"]]["gflops"]
        assert record["gflop_per_second"] == pytest.approx(record["work_gflop"] / record["seconds"])
        assert record["rate_fraction"] == pytest.approx(record["gflop_per_second"] / rate)
        assert record["torch_threads"] == rates["threads"]
    # More prefill computed, more work: hf-noshare against hf on the same outputs.
    for name in ("etl-fewshot", "doc-qa"):
        assert by["hf-noshare", name]["work_gflop"] > by["hf", name]["work_gflop"]
    markdown = (out / "tiny.md").read_text()
    assert "Matmul rate" in markdown and "float32" in markdown and "bfloat16" in markdown
    assert markdown.count("| GFLOP | GFLOP/s | % rate |") == len(WORKLOADS)


def test_long_answers_decode_every_token_in_every_system(quick_report):
    """ignore_eos reaches every system: each row decodes exactly its max_tokens."""
    _, report = quick_report
    workload = next(w for w in report["workloads"] if w["name"] == "long-answers")
    assert workload["ignore_eos"] is True
    assert all(not w["ignore_eos"] for w in report["workloads"] if w is not workload)
    ran = [r for r in report["results"] if r["workload"] == "long-answers" and r["status"] == "ok"]
    assert {r["system"] for r in ran} == {*STATIC_SYSTEMS, *OUR_SYSTEMS, *BF16_SYSTEMS}
    for record in ran:
        assert record["output_tokens"] == workload["max_tokens_total"], record["system"]
    native = next(r for r in ran if r["system"] == "native")
    if "decode_profile" in native:  # when the native backend lists its steps
        assert native["decode_profile"]["by_batch"]


def test_prefill_figures_follow_the_plan(quick_report):
    _, report = quick_report
    by = {(r["system"], r["workload"]): r for r in report["results"]}
    for workload in report["workloads"]:
        name = workload["name"]
        assert workload["min_prefill_tokens"] <= workload["prompt_tokens"]
        for system in (*STATIC_SYSTEMS, *OUR_SYSTEMS):
            assert by[system, name]["prefill_tokens_computed"] >= workload["min_prefill_tokens"]
        for unshared in ("hf-noshare", "native-noshare"):
            assert by[unshared, name]["prefill_tokens_computed"] == workload["prompt_tokens"]
        assert by["hf-static", name]["prefill_tokens_computed"] >= workload["prompt_tokens"]
        assert by["hf", name]["speedup_vs_hf_static"] == pytest.approx(
            by["hf-static", name]["seconds"] / by["hf", name]["seconds"]
        )
    for name in ("etl-fewshot", "doc-qa", "table-rows"):
        for ours in ("hf", "native"):
            assert (
                by[ours, name]["prefill_tokens_computed"]
                < 0.8 * by[f"{ours}-noshare", name]["prefill_tokens_computed"]
            ), (ours, name)


def test_classify_runs_every_system_with_labels(quick_report):
    """The classify workload: per-row choices reach the choices systems, free generation
    stops at the workload's stop string, every system gets its label figures."""
    out, report = quick_report
    workload = next(w for w in report["workloads"] if w["name"] == "classify")
    assert workload["labelled"] and workload["stop"] == ["\n"]
    by = {r["system"]: r for r in report["results"] if r["workload"] == "classify"}
    assert list(by) == list(ALL_SYSTEMS)  # the choices systems too, in the order asked
    ran = {name for name, record in by.items() if record["status"] == "ok"}
    assert ran == set(ALL_SYSTEMS) - {*VLLM_SYSTEMS, "vllm-choices"}
    for name in ran:
        record = by[name]
        assert 0 <= record["gold_agreement"] <= record["names_label"] <= 1
        assert set(record["same_label_as"]) == ran - {name}
    # free generation stops at the newline the same way in HF generate and in ours
    assert by["native"]["agreement_with_hf_static"] == 1.0
    assert by["native"]["same_label_as"]["hf-static"] == 1.0
    # constrained: every output is one of its row's labels, even from a random model
    assert by["native-choices"]["names_label"] == 1.0
    assert by["native-choices"]["output_tokens"] <= workload["max_tokens_total"]
    assert (
        by["native-choices"]["same_label_as"]["native"]
        == by["native"]["same_label_as"]["native-choices"]
    )
    entries = {s["name"]: s for s in report["systems"]}
    assert entries["native-choices"]["choices"] and not entries["native"]["choices"]
    markdown = (out / "tiny.md").read_text()
    assert "Labels (classify)" in markdown and "| same label as native-choices |" in markdown
    assert "Free generation stops at '\\n'." in markdown
    for record in report["results"]:  # label figures for labelled workloads only
        labelled = record["workload"] in LABELLED and record["status"] == "ok"
        assert ("names_label" in record) == labelled, (record["system"], record["workload"])


def test_bad_bench_options_are_clear_errors(tiny_llama_dir, capsys, tmp_path):
    assert main(["bench", "--model", str(tiny_llama_dir), "--systems", "hf,nope"]) == 2
    assert "unknown system" in capsys.readouterr().err
    assert main(["bench", "--model", str(tiny_llama_dir), "--workloads", "etl"]) == 2
    assert "unknown workload" in capsys.readouterr().err
    # the default sizes do not fit the tiny model's 256-token context
    code = main(
        ["bench", "--model", str(tiny_llama_dir), "--systems", "hf", "--out", str(tmp_path)]
    )
    assert code == 2
    assert "--size" in capsys.readouterr().err


def test_bench_planner_writes_rates(tmp_path, capsys):
    code = main(
        [
            "bench",
            "planner",
            "--prompts",
            "300,600",
            "--prompt-tokens",
            "60",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "planner.json").read_text())
    assert [r["prompts"] for r in report["results"]] == [300, 600]
    for result in report["results"]:
        assert result["tokens"] == pytest.approx(result["prompts"] * 60, rel=0.25)
        assert result["prompts_per_second"] > 0 and result["tokens_per_second"] > 0
        assert 0 < result["saving_ratio"] < 1
    assert "planner:" in capsys.readouterr().out


# -- figures on hand-checked inputs ------------------------------------------------------
TINY_SHAPE = ModelShape(
    hidden_size=4,
    intermediate_size=6,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    num_layers=3,
    vocab_size=10,
)


def test_work_flop_matches_a_hand_computation():
    # Per layer: qkv 4 x (2 + 2 x 1) x 2 = 32, o_proj 4 x 4 = 16, gate_up 4 x 12 = 48,
    # down 6 x 4 = 24: 120 weights, x 3 layers = 360, so 720 FLOP per token. A key costs
    # 4 x 3 x 2 x 2 = 48 FLOP, the output head 2 x 10 x 4 = 80.
    assert TINY_SHAPE.linear_weights() == 360
    flop = work_flop(
        TINY_SHAPE, prefill_tokens=5, output_tokens=2, prefill_keys=3.0, output_keys=7.5
    )
    assert flop == 5 * (720 + 48 * 3.0) + 2 * (720 + 80 + 48 * 7.5) == 6640
    assert (
        work_flop(TINY_SHAPE, prefill_tokens=0, output_tokens=0, prefill_keys=9, output_keys=9) == 0
    )
    with pytest.raises(ValueError, match="prefill_tokens=-1"):
        work_flop(TINY_SHAPE, prefill_tokens=-1, output_tokens=0, prefill_keys=0, output_keys=0)


def test_attention_keys_average_the_context_positions():
    # prompts of 2 and 4 tokens: keys 1, 2 and 1, 2, 3, 4 -> 13 / 6; only row 0 decodes,
    # 2 tokens after a 2-token prompt -> 2 + 2 / 2 = 3.
    assert attention_keys([2, 4], [2, 0]) == (pytest.approx(13 / 6), 3.0)
    assert attention_keys([3], [0]) == (2.0, 0.0)
    with pytest.raises(ValueError, match="2 prompt lengths but 1 output"):
        attention_keys([2, 4], [1])


def test_smollm2_costs_212_mflop_per_token():
    config = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
    }
    shape = model_shape(config)
    assert shape.linear_weights() == 106_168_320
    one_prefill = work_flop(shape, prefill_tokens=1, output_tokens=0, prefill_keys=0, output_keys=0)
    one_output = work_flop(shape, prefill_tokens=0, output_tokens=1, prefill_keys=0, output_keys=0)
    assert one_prefill == pytest.approx(212.3e6, rel=1e-3)
    assert one_output == pytest.approx(212.3e6 + 56.6e6, rel=1e-3)
    assert model_shape({**config, "head_dim": None}).head_dim == 64  # hidden / heads
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model_shape({**config, "num_hidden_layers": None})


def test_matmul_rate_on_a_small_shape():
    rates = measure_matmul_rate(TINY_SHAPE, tokens=8, dtypes=("float32",), warmup=1, repeats=2)
    assert rates["tokens"] == 8 and rates["device"] == "cpu" and rates["threads"] >= 1
    assert set(rates["float32"]["by_shape"]) == {"qkv", "o_proj", "gate_up", "down"}
    assert rate_for(rates, "torch.float32") == rates["float32"]["gflops"] > 0
    assert rate_for(rates, "bfloat16") is None and rate_for(None, "float32") is None
    with pytest.raises(ValueError, match="repeats=0"):
        measure_matmul_rate(TINY_SHAPE, repeats=0)


def test_decode_steps_median_per_batch_size():
    steps = [
        (40, 2, 0.5),  # prefill with two rows sampled: not a decode step
        (2, 2, 0.010),
        (2, 2, 0.030),
        (2, 2, 0.020),
        (5, 1, 0.4),  # decode and prefill mixed
        (1, 1, 0.004),
        "junk",
    ]
    summary = summarize_decode_steps(steps)
    assert summary["iterations"] == 7 and summary["decode_iterations"] == 4
    assert summary["decode_seconds"] == pytest.approx(0.064)
    assert summary["by_batch"] == [
        {"rows": 1, "iterations": 1, "median_ms": pytest.approx(4.0)},
        {"rows": 2, "iterations": 3, "median_ms": pytest.approx(20.0)},
    ]
    assert summarize_decode_steps([(40, 2, 0.5)]) is None
    from llm_operator.engine.native.backend import RunProfile

    profile = RunProfile(num_blocks=8, steps=steps)
    native = SimpleNamespace(name="native", last_profile=profile)
    assert backend_decode_profile(native) == summary
    assert backend_decode_profile(SimpleNamespace(name="native", last_profile=None)) is None
    assert backend_decode_profile(SimpleNamespace(name="hf", last_profile=profile)) is None
    record = {
        "system": "native",
        "workload": "long-answers",
        "status": "ok",
        "decode_profile": summary,
    }
    table = decode_table([record], "long-answers")
    assert "| batch | native |" in table and "| 2 | 20.0 (3) |" in table
    assert decode_table([record], "doc-qa") == []


def test_markdown_header_names_the_rates():
    machine = {
        "cpu": "Test CPU",
        "cpu_count": 2,
        "torch": "2.x",
        "torch_threads": 2,
        "matmul_rate": {
            "tokens": 1024,
            "threads": 2,
            "device": "cpu",
            "float32": {"gflops": 160.4},
            "bfloat16": {"error": "RuntimeError: no kernel"},
        },
    }
    text = markdown_table([], [], machine=machine, title="t")
    assert text.startswith("# t\n")
    assert "float32 160 GFLOP/s" in text and "bfloat16 unavailable (RuntimeError" in text


def test_per_system_dtype_and_block_size():
    assert SYSTEMS["native-bf16"].dtype == "bfloat16"
    assert vllm_engine_settings(SYSTEMS["vllm"], None) == (True, "float32", None)
    assert vllm_engine_settings(SYSTEMS["vllm"], 64) == (True, "float32", 64)  # the global flag
    assert vllm_engine_settings(SYSTEMS["vllm-bf16"], 64) == (True, "bfloat16", 64)
    assert vllm_engine_settings(SYSTEMS["vllm-b32"], 64) == (True, "float32", 32)
    assert vllm_engine_settings(SYSTEMS["vllm-b32-bf16"], None) == (True, "bfloat16", 32)
    assert vllm_engine_settings(SYSTEMS["vllm-noprefix"], None) == (False, "float32", None)
    with pytest.raises(ValueError, match="block_size is for vLLM systems only"):
        SystemSpec("x", "operator", "d", {"backend": "native"}, block_size=32)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        SystemSpec("x", "vllm", "d", dtype="fp8")


def test_decode_steps_split_by_kind_per_batch_size():
    steps = [(2, 2, 0.010), (2, 2, 0.030), (9, 1, 0.4), (2, 2, 0.020)]
    ops = [
        {"linear": 0.006, "attention": 0.002, "host": 0.002},
        {"linear": 0.020, "attention": 0.004, "host": 0.006},
        {"linear": 0.300, "attention": 0.050, "host": 0.050},  # not a decode step
        {"linear": 0.012, "attention": 0.003, "host": 0.005},
    ]
    (batch,) = summarize_decode_steps(steps, ops)["by_batch"]
    assert batch["rows"] == 2 and batch["median_ms"] == pytest.approx(20.0)
    assert batch["ops_ms"] == {
        "linear": pytest.approx(12.0),
        "attention": pytest.approx(3.0),
        "host": pytest.approx(5.0),
    }
    assert "ops_ms" not in summarize_decode_steps(steps)["by_batch"][0]


def test_decode_step_floor_matches_a_hand_computation():
    from llm_operator_bench.suites.decode import step_floor

    shape = TINY_SHAPE
    weights = shape.linear_weights() + shape.vocab_size * shape.hidden_size
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    floor = step_floor(
        shape, element_bytes=4, rows=8, prefix_tokens=100, own_tokens=10,
        bandwidth=1e9, rate_flops=1e9,
    )  # fmt: skip
    assert floor["bytes"] == (weights + kv_per_token * (100 + 8 * 10)) * 4
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * 110
    assert floor["flop"] == 8 * (2 * weights + attention)
    assert floor["memory_ms"] == pytest.approx(floor["bytes"] / 1e6)
    assert floor["compute_ms"] == pytest.approx(floor["flop"] / 1e6)
    assert floor["floor_ms"] == max(floor["memory_ms"], floor["compute_ms"])
    # one row is bound by memory, many rows by arithmetic
    one = step_floor(shape, element_bytes=4, rows=1, prefix_tokens=100, own_tokens=10,
                     bandwidth=1e9, rate_flops=1e12)  # fmt: skip
    assert one["floor_ms"] == one["memory_ms"]


def test_bench_decode_times_native_against_the_floor(tiny_llama_dir, tmp_path, capsys):
    code = main(
        ["bench", "decode", "--model", str(tiny_llama_dir), "--systems", "native",
         "--batch-rows", "1,3", "--prefix-tokens", "40", "--dtypes", "float32",
         "--decode-tokens", "6", "--repeat", "2", "--out", str(tmp_path), "--name", "dec"]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "dec.json").read_text())
    assert report["bandwidth_gbs"] > 0 and report["matmul_rate"]["float32"] > 0
    assert [(e["rows"], e["prefix"], e["dtype"]) for e in report["table"]] == [
        (1, 40, "float32"),
        (3, 40, "float32"),
    ]
    for entry in report["table"]:
        assert entry["floor_ms"] > 0 and entry["native_ms"] > 0
        assert len(entry["native_runs_ms"]) == 2
        assert entry["native_ms"] == pytest.approx(statistics.median(entry["native_runs_ms"]))
        split = entry["native_split_ms"]
        assert set(split) == {"linear", "attention", "kv_store", "elementwise", "sampling", "host"}
        assert split["linear"] > 0 and split["attention"] > 0
        assert "vllm_ms" not in entry
    markdown = (tmp_path / "dec.md").read_text()
    assert "| float32 | 40 | 3 |" in markdown and "native / floor" in markdown
    assert "by kind of work" in capsys.readouterr().out
    with pytest.raises(ValueError, match="decode systems"):
        from llm_operator_bench.suites.decode import run_decode_bench

        run_decode_bench(model=str(tiny_llama_dir), systems=("hf",), out=tmp_path)
