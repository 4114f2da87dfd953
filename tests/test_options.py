"""One options table: every option reaches every entry point, with one default."""

from __future__ import annotations

import argparse
import inspect
import json
import typing
from dataclasses import MISSING, fields, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm_operator import EngineConfig, LLMOperator, SamplingParams
from llm_operator import options as option_table
from llm_operator.cli import build_parser, main
from llm_operator.integrations import infer_options, worker
from llm_operator.prompts.options import PromptOptions

# A value other than the default for every option; a new option must add one here.
PROBES = {
    "backend": "native",
    "device": "cpu",
    "dtype": "float32",
    "kv_cache_memory": "96MiB",
    "max_batch_size": 7,
    "prefill_batch_tokens": 333,
    "kv_block_size": 8,
    "min_shared_tokens": 5,
    "share_prefixes": False,
    "decode_first": False,
    "token_batching": False,
    "jump_forward": "text",
    "cuda_graphs": "off",
    "kernels": "torch",
    "quantization": "none",
    "overlap": "on",
    "profile_ops": True,
    "deterministic": False,
    "stats_log": "/tmp/llm-operator-probe-stats.jsonl",
    "trust_remote_code": True,
    "progress": True,
    "cache_dir": "/tmp/llm-operator-probe-cache",
    "revision": "main",  # a directory model: ignored (tests/test_hub_models.py checks it)
    "gpu_share": 0.5,
    "tensor_parallel_size": 1,  # > 1 only on the vLLM backend (tests/test_devices.py)
    "pipeline_parallel_size": 1,
    "vllm_options": {"enforce_eager": True, "max_num_seqs": 3},
    "max_tokens": 3,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "stop": ("zz",),
    "seed": 11,
    "ignore_eos": True,
    "choices": ("yes", "no"),
    "logprobs": True,
    "chat": True,
    "system": "Be brief.",
    "dedupe": True,
    "co_locate": False,
}
# prompts built from columns: template and columns exclude each other and a prompt column
TABLE_VARIANTS = [
    {"template": "Q: {prompt}\nK: {key}", "reorder_fields": True},
    {"columns": ("prompt", "key"), "instruction": "Answer.", "reorder_fields": True},
]

# constraints exclude each other: the others are probed in place of choices
EXCLUSIVE = {
    "regex": "(yes|no)",
    "json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
}
# a model server's options: with backend "openai" only (base_url with another is an error)
SERVER = {
    "backend": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": "sk-probe",
    "server_model": "probe", "api": "chat", "max_concurrency": 5, "request_order": "table",
    "request_timeout": 12.5, "max_retries": 2,
}  # fmt: skip
VARIANTS = (
    [PROBES]
    + [
        {**{k: v for k, v in PROBES.items() if k != "choices"}, name: value}
        for name, value in EXCLUSIVE.items()
    ]
    + [{**PROBES, **SERVER}]
)


# Every option's default, written out: the fields' defaults must not drift.
DEFAULTS = {
    EngineConfig: {
        "backend": "auto", "device": "auto", "dtype": "auto", "kv_cache_memory": "auto",
        "max_batch_size": None, "prefill_batch_tokens": None, "kv_block_size": 16,
        "min_shared_tokens": 4, "share_prefixes": True, "decode_first": True,
        "token_batching": True, "jump_forward": "tokens", "cuda_graphs": "auto",
        "kernels": "auto", "quantization": "auto", "overlap": "auto", "profile_ops": False,
        "deterministic": None, "stats_log": None, "trust_remote_code": False,
        "progress": False,
        "cache_dir": None, "revision": None, "gpu_share": None, "tensor_parallel_size": None,
        "pipeline_parallel_size": None, "vllm_options": (), "base_url": None,
        "api_key": None, "server_model": None, "api": "auto", "max_concurrency": 32,
        "request_order": "plan", "request_timeout": 600.0, "max_retries": 6,
    },
    SamplingParams: {
        "max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop": (),
        "seed": None, "ignore_eos": False, "choices": None, "regex": None,
        "json_schema": None, "logprobs": False,
    },
    PromptOptions: {
        "chat": "auto", "system": None, "template": None, "columns": None,
        "instruction": None, "reorder_fields": False, "dedupe": False, "co_locate": True,
    },
}  # fmt: skip


