"""A Spark ML transformer over ``llm_infer``: LLM columns as a ``pyspark.ml.Pipeline`` stage.

>>> from pyspark.ml import Pipeline, PipelineModel
>>> from pyspark.ml.feature import SQLTransformer
>>> from llm_operator.integrations.spark_ml import LLMTransformer
>>> pipeline = Pipeline(stages=[
...     SQLTransformer(statement="SELECT *, concat('Classify: ', review) AS prompt FROM __THIS__"),
...     LLMTransformer(inputCol="prompt", outputCol="out", errorCol="error",
...                    model="smollm2-135m-instruct", options={"max_tokens": 8}),
... ])
>>> model = pipeline.fit(df)                 # no fitting: the stages are transformers
>>> model.write().overwrite().save("/models/classify")
>>> PipelineModel.load("/models/classify").transform(df).select("out.text", "error")

Like SynapseML's ``OpenAIPrompt``: an input column of prompts, an output column, an
optional top-level error column, options that travel with the pipeline when it is saved.
``LLMTransformer`` is a pure-Python ``Transformer`` whose ``_transform`` is
``llm_infer_df(dataset, inputCol, output=outputCol, model=model, **options)``, i.e.
``dataset.withColumn(outputCol, llm_infer(inputCol, model=model, **options))`` plus
``llm_infer_df``'s driver-side checks of the prompt column's type: the output column is
the struct ``text, finish_reason, prompt_tokens, completion_tokens, error, logprob,
choice_logprobs`` (and ``value`` with ``json_schema``). Nothing runs until an action.

Params:

- ``inputCol``: the prompt column (strings, or chat message lists). Leave it unset when
  the ``template`` or ``columns`` option renders each prompt from the row's columns.
- ``outputCol``: the struct column (default ``"llm_output"``).
- ``errorCol``: optional; when set, the struct's ``error`` is also copied to this
  top-level column (null on rows that succeeded).
- ``model``: an alias (``smollm2-135m-instruct``), a model directory or a Hub id.
- ``options``: every other ``llm_infer`` option as one JSON object (a string Param, so
  ``DefaultParamsWritable`` saves it): engine, sampling and prompt options of
  ``llm_operator.options`` (``backend``, ``max_batch_size``, ``max_tokens``,
  ``temperature``, ``stop``, ``chat``, ``system``, ``template``, ``choices``,
  ``json_schema``, ...) and ``llm_infer``'s own keywords ``engine_options``, ``value``,
  ``choices_col``, ``regex_col``, ``json_schema_col``. Set it from a dict
  (``setOptions``, ``LLMTransformer(options={...})``, a ``transform`` param map) or from
  JSON text. Each name and value is checked when it is set: an unknown name raises
  TypeError (with a did-you-mean hint), a bad value the option's own error. Checks that
  involve several options (two constraints at once, a template with an input column)
  run at ``transform``, on the driver, before any Spark job. Values must be JSON values
  (tuples come back as lists; a path becomes its string).

``setMaxTokens``/``setTemperature``/``setTemplate`` (and ``setOption(name, value)``) are
shortcuts that write into ``options``, so each option has one place and one saved value;
they are not Params of their own.

Persistence: ``DefaultParamsReadable``/``DefaultParamsWritable``: ``save``/``load`` alone
or as a stage of a saved ``Pipeline``/``PipelineModel`` (metadata JSON only; the model
itself is not copied, it is named by ``model``). The options are saved as they are, in
plain text, so saving one whose options hold an ``api_key`` is refused (the ``openai``
backend reads ``$OPENAI_API_KEY`` when ``api_key`` is unset).

Spark Connect (PySpark 4.x, tried on 4.3): ``transform`` works (DataFrame API only), and
so do ``save``/``load`` of the transformer alone and of a ``Pipeline`` or
``PipelineModel`` holding it, ``overwrite()`` included; files saved on classic Spark load
on Connect and the other way round. PySpark's ``DefaultParamsWriter``/``Reader`` write
and read the metadata with DataFrame operations (``createDataFrame(...).write.text``,
``read.text``), which Connect runs on the server, so the files land on the server's file
system; a pipeline's Java stages (``SQLTransformer``) go through Connect's ML commands.
One thing PySpark's own writer lacks there: ``MLWriter.overwrite()`` removes the old
path through ``sparkSession._jsparkSession``, which raises on Connect
``PySparkAttributeError: [JVM_ATTRIBUTE_NOT_SUPPORTED] Attribute `_jsparkSession` is not
supported in Spark Connect as it depends on the JVM``; ``LLMTransformer.write()`` returns
``LLMTransformerWriter``, which asks the server's ML helper instead (as PySpark's
``Pipeline`` writer does on Connect). Saving to an existing path without
``overwrite()`` fails on both: ``[PATH_ALREADY_EXISTS] Path .../metadata already
exists``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from pyspark import keyword_only
from pyspark.ml import Transformer
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasInputCol, HasOutputCol
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable, DefaultParamsWriter
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from llm_operator import options as option_table
from llm_operator.option_fields import unknown_options_message

__all__ = [
    "DEFAULT_OUTPUT_COL",
    "INFER_KEYWORDS",
    "LLMTransformer",
    "LLMTransformerWriter",
    "check_options",
]

DEFAULT_OUTPUT_COL = "llm_output"
INFER_KEYWORDS = ("engine_options", "value", "choices_col", "regex_col", "json_schema_col")
"""``llm_infer``'s keywords besides ``model`` that are not ``llm_operator.options`` fields."""
_SHORTCUTS = {"maxTokens": "max_tokens", "temperature": "temperature", "template": "template"}


