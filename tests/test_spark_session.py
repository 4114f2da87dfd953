"""The quieted local SparkSession: its settings and the JVM stderr filter (no JVM starts
here; the CLI's Spark tests run a job through it)."""

from __future__ import annotations

import subprocess
import sys
import warnings

from llm_operator.integrations import spark_session


def test_settings_point_at_the_shipped_log4j_config(monkeypatch):
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    settings = spark_session.session_settings()
    assert spark_session.LOG4J_CONFIG.is_file()
    option = f"-Dlog4j.configurationFile={spark_session.LOG4J_CONFIG.as_uri()}"
    assert settings["spark.driver.extraJavaOptions"] == option
    assert settings["spark.ui.enabled"] == "false"
    assert settings["spark.executorEnv.PYTHONWARNINGS"] == spark_session.WORKER_WARNING_FILTER


def test_worker_filter_keeps_the_users_warnings_settings(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "error::UserWarning")
    value = spark_session.session_settings()["spark.executorEnv.PYTHONWARNINGS"]
    # the last filter wins: ours, for PySpark's pandas message only
    assert value == f"error::UserWarning,{spark_session.WORKER_WARNING_FILTER}"


def test_worker_filter_silences_only_the_pandas_message():
    code = (
        "import warnings\n"
        "warnings.warn('PySpark does not yet fully support pandas >= 3.0.0. x', FutureWarning)\n"
        "warnings.warn('another future', FutureWarning)\n"
    )
    env = {"PYTHONWARNINGS": spark_session.WORKER_WARNING_FILTER}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "another future" in done.stderr
    assert "PySpark does not yet" not in done.stderr


def test_driver_filter_silences_only_the_pandas_message():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spark_session.quiet_pandas_warning()
        for message, category in (
            ("PySpark does not yet fully support pandas >= 3.0.0.", FutureWarning),
            ("PySpark does not yet fully support pandas", UserWarning),
            ("another future", FutureWarning),
        ):
            warnings.warn(message, category, stacklevel=1)
    assert [str(w.message) for w in caught] == [
        "PySpark does not yet fully support pandas",
        "another future",
    ]


def test_stderr_filter_drops_only_the_jvm_noise():
    lines = [
        b"WARNING: Using incubator modules: jdk.incubator.vector\n",
        b"26/12/03 08:05:58 ERROR Executor: Exception in task 1.0\n",
        b"WARNING: something else\n",
        b"no newline at the end",
    ]
    done = subprocess.run(
        spark_session.stderr_filter_command(),
        input=b"".join(lines),
        capture_output=True,
        check=True,
    )
    assert done.stdout == b"".join(lines[1:])