def test_the_options_are_typed_fields_of_the_config_classes() -> None:
    """What an editor or mypy reads: each option is a field written in its class body, with
    a type and a default; the table, the CLI and the keyword signatures are exactly these."""
    assert option_table.CLASSES == {
        "engine": EngineConfig,
        "sampling": SamplingParams,
        "prompt": PromptOptions,
    }
    for scope_name, cls in option_table.CLASSES.items():
        declared = {f.name: f.default for f in fields(cls)}
        assert declared == DEFAULTS[cls], cls
        assert all(f.default is not MISSING and f.default_factory is MISSING for f in fields(cls))
        assert list(cls.__annotations__) == list(declared)  # in the class body, in this order
        hints = typing.get_type_hints(cls)  # the annotations resolve to real types
        assert list(hints) == list(declared)
        assert {name: getattr(cls, name) for name in declared} == declared  # class attributes
        table = option_table.scope(scope_name)
        assert [(o.name, o.default) for o in table] == list(declared.items())
        assert [o.annotation for o in table] == [cls.__annotations__[n] for n in declared]
        assert cls() == cls(**declared)
    engine, sampling = typing.get_type_hints(EngineConfig), typing.get_type_hints(SamplingParams)
    assert (engine["max_batch_size"], engine["share_prefixes"]) == (int | None, bool)
    assert engine["kv_cache_memory"] == int | str and engine["cache_dir"] == str | None
    assert (sampling["temperature"], sampling["seed"]) == (float, int | None)
    assert sampling["stop"] == tuple[str, ...]
    assert typing.get_type_hints(PromptOptions)["columns"] == tuple[str, ...] | None
    every = [f.name for cls in option_table.CLASSES.values() for f in fields(cls)]
    assert list(option_table.BY_NAME) == every

    # the command line: one group per scope holding exactly its fields, in order
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command in ("run", "plan"):
        groups = {g.title: g for g in commands.choices[command]._action_groups}
        for scope_name, cls in option_table.CLASSES.items():
            group = groups[option_table.GROUP_TITLES[scope_name]]
            assert [a.dest for a in group._group_actions] == [f.name for f in fields(cls)]

    # the keyword signatures: exactly the fields, with their defaults
    from llm_operator.integrations import dask, spark

    def options_of(function, own: set[str]) -> dict[str, object]:
        parameters = inspect.signature(function).parameters
        assert all(p.kind != p.VAR_KEYWORD for p in parameters.values())
        return {n: p.default for n, p in parameters.items() if n not in own}

    assert options_of(LLMOperator, {"model"}) == DEFAULTS[EngineConfig]
    everything = {k: v for defaults in DEFAULTS.values() for k, v in defaults.items()}
    own = {"col", "ddf", "model", "engine_options", "value", "output"}
    own |= {"choices_col", "regex_col", "json_schema_col"}  # columns, not options
    assert options_of(spark.llm_infer, own) == everything
    assert options_of(dask.llm_infer, own) == everything


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_a_backend_reads_its_settings_from_the_config_it_is_given(tiny_llama_dir, backend):
    op = LLMOperator(
        tiny_llama_dir, backend=backend, max_batch_size=2, prefill_batch_tokens=64,
        kv_block_size=4, device="cpu",
    )  # fmt: skip
    assert op.backend().engine_config is op.config
    results = op.generate(["a b c", "a b d", "a b e"], SamplingParams(max_tokens=3))
    assert [r.finish_reason for r in results] != ["error"] * 3
    if backend == "native":
        assert op.backend().block_size == 4
        assert op.backend().last_profile.max_running <= 2


def test_every_option_has_a_probe_value_other_than_its_default() -> None:
    table = {name: value for variant in TABLE_VARIANTS for name, value in variant.items()}
    assert set(PROBES) | set(EXCLUSIVE) | set(SERVER) | set(table) == set(option_table.BY_NAME)
    for name, value in {**PROBES, **EXCLUSIVE, **SERVER, **table}.items():
        assert value != option_table.BY_NAME[name].default, name