def _known_names() -> list[str]:
    return [o.name for o in option_table.OPTIONS] + list(INFER_KEYWORDS)


def _json_value(value: Any) -> Any:
    """``value`` as a JSON value: paths as strings, tuples as lists, mappings as objects."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {_json_key(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def _json_key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"option mappings need string keys, got {key!r}")
    return key


def _check_keyword(name: str, value: Any) -> None:
    """llm_infer's own keywords (INFER_KEYWORDS)."""
    if name == "engine_options":
        if value is None:
            return
        if not isinstance(value, Mapping):
            raise TypeError(f"engine_options must be a mapping, got {value!r}")
        option_table.split(value, ["engine"])  # TypeError naming unknown engine options
        for key, item in value.items():
            option_table.BY_NAME[key].validate(item)
    elif name == "value":
        if not isinstance(value, bool):
            raise TypeError(f"value must be a bool, got {value!r}")
    elif value is not None and (not isinstance(value, str) or not value):
        raise TypeError(f"{name} must be a column name (a string), got {value!r}")


def check_options(options: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """The options as a dict of JSON values, each name and value checked.

    options: a mapping, or JSON text of an object. TypeError for an unknown name (naming
    the close ones) or a value that is not a JSON value; an option's own TypeError or
    ValueError for a bad value; ValueError for ``model`` (a Param of its own).
    """
    if options is None:
        return {}
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except json.JSONDecodeError as error:
            raise ValueError(f"options must be a JSON object, got {options!r}: {error}") from None
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict of llm_infer options, got {options!r}")
    if "model" in options:
        raise ValueError("model is a Param of its own: use setModel(...) or model=...")
    names = [_json_key(name) for name in options]
    unknown = [n for n in names if n not in option_table.BY_NAME and n not in INFER_KEYWORDS]
    if unknown:
        raise TypeError(unknown_options_message(unknown, _known_names()))
    checked = {}
    for name, value in options.items():
        value = _json_value(value)
        if name in INFER_KEYWORDS:
            _check_keyword(name, value)
        else:
            option_table.BY_NAME[name].validate(value)
        checked[name] = value
    try:
        json.dumps(checked, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"options must be JSON values (so a pipeline can save them): {error}"
        ) from None
    return checked


def _to_options_json(value: Any) -> str:
    """The ``options`` Param's type converter: a dict or JSON text -> checked JSON text."""
    return json.dumps(check_options(value), allow_nan=False)


def _to_model(value: Any) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise TypeError(f"model must be an alias, a directory or a Hub id, got {value!r}")
    return value


def _to_column_name(value: Any) -> str:
    value = TypeConverters.toString(value)
    if not value:
        raise TypeError("a column name must not be empty")
    return value


class LLMTransformerWriter(DefaultParamsWriter):
    """``DefaultParamsWriter``, with ``overwrite()`` on Spark Connect too.

    PySpark's ``MLWriter._handleOverwrite`` calls the JVM through
    ``sparkSession._jsparkSession``, which a Connect session lacks
    (``PySparkAttributeError: [JVM_ATTRIBUTE_NOT_SUPPORTED] Attribute `_jsparkSession` is
    not supported in Spark Connect``); on Connect this asks the server's ML helper to
    remove the path instead, as PySpark's own ``Pipeline`` writer does there."""

    def _handleOverwrite(self, path: str) -> None:
        if _is_connect(self.sparkSession):
            from pyspark.ml.connect.readwrite import RemoteMLWriter

            RemoteMLWriter.handleOverwrite(path, True)
        else:
            super()._handleOverwrite(path)


def _is_connect(session: Any) -> bool:
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
    except ImportError:  # the Connect client's dependencies (grpcio) are not installed
        return False
    return isinstance(session, ConnectSession)


class LLMTransformer(
    Transformer, HasInputCol, HasOutputCol, DefaultParamsReadable, DefaultParamsWritable
):
    """A Spark ML ``Transformer``: ``llm_infer(inputCol, model=model, **options)`` as the
    struct column ``outputCol``, and its ``error`` field as ``errorCol`` when set.

    ``LLMTransformer(inputCol="prompt", outputCol="out", model="smollm2-135m-instruct",
    options={"max_tokens": 32, "temperature": 0.0})``; keywords only. ``maxTokens``,
    ``temperature`` and ``template`` are shortcuts into ``options``. See the module's
    docstring for the Params, persistence and Spark Connect.
    """

    errorCol: Param[str] = Param(
        Params._dummy(),
        "errorCol",
        "optional: a top-level column that gets a copy of the output struct's error "
        "(null where the row succeeded)",
        typeConverter=_to_column_name,
    )
    model: Param[str] = Param(
        Params._dummy(),
        "model",
        "the model: an alias (smollm2-135m-instruct), a model directory or a Hub id",
        typeConverter=_to_model,
    )
    options: Param[str] = Param(
        Params._dummy(),
        "options",
        "every other llm_infer option, as a JSON object: engine, sampling and prompt "
        "options (llm_operator.options: max_tokens, temperature, backend, template, chat, "
        "choices, json_schema, ...) and engine_options, value, choices_col, regex_col, "
        "json_schema_col",
        typeConverter=_to_options_json,
    )

    @keyword_only
    def __init__(
        self,
        *,
        inputCol: str | None = None,
        outputCol: str | None = None,
        errorCol: str | None = None,
        model: str | None = None,
        options: Mapping[str, Any] | str | None = None,
        maxTokens: int | None = None,
        temperature: float | None = None,
        template: str | None = None,
    ) -> None:
        super().__init__()
        self._setDefault(outputCol=DEFAULT_OUTPUT_COL, options="{}")
        self.setParams(**self._input_kwargs)

    @keyword_only
    def setParams(
        self,
        *,
        inputCol: str | None = None,
        outputCol: str | None = None,
        errorCol: str | None = None,
        model: str | None = None,
        options: Mapping[str, Any] | str | None = None,
        maxTokens: int | None = None,
        temperature: float | None = None,
        template: str | None = None,
    ) -> LLMTransformer:
        """Sets the Params given (keywords only); ``maxTokens``, ``temperature`` and
        ``template`` go into ``options`` (after ``options`` itself, if both are given)."""
        kwargs = dict(self._input_kwargs)
        shortcuts = {
            _SHORTCUTS[name]: kwargs.pop(name) for name in list(kwargs) if name in _SHORTCUTS
        }
        if kwargs.get("options") is not None:
            kwargs["options"] = self._merged(check_options(kwargs["options"]), shortcuts)
        elif shortcuts:
            kwargs["options"] = self._merged(self.getOptions(), shortcuts)
        self._set(**{name: value for name, value in kwargs.items() if value is not None})
        return self

    @staticmethod
    def _merged(options: dict[str, Any], shortcuts: dict[str, Any]) -> dict[str, Any]:
        return {**options, **{k: v for k, v in shortcuts.items() if v is not None}}

    # -- accessors --------------------------------------------------------------------
    def setInputCol(self, value: str) -> LLMTransformer:
        """The prompt column."""
        return self._set(inputCol=value)

    def setOutputCol(self, value: str) -> LLMTransformer:
        """The output struct column."""
        return self._set(outputCol=value)

    def setErrorCol(self, value: str | None) -> LLMTransformer:
        """A top-level copy of the struct's error; None removes it."""
        if value is None:
            self.clear(self.errorCol)
            return self
        return self._set(errorCol=value)

    def getErrorCol(self) -> str | None:
        """The error column, or None when not set."""
        return self.getOrDefault(self.errorCol) if self.isDefined(self.errorCol) else None

    def setModel(self, value: str | os.PathLike) -> LLMTransformer:
        return self._set(model=value)

    def getModel(self) -> str | None:
        """The model, or None when not set."""
        return self.getOrDefault(self.model) if self.isDefined(self.model) else None

    def setOptions(self, value: Mapping[str, Any] | str) -> LLMTransformer:
        """Replaces all options (a dict or JSON text); each name and value is checked."""
        return self._set(options=value)

    def getOptions(self) -> dict[str, Any]:
        """The options set (JSON values: lists, not tuples); defaults are left out."""
        return json.loads(self.getOrDefault(self.options))

    def setOption(self, name: str, value: Any) -> LLMTransformer:
        """Sets one option, keeping the others (``None`` removes it)."""
        options = self.getOptions()
        if value is None:
            options.pop(name, None)
        else:
            options[name] = value
        return self.setOptions(options)

    def getOption(self, name: str) -> Any:
        """One option: its value set, else its default; TypeError for an unknown name."""
        options = self.getOptions()
        if name in options:
            return options[name]
        if name in option_table.BY_NAME:
            return option_table.BY_NAME[name].default
        if name in INFER_KEYWORDS:
            return True if name == "value" else None
        raise TypeError(unknown_options_message([name], _known_names()))

    def setMaxTokens(self, value: int) -> LLMTransformer:
        return self.setOption("max_tokens", value)

    def getMaxTokens(self) -> int:
        return self.getOption("max_tokens")

    def setTemperature(self, value: float) -> LLMTransformer:
        return self.setOption("temperature", value)

    def getTemperature(self) -> float:
        return self.getOption("temperature")

    def setTemplate(self, value: str | None) -> LLMTransformer:
        """A prompt template over the row's columns (``"... {title} ..."``), used instead
        of ``inputCol``; None removes it."""
        return self.setOption("template", value)

    def getTemplate(self) -> str | None:
        return self.getOption("template")

    def write(self) -> LLMTransformerWriter:
        """A ``DefaultParamsWriter`` whose ``overwrite()`` works on Spark Connect too.
        ValueError when the options hold an ``api_key``: it would be saved in plain text."""
        if self.getOptions().get("api_key"):
            raise ValueError(
                "the options hold an api_key, which saving would write in plain text into the "
                "pipeline's metadata: drop it from the options and set OPENAI_API_KEY where "
                "the pipeline runs (the openai backend reads it when api_key is unset)"
            )
        return LLMTransformerWriter(self)

    # -- transform --------------------------------------------------------------------
    def _transform(self, dataset: DataFrame) -> DataFrame:
        from llm_operator.integrations.spark import llm_infer_df

        model = self.getModel()
        if model is None:
            raise ValueError(
                "LLMTransformer: model is not set; give model=... (an alias such as "
                "smollm2-135m-instruct, a model directory or a Hub id) or call setModel"
            )
        input_col = self.getInputCol() if self.isDefined(self.inputCol) else None
        output_col = self.getOutputCol()
        error_col = self.getErrorCol()
        columns = dataset.columns
        if input_col is not None:
            _check_column(dataset, columns, input_col)
        for name, param in ((output_col, "outputCol"), (error_col, "errorCol")):
            if name is not None and name in columns:
                raise ValueError(
                    f"LLMTransformer: {param}={name!r} is a column of the dataset already; "
                    "choose another name or drop that column first"
                )
        if error_col is not None and error_col == output_col:
            raise ValueError(f"LLMTransformer: errorCol and outputCol are both {error_col!r}")
        result = llm_infer_df(
            dataset, input_col, output=output_col, model=model, **self.getOptions()
        )
        if error_col is not None:
            result = result.withColumn(error_col, F.col(output_col).getField("error"))
        return result


def _check_column(dataset: DataFrame, columns: list[str], name: str) -> None:
    """ValueError naming ``name`` and the dataset's columns unless ``name`` resolves (a
    top-level column, or a nested field such as ``doc.body``)."""
    if name in columns:
        return
    try:
        dataset.select(F.col(name)).schema  # noqa: B018 (analyzes the plan)
    except Exception:  # AnalysisException (classic or Connect)
        raise ValueError(
            f"LLMTransformer: inputCol {name!r} is not a column of the dataset; its columns: "
            f"{', '.join(columns)}"
        ) from None
