"""The SparkSession of the CLI's Spark engine, without Spark's startup noise.

>>> from llm_operator.integrations.spark_session import local_session, session
>>> spark = local_session(4)  # local[4], no UI, no console progress, log level ERROR
>>> spark = session(4, "sc://host:15002")  # --master: Spark Connect, or any classic master

What is quieted, and nothing else (errors, and any other warning, still show):

- PySpark 4's ``FutureWarning`` "PySpark does not yet fully support pandas >= 3.0.0", which
  the driver raises at each pandas UDF: a filter for that message in the driver, and
  ``PYTHONWARNINGS`` for the Python workers (``spark.executorEnv``);
- the JVM's startup WARN lines (native-hadoop library, loopback hostname) and Spark's
  banners about its default log4j profile: ``spark-log4j2.properties`` (next to this
  module), passed to the driver JVM before it starts;
- the JVM's own ``WARNING: Using incubator modules: jdk.incubator.vector`` (Spark's launcher
  always adds that module), which no logging setting reaches: when this function starts the
  JVM, its stderr goes through a small filter process that drops that line and passes every
  other line on to this process's stderr.

Settings that need a new JVM take effect only when no SparkContext (or JVM gateway) exists
yet; otherwise the running one is reused, as ``SparkSession.builder.getOrCreate`` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LOG4J_CONFIG = Path(__file__).with_name("spark-log4j2.properties")

# the start of PySpark's message (a warnings filter matches a message by its start)
PANDAS_WARNING = "PySpark does not yet fully support pandas"
# the same filter in the syntax of PYTHONWARNINGS / -W (action:message:category)
WORKER_WARNING_FILTER = f"ignore:{PANDAS_WARNING}:FutureWarning"

# lines the JVM prints to stderr itself, outside log4j
JVM_NOISE = (b"WARNING: Using incubator modules:",)

# runs as `python -I -S -c`: copies stdin to stdout line by line, less the JVM_NOISE lines;
# ignores Ctrl-C like the JVM does, so the JVM's last words still come through
_FILTER_CODE = """\
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
noise = tuple(arg.encode() for arg in sys.argv[1:])
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    if not line.startswith(noise):
        out.write(line)
        out.flush()
"""

_stderr_filters: list[subprocess.Popen] = []  # kept referenced while they run


def local_session(partitions: int, app_name: str = "llm-operator") -> SparkSession:
    """A SparkSession on ``local[partitions]`` (the existing one if there is one), with no
    UI, no console progress bar, the log level at ERROR and the startup noise quieted."""
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")
    return classic_session(f"local[{partitions}]", app_name)


def session(
    partitions: int, master: str | None = None, app_name: str = "llm-operator"
) -> SparkSession:
    """The CLI's session: ``local_session(partitions)`` without ``master``; a Spark Connect
    session for ``sc://host:port``; else a classic session on that master (``local[4]``,
    ``local-cluster[2,1,1024]``, ``spark://host:7077``, ``yarn``, ``k8s://...``)."""
    if master is None:
        return local_session(partitions, app_name)
    if not isinstance(master, str) or not master.strip():
        raise ValueError(f"master must be a Spark master URL or sc://host:port, got {master!r}")
    if master.startswith("sc://"):
        return connect_session(master)
    return classic_session(master, app_name)


def connect_session(url: str) -> SparkSession:
    """A Spark Connect session on ``url`` (``sc://host:port``). The server runs the jobs,
    with its own settings (master, application name, UI); the Python workers are the
    server's, so they need llm_operator installed. ValueError when this process runs a classic SparkContext
    already (PySpark keeps one mode per process)."""
    quiet_pandas_warning()
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is not None:
        raise ValueError(
            f"cannot connect to {url}: this process runs a classic SparkContext already "
            "(PySpark allows one mode per process); stop it first, or run in a new process"
        )
    try:
        return SparkSession.builder.remote(url).getOrCreate()
    except ImportError as error:  # grpcio and friends: pip install 'pyspark[connect]'
        raise ValueError(
            f"Spark Connect needs the pyspark[connect] packages ({error}): "
            "pip install 'llm-operator[spark]' or 'pyspark[connect]'"
        ) from None


def classic_session(master: str, app_name: str = "llm-operator") -> SparkSession:
    """A classic SparkSession on ``master`` (the existing one if there is one, whatever its
    master, as ``getOrCreate`` does), quieted as ``local_session``. On a ``local`` or
    ``local-cluster`` master the Python workers run this interpreter and Spark binds to
    127.0.0.1 (unless PYSPARK_PYTHON / SPARK_LOCAL_IP say otherwise); on a cluster both
    are left to the cluster's settings."""
    if master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    quiet_pandas_warning()
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    settings = session_settings()
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    if SparkContext._active_spark_context is None and SparkContext._gateway is None:
        conf = SparkConf().setMaster(master).setAppName(app_name)
        conf.setAll(list(settings.items()))
        gateway = _launch_filtered_gateway(conf)
        if gateway is not None:
            SparkContext(conf=conf, gateway=gateway)  # getOrCreate below picks it up
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def session_settings() -> dict[str, str]:
    """The Spark settings of ``local_session`` besides master and app name."""
    worker_warnings = [os.environ.get("PYTHONWARNINGS", ""), WORKER_WARNING_FILTER]
    return {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        # read by the driver JVM at startup (a URI: no quoting issue with spaces in the path)
        "spark.driver.extraJavaOptions": f"-Dlog4j.configurationFile={LOG4J_CONFIG.as_uri()}",
        # the Python workers' environment; the last filter wins, so the user's own
        # PYTHONWARNINGS still applies to every other warning
        "spark.executorEnv.PYTHONWARNINGS": ",".join(w for w in worker_warnings if w),
    }


def quiet_pandas_warning() -> None:
    """Ignore PySpark's FutureWarning about pandas >= 3 in this process (that one message)."""
    warnings.filterwarnings("ignore", message=PANDAS_WARNING, category=FutureWarning)


def stderr_filter_command() -> list[str]:
    """The filter process: stdin to stdout line by line, less the lines starting with one
    of JVM_NOISE."""
    return [sys.executable, "-I", "-S", "-c", _FILTER_CODE, *(n.decode() for n in JVM_NOISE)]


def _launch_filtered_gateway(conf: Any) -> Any:
    """Start the JVM gateway with its stderr through the JVM_NOISE filter; None when the
    filter cannot run (then Spark starts the JVM as usual)."""
    from pyspark.java_gateway import launch_gateway

    try:
        # its stdout is this process's stderr (fd 2), where the JVM would have written
        stderr_filter = subprocess.Popen(stderr_filter_command(), stdin=subprocess.PIPE, stdout=2)
    except (OSError, ValueError):
        return None
    _stderr_filters.append(stderr_filter)
    try:
        return launch_gateway(conf, popen_kwargs={"stderr": stderr_filter.stdin})
    finally:
        # the JVM holds its own copy: the filter ends when the JVM (and its children) do
        stderr_filter.stdin.close()