def test_the_table_builds_the_config_the_sampling_parameters_and_the_signatures() -> None:
    engine = option_table.scope("engine")
    sampling = option_table.scope("sampling")
    assert [f.name for f in fields(EngineConfig)] == [o.name for o in engine]
    assert [f.name for f in fields(SamplingParams)] == [o.name for o in sampling]
    assert EngineConfig() == EngineConfig(**{o.name: o.default for o in engine})
    assert SamplingParams() == SamplingParams(**{o.name: o.default for o in sampling})
    operator = inspect.signature(LLMOperator)
    for option in engine:
        assert operator.parameters[option.name].default == option.default, option.name
    from llm_operator.integrations import dask, spark

    for infer in (spark.llm_infer, dask.llm_infer):
        parameters = inspect.signature(infer).parameters
        for option in option_table.OPTIONS:
            assert parameters[option.name].default == option.default, (infer, option.name)
    # every option is on the command line of run and plan, with the table's default
    for command in ("run", "plan"):
        args = build_parser().parse_args([command, "in.csv", "--prompt-col", "p", "--output", "o"]
                                         if command == "run" else [command, "in.csv",
                                                                   "--prompt-col", "p"])  # fmt: skip
        chosen = option_table.from_arguments(args)
        assert chosen == {"progress": True}  # the only CLI default of its own: a bar on a terminal


@pytest.mark.parametrize("bad", [{"max_batch_size": 0}, {"top_p": 2.0}, {"backend": "gpu"}])
def test_a_bad_value_is_refused_by_every_entry_point(bad) -> None:
    from llm_operator.integrations import dask, spark

    (name,) = bad
    for call in (
        lambda: infer_options.make_options(model="m", **bad),
        lambda: spark.llm_infer("prompt", model="m", **bad),
        lambda: dask.llm_infer(_dask_frame(), "prompt", model="m", **bad),
    ):
        with pytest.raises((ValueError, TypeError), match=name):
            call()


def test_an_unknown_option_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match="max_batch"):
        infer_options.make_options(model="m", max_batch=3)
    with pytest.raises(TypeError, match="max_batch"):
        LLMOperator("no-such-model", max_batch=3)


@pytest.mark.parametrize(
    "call",
    [
        lambda: SamplingParams(max_token=8),
        lambda: EngineConfig(max_batchsize=8),
        lambda: infer_options.make_options(model="m", max_token=8),
        lambda: LLMOperator("no-such-model", max_batchsize=8),
    ],
)
def test_an_unknown_option_suggests_the_closest(call) -> None:
    """A misspelt option names the option meant (max_token -> max_tokens), not only the
    list of every option; the class's own TypeError is not Python's bare one."""
    with pytest.raises(TypeError, match=r"unknown option '(max_token|max_batchsize)' \(did you "
                       r"mean '(max_tokens|max_batch_size)'"):  # fmt: skip
        call()


def test_the_command_line_decodes_escapes_and_takes_inline_json(tmp_path) -> None:
    """A shell passes ``\\n`` literally: the CLI decodes it in --template, --instruction,
    --system and --stop (not in --regex); --json-schema is inline JSON or a file."""
    parser = build_parser()
    schema = '{"type": "object", "properties": {"a": {"type": "string"}}}'
    argv = ["run", "in.csv", "--output", "o.jsonl", "--template", r"Title: {title}\nIs it?",
            "--instruction", r"a\tb", "--system", r"one\ntwo", "--stop", r"\n", "--stop", "END",
            "--regex", r"\d+", "--json-schema", schema]  # fmt: skip
    chosen = option_table.from_arguments(parser.parse_args(argv))
    assert chosen["template"] == "Title: {title}\nIs it?"
    assert chosen["instruction"] == "a\tb" and chosen["system"] == "one\ntwo"
    assert chosen["stop"] == ["\n", "END"]
    assert chosen["regex"] == r"\d+"
    assert json.loads(chosen["json_schema"]) == json.loads(schema)
    path = tmp_path / "schema.json"
    path.write_text(schema)
    argv[-1] = str(path)
    assert json.loads(option_table.from_arguments(parser.parse_args(argv))["json_schema"]) == {
        "type": "object", "properties": {"a": {"type": "string"}}}  # fmt: skip
    argv[-1] = str(tmp_path / "missing.json")
    with pytest.raises(SystemExit):
        parser.parse_args(argv)


def test_every_option_reaches_the_worker_operator(tiny_llama_dir) -> None:
    """InferOptions -> the worker's LLMOperator (get_operator) and its sampling."""
    options = infer_options.make_options(model=str(tiny_llama_dir), **PROBES)
    expected = _expected(tiny_llama_dir)
    assert options == expected
    operator = worker.get_operator(options)
    for option in option_table.scope("engine"):
        assert getattr(operator.config, option.name) == getattr(expected.engine, option.name)
    for template in (True, False):  # chat=True: messages, with or without a template
        assert options.prompts(["hi"], template) == [
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        ]


def _expected(model: Path, probes: dict = PROBES) -> infer_options.InferOptions:
    scoped = option_table.split(probes)
    return infer_options.InferOptions(
        model=str(model),
        engine=EngineConfig(**scoped["engine"]),
        sampling=SamplingParams(**scoped["sampling"]),
        chat=True,
        system="Be brief.",
        dedupe=True,
        co_locate=scoped["prompt"].get("co_locate", True),
    )


class _Captured(Exception):
    """Raised by the spy once the entry point under test has built its options."""


def _spy(monkeypatch, after_calls: int) -> list:
    """Record every make_options result; stop the job at call number ``after_calls``."""
    seen: list = []
    real = infer_options.make_options

    def spy(**kwargs):
        seen.append(real(**kwargs))
        if len(seen) >= after_calls:
            raise _Captured()
        return seen[-1]

    from llm_operator.integrations import dask, spark

    for module in (infer_options, spark, dask):
        monkeypatch.setattr(module, "make_options", spy)
    return seen


def _dask_frame():
    import dask.dataframe as dd
    import pandas as pd

    return dd.from_pandas(pd.DataFrame({"prompt": ["a", "b"]}), npartitions=1)


@pytest.mark.parametrize("probes", VARIANTS, ids=["choices", "regex", "json_schema", "server"])
def test_spark_and_dask_llm_infer_take_every_option(
    monkeypatch, tiny_llama_dir, spark, probes
) -> None:
    from llm_operator.integrations import dask, spark

    seen = _spy(monkeypatch, after_calls=99)
    probed = []  # the driver's probe of a model server (tests/test_openai_requests.py)
    for module in (spark, dask):
        monkeypatch.setattr(module, "check_server", probed.append)
    spark.llm_infer("prompt", model=str(tiny_llama_dir), **probes)
    dask.llm_infer(_dask_frame(), "prompt", model=str(tiny_llama_dir), **probes)
    # the older spelling: engine options as one mapping
    engine = {k: v for k, v in probes.items() if k in option_table.defaults("engine")}
    rest = {k: v for k, v in probes.items() if k not in engine}
    spark.llm_infer("prompt", model=str(tiny_llama_dir), engine_options=engine, **rest)
    assert seen == [_expected(tiny_llama_dir, probes)] * 3
    assert probed == seen  # each call probes with the options it built


def _cli_arguments(probes: dict, folder: Path) -> list[str]:
    """PROBES as command-line flags, built from the table's own spellings."""
    argv: list[str] = []
    for name, value in probes.items():
        option = option_table.BY_NAME[name]
        if name == "choices":
            argv += [option.flag, ",".join(value)]
        elif name == "json_schema":  # the CLI reads it from a file
            schema = folder / "schema.json"
            schema.write_text(json.dumps(value))
            argv += [option.flag, str(schema)]
        elif option.cli == "flag":
            argv.append(option.flag if value else "--no-" + option.flag[2:])
        elif option.cli == "append":
            for item in value:
                argv += [option.flag, item]
        elif option.cli == "items":
            for key, item in value.items():
                argv += [option.flag.removesuffix("s"), f"{key}={str(item).lower()}"]
        else:
            argv += [option.flag, str(value)]
    return argv


@pytest.mark.parametrize(
    "engine, probes",
    [("local", v) for v in VARIANTS] + [("spark", PROBES), ("dask", PROBES)],
    ids=["local-choices", "local-regex", "local-json_schema", "local-server", "spark", "dask"],
)
def test_the_cli_passes_every_option_to_every_engine(
    engine, probes, monkeypatch, tiny_llama_dir, tmp_path, request
) -> None:
    """The CLI's options reach the engine's own llm_infer (spark, dask) or the operator
    (local): `--engine spark --backend hf` once lost --backend."""
    if engine == "spark":
        request.getfixturevalue("spark")  # the shared local session (getOrCreate reuses it)
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"p": ["one prompt", "another prompt"]}), table)
    # local: engines.generate checks them, then builds the operator; spark/dask: the
    # engine's llm_infer checks them again on the way to the workers
    seen = _spy(monkeypatch, after_calls=1 if engine == "local" else 2)
    argv = ["run", str(table), "--prompt-col", "p", "--output", str(tmp_path / "o.parquet")]
    argv += ["--engine", engine, "--model", str(tiny_llama_dir)]
    argv += _cli_arguments(probes, tmp_path)
    with pytest.raises(_Captured):
        main(argv)
    # the CLI dedupes the whole table itself, before any engine runs
    expected = replace(_expected(tiny_llama_dir, probes), dedupe=False)
    if engine != "local":  # workers log a line per partition instead of drawing bars
        expected = replace(expected, engine=replace(expected.engine, progress=False))
    assert seen[-1] == expected
    assert len(seen) == (1 if engine == "local" else 2)


def test_the_cli_plan_uses_the_engine_and_prompt_options(tiny_llama_dir, tmp_path, capsys) -> None:
    table = tmp_path / "in.parquet"
    shared = "A long shared instruction that every row repeats before its own text: "
    pq.write_table(pa.table({"p": [shared + "one", shared + "two"]}), table)
    base = ["plan", str(table), "--prompt-col", "p", "--model", str(tiny_llama_dir), "--json"]
    import json

    assert main(base) == 0
    sharing = json.loads(capsys.readouterr().out)
    assert main([*base, "--no-share-prefixes"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main([*base, "--system", "Be brief."]) == 0
    chat = json.loads(capsys.readouterr().out)
    assert sharing["prefill_tokens"] < alone["prefill_tokens"] == alone["prompt_tokens"]
    assert chat["prompt_tokens"] > sharing["prompt_tokens"]  # the system message was added


@pytest.mark.parametrize("variant", TABLE_VARIANTS, ids=["template", "columns"])
def test_the_table_options_reach_every_entry_point(
    monkeypatch, tiny_llama_dir, spark, variant
) -> None:
    """template / columns / instruction / reorder_fields build the same TablePrompt in
    make_options, Spark and Dask llm_infer and the command line."""
    import dask.dataframe as dd
    import pandas as pd

    from llm_operator.integrations import dask, spark
    from llm_operator.prompts.table import TablePrompt

    given = {k: v for k, v in variant.items() if k != "reorder_fields"}
    expected = TablePrompt.build(**given)
    options = infer_options.make_options(model="m", **variant)
    assert (options.table, options.reorder_fields) == (expected, True)
    seen = _spy(monkeypatch, after_calls=99)
    # Spark's llm_infer makes a column (reordering needs llm_infer_df and the whole frame)
    spark.llm_infer(model=str(tiny_llama_dir), **given)
    frame = dd.from_pandas(pd.DataFrame({"prompt": ["a", "b"], "key": ["k", "k"]}), npartitions=1)
    monkeypatch.setattr(dask, "co_locate", lambda ddf, col: ddf)  # no sampling pass here
    dask.llm_infer(frame, model=str(tiny_llama_dir), **variant)
    assert [o.table for o in seen] == [expected] * 2
    assert [o.reorder_fields for o in seen] == [False, True]
    argv = ["run", "in.csv", "--output", "o.jsonl", "--reorder-fields", "--dedupe"]
    if "template" in variant:
        argv += ["--template", variant["template"]]
    else:
        argv += ["--columns", ",".join(variant["columns"]), "--instruction", variant["instruction"]]
    chosen = option_table.from_arguments(build_parser().parse_args(argv))
    validated = {k: option_table.BY_NAME[k].validate(v) for k, v in chosen.items()}
    assert {k: v for k, v in validated.items() if k != "progress"} == {
        **{k: option_table.BY_NAME[k].validate(v) for k, v in variant.items()},
        "dedupe": True,
    }


def test_chat_auto_wraps_strings_only_for_a_model_with_a_chat_template(tiny_llama_dir) -> None:
    """The default: a chat template makes each string a user message; none leaves it raw;
    chat=False keeps raw text even with a template; a bad value is refused up front."""
    from llm_operator.prompts.encode import as_chat

    auto = infer_options.make_options(model=str(tiny_llama_dir))
    assert auto.chat == "auto"
    user = [{"role": "user", "content": "hi"}]
    assert auto.prompts(["hi", None, ""], True) == [user, None, ""]
    assert auto.prompts(["hi"], False) == ["hi"]
    raw = infer_options.make_options(model=str(tiny_llama_dir), chat=False)
    assert raw.prompts(["hi"], True) == ["hi"]
    system = infer_options.make_options(model=str(tiny_llama_dir), system="Be brief.")
    assert system.prompts(["hi"], False)[0][0] == {"role": "system", "content": "Be brief."}
    assert as_chat(["hi"], chat="auto", chat_template=True) == [user]
    with pytest.raises(ValueError, match='chat must be True, False or "auto"'):
        infer_options.make_options(model=str(tiny_llama_dir), chat="yes")
