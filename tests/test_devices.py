"""GPU executors without a GPU: device choice for Spark tasks and Dask workers, the KV
budget on a shared GPU, one engine per worker and device, and several GPUs per engine
(vLLM only). CUDA is faked: visible-device lists, task resources, worker positions and
monkeypatched ``torch.cuda`` functions."""

from __future__ import annotations

import argparse
import pickle
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from llm_operator import options as option_table
from llm_operator.config import EngineConfig
from llm_operator.engine import factory
from llm_operator.integrations import devices, worker
from llm_operator.integrations.devices import (
    Device,
    cuda_index,
    gpu_share_of,
    spark_task_device,
    task_placement,
    worker_placement,
)
from llm_operator.integrations.infer_options import InferOptions
from llm_operator.sampling import SamplingParams

GIB = 2**30


def placed(device) -> tuple:
    """(name, gpu_share) of a placement (share None for plain strings)."""
    return (None, None) if device is None else (str(device), getattr(device, "gpu_share", None))


# -- Spark tasks ----------------------------------------------------------------------
def test_an_explicit_device_wins_over_the_task_gpu():
    assert task_placement("cpu", ["3"]) is None  # the engine keeps device="cpu"
    assert task_placement("cuda:1", ["3"], visible=["3"]) is None
    assert task_placement(" AUTO ", ["3"]) == "cuda:3"


def test_task_gpu_address_maps_through_cuda_visible_devices():
    assert placed(task_placement("auto", ["3", "1"])) == ("cuda:3", None)  # the first one
    assert task_placement("auto", ["3"], visible=["2", "3"]) == "cuda:1"
    assert task_placement("auto", ["3"], visible=["3"]) == "cuda:0"  # isolated per task
    assert task_placement("auto", ["03"], visible=["1", "3"]) == "cuda:1"  # as numbers
    uuid = "GPU-8f6c0d1e"
    assert task_placement("auto", [uuid], visible=["GPU-0000", uuid]) == "cuda:1"
    with pytest.raises(ValueError, match=r"'3' is not in CUDA_VISIBLE_DEVICES='0,1'"):
        task_placement("auto", ["3"], visible=["0", "1"])
    with pytest.raises(ValueError, match="'GPU-8f6c0d1e' is not a device index"):
        cuda_index(uuid, None)
    assert task_placement("auto", []) == "cpu"
    assert task_placement("auto", None) == "cpu"


def test_task_gpu_amount_is_the_engine_share_of_its_gpu():
    assert placed(task_placement("auto", ["0"], gpu_amount="0.25")) == ("cuda:0", 0.25)
    assert placed(task_placement("auto", ["0"], gpu_amount="1")) == ("cuda:0", None)
    assert [gpu_share_of(v) for v in ("0.5", 2, None, "x", "0", "-1", "nan")] == [
        0.5,
        None,
        None,
        None,
        None,
        None,
        None,
    ]
    device = Device("cuda:2", 0.25)
    assert device == "cuda:2" and hash(device) == hash("cuda:2")  # an engine key as before
    copy = pickle.loads(pickle.dumps(device))
    assert placed(copy) == ("cuda:2", 0.25) and isinstance(copy, Device)


class TaskContext:
    """What spark_task_device reads of pyspark's TaskContext."""

    def __init__(self, addresses=None, properties=None):
        from pyspark.resource import ResourceInformation

        self._resources = (
            {} if addresses is None else {"gpu": ResourceInformation("gpu", addresses)}
        )
        self._properties = properties or {}

    def resources(self):
        return self._resources

    def getLocalProperty(self, key):
        return self._properties.get(key)


def test_spark_task_device_reads_the_task_context(monkeypatch):
    pytest.importorskip("pyspark")
    from llm_operator.integrations.spark import task_device

    amount = {"spark.task.resource.gpu.amount": "0.25"}
    env = {"CUDA_VISIBLE_DEVICES": "1,3"}
    device = spark_task_device(TaskContext(["3"], amount), "auto", env)
    assert placed(device) == ("cuda:1", 0.25)
    assert placed(spark_task_device(TaskContext(["3"]), "auto", {})) == ("cuda:3", None)
    assert spark_task_device(TaskContext(), "auto", env) == "cpu"
    assert spark_task_device(None, "auto", env) == "cpu"
    assert spark_task_device(TaskContext(["3"], amount), "cpu", env) is None

    # the Spark UDF's own function, reading this process's CUDA_VISIBLE_DEVICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,3")
    options = SimpleNamespace(engine=EngineConfig())
    assert placed(task_device(TaskContext(["3"], amount), options)) == ("cuda:1", 0.25)
    assert (
        task_device(TaskContext(["3"]), SimpleNamespace(engine=EngineConfig(device="cpu"))) is None
    )
    with pytest.raises(ValueError, match=r"'7' is not in CUDA_VISIBLE_DEVICES='5,3'"):
        task_device(TaskContext(["7"]), options)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert task_device(TaskContext(["3"]), options) == "cuda:3"
    assert task_device(TaskContext(), options) == "cpu"


def test_a_spark_task_reads_the_gpu_amount_of_its_session(spark):
    """The worker learns the task's GPU amount from the job's local properties (Spark SQL
    copies the session's ``spark.*`` settings there). Local mode cannot hand out GPUs,
    so the task's GPU address is faked; the amount is the session's, read in the task."""
    from pyspark.sql import functions as F

    @F.pandas_udf("string")
    def placement(batch: pd.Series) -> pd.Series:
        from pyspark import TaskContext
        from pyspark.resource import ResourceInformation

        from llm_operator.integrations.devices import spark_task_device

        class WithGpu:  # the real task context, given GPU 3
            def __init__(self, context):
                self.context = context

            def resources(self):
                return {"gpu": ResourceInformation("gpu", ["3"])}

            def getLocalProperty(self, key):
                return self.context.getLocalProperty(key)

        device = spark_task_device(WithGpu(TaskContext.get()), "auto", {})
        return pd.Series([repr(device)] * len(batch))

    frame = spark.range(1).select(F.col("id").cast("string").alias("id"))
    spark.conf.set("spark.task.resource.gpu.amount", "0.25")
    try:
        shared = frame.select(placement("id")).collect()[0][0]
    finally:
        spark.conf.unset("spark.task.resource.gpu.amount")
    whole = frame.select(placement("id")).collect()[0][0]
    assert (shared, whole) == (
        "Device('cuda:3', gpu_share=0.25)",
        "Device('cuda:3', gpu_share=None)",
    )


# -- Dask workers ---------------------------------------------------------------------
def test_dask_worker_placement():
    assert worker_placement("cuda:1", gpu_count=4, host_position=(0, 4)) is None
    assert worker_placement("auto", gpu_count=0, host_position=(0, 4)) is None  # CPU as today
    assert worker_placement("auto", gpu_count=2, host_position=None) is None  # not a worker
    assert worker_placement("auto", gpu_count=4, visible=["2"]) == "cuda:0"  # dask-cuda
    assert worker_placement("auto", gpu_count=4, resources={"gpu_index": 2.0}) == "cuda:2"
    with pytest.raises(ValueError, match="gpu_index resource is 4, but it sees 4 GPU"):
        worker_placement("auto", gpu_count=4, resources={"gpu_index": 4})
    # four workers on a host of two GPUs: two per GPU, each counting on half of it
    four = [placed(worker_placement("auto", gpu_count=2, host_position=(i, 4))) for i in range(4)]
    assert four == [("cuda:0", 0.5), ("cuda:1", 0.5), ("cuda:0", 0.5), ("cuda:1", 0.5)]
    three = [placed(worker_placement("auto", gpu_count=2, host_position=(i, 3))) for i in range(3)]
    assert three == [("cuda:0", 0.5), ("cuda:1", None), ("cuda:0", 0.5)]
    two = [placed(worker_placement("auto", gpu_count=4, host_position=(i, 2))) for i in range(2)]
    assert two == [("cuda:0", None), ("cuda:1", None)]


def test_dask_workers_on_one_host_take_gpus_in_turn(monkeypatch):
    distributed = pytest.importorskip("distributed")
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_host_positions", {})
    assert devices.dask_worker_device("auto") is None  # no worker here: the option's auto
    with (
        distributed.LocalCluster(
            n_workers=3, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        workers = client.scheduler_info(n_workers=-1)["workers"]
        by_name = {}
        for address, info in workers.items():
            future = client.submit(
                devices.dask_worker_device, "auto", workers=[address], pure=False
            )
            by_name[info["name"]] = placed(future.result())
        explicit = client.submit(devices.dask_worker_device, "cpu", pure=False).result()
    assert by_name == {0: ("cuda:0", 0.5), 1: ("cuda:1", None), 2: ("cuda:0", 0.5)}
    assert explicit is None


def test_dask_worker_device_reads_the_worker(monkeypatch):
    distributed = pytest.importorskip("distributed")
    worker = SimpleNamespace(
        address="tcp://10.0.0.7:4001", state=SimpleNamespace(total_resources={"gpu_index": 1})
    )
    monkeypatch.setattr(distributed, "get_worker", lambda: worker)
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert placed(devices.dask_worker_device("auto")) == ("cuda:1", None)
    worker.state.total_resources = {}

    def no_scheduler(worker):
        raise OSError("scheduler gone")

    monkeypatch.setattr(devices, "host_position", no_scheduler)
    assert devices.dask_worker_device("auto") is None  # the option's auto, as before
    monkeypatch.setattr(devices, "host_position", lambda worker: (3, 4))
    assert placed(devices.dask_worker_device("auto")) == ("cuda:1", 0.5)
    assert devices.dask_worker_device("auto", {"CUDA_VISIBLE_DEVICES": "GPU-a1"}) == "cuda:0"


def test_dask_partition_runs_on_the_worker_device(monkeypatch):
    from llm_operator.integrations import dask as llm_dask

    calls = []

    def run_partition(values, options, *, device=None, label=""):
        calls.append(device)
        return []

    monkeypatch.setattr(llm_dask, "run_partition", run_partition)
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # one GPU per worker: its cuda:0
    empty = pd.DataFrame({"prompt": pd.Series([], dtype=object)})
    options = SimpleNamespace(engine=EngineConfig(), constraint_col=None)
    llm_dask._infer_partition(empty, "prompt", options, "out")
    explicit = SimpleNamespace(engine=EngineConfig(device="cpu"), constraint_col=None)
    llm_dask._infer_partition(empty, "prompt", explicit, "out")
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    llm_dask._infer_partition(empty, "prompt", options, "out")
    assert calls == ["cuda:0", None, None]


# -- one engine per worker and device ------------------------------------------------
class FakeBackend:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


class FakeOperator:
    def __init__(self, model, **engine):
        self.model, self.engine = model, engine
        self._backend = FakeBackend()


@pytest.fixture
def fake_engines(monkeypatch):
    import llm_operator

    monkeypatch.setattr(llm_operator, "LLMOperator", FakeOperator)
    monkeypatch.setattr(worker, "_engines", {})
    monkeypatch.setattr(worker, "_constructions", {})
    monkeypatch.setattr(worker, "_partition_locks", {})
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    return emptied


def infer_options(**engine):
    return InferOptions(model="m", engine=EngineConfig(**engine), sampling=SamplingParams())


def test_a_worker_moved_to_another_gpu_releases_its_old_engine(fake_engines):
    options, other = infer_options(), infer_options(max_batch_size=8)
    first = worker.get_operator(options, "cuda:0")
    assert worker.get_operator(options, "cuda:0") is first  # same options and device
    kept = worker.get_operator(other, "cuda:0")  # other options: not this one's to drop
    assert first.engine["device"] == "cuda:0" and fake_engines == []
    second = worker.get_operator(options, "cuda:1")
    assert second is not first and second.engine["device"] == "cuda:1"
    assert first._backend.closed and not kept._backend.closed
    assert fake_engines == [True]  # torch.cuda.empty_cache after the release
    assert set(worker._engines) == {options.engine_key("cuda:1"), other.engine_key("cuda:0")}
    assert worker.engine_constructions(options.engine_key("cuda:0")) == 1
    assert worker.engine_constructions(options.engine_key("cuda:1")) == 1
    assert worker.engine_constructions() == 3
    assert worker.get_operator(options, "cuda:1") is second  # reused again
    assert worker.engine_constructions() == 3


def test_a_busy_engine_is_not_released(fake_engines):
    options = infer_options()
    first = worker.get_operator(options, "cuda:0")
    with worker._partition_lock(first):  # another thread runs a partition on it
        second = worker.get_operator(options, "cuda:1")
    assert not first._backend.closed and fake_engines == []
    assert worker._engines[options.engine_key("cuda:0")] is first
    assert worker.get_operator(options, "cuda:0") is first
    worker.get_operator(options, "cpu")  # both idle now: both released
    assert first._backend.closed and second._backend.closed
    assert list(worker._engines) == [options.engine_key("cpu")]


def test_the_device_share_reaches_the_engine(fake_engines):
    shared = worker.get_operator(infer_options(), Device("cuda:1", 0.25))
    assert shared.engine["device"] == "cuda:1" and type(shared.engine["device"]) is str
    assert shared.engine["gpu_share"] == 0.25
    chosen = worker.get_operator(infer_options(gpu_share=0.5), Device("cuda:1", 0.25))
    assert chosen.engine["gpu_share"] == 0.5  # the option wins
    whole = worker.get_operator(infer_options(max_batch_size=4), "cuda:1")
    assert whole.engine["gpu_share"] is None


# -- the KV budget on a shared GPU ------------------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of 80 GiB, 60 GiB free, of which this process holds 2 GiB (its weights)."""
    memory = {"free": 60 * GIB, "total": 80 * GIB, "held": 2 * GIB}
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (memory["free"], memory["total"])
    )
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: memory["held"])
    return memory


def test_auto_kv_budget_counts_only_the_share_of_a_shared_gpu(fake_gpu):
    cuda = torch.device("cuda", 0)
    assert factory.auto_kv_cache_bytes(cuda) == int(60 * GIB * 0.8)  # as before: 80% of free
    assert factory.auto_kv_cache_bytes(cuda, share=1.0) == int(60 * GIB * 0.8)
    # a quarter of the GPU: 20 GiB, less the 2 GiB this process holds, times 0.8
    assert factory.auto_kv_cache_bytes(cuda, share=0.25) == int(18 * GIB * 0.8)
    # four tenants, each on its quarter, fit together on the card
    assert 4 * (factory.auto_kv_cache_bytes(cuda, share=0.25) + 2 * GIB) <= 80 * GIB
    fake_gpu["free"] = 10 * GIB  # the others took more than their share: what is free
    assert factory.auto_kv_cache_bytes(cuda, share=0.25) == int(10 * GIB * 0.8)
    fake_gpu["held"] = 21 * GIB
    with pytest.raises(ValueError, match=r"holds 21.00 GiB .* share is 0.25 of 80.00 GiB"):
        factory.auto_kv_cache_bytes(cuda, share=0.25)
    cpu = factory.auto_kv_cache_bytes(torch.device("cpu"), share=0.25)  # CPU: as before
    assert cpu == factory.auto_kv_cache_bytes(torch.device("cpu")) > 0


def test_kv_budget_reads_the_config(fake_gpu):
    cuda = torch.device("cuda", 0)
    assert factory.kv_budget(EngineConfig(gpu_share=0.5), cuda) == int(38 * GIB * 0.8)
    assert factory.kv_budget(EngineConfig(kv_cache_memory="1GiB", gpu_share=0.5), cuda) == GIB


# -- several GPUs per engine --------------------------------------------------------------
def test_parallel_sizes_and_gpu_share_are_checked_options():
    config = EngineConfig(backend="vllm", tensor_parallel_size=4, pipeline_parallel_size=2)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (4, 2)
    hash(config)
    assert EngineConfig().tensor_parallel_size is None and EngineConfig().gpu_share is None
    one = EngineConfig(backend="native", tensor_parallel_size=1, pipeline_parallel_size=1)
    assert one.tensor_parallel_size == 1  # one GPU: any backend
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(TypeError, match="pipeline_parallel_size must be an int"):
        EngineConfig(pipeline_parallel_size="2")
    for bad in (0, 1.5, -0.25):
        with pytest.raises(ValueError, match=r"gpu_share must be in \(0, 1\]"):
            EngineConfig(gpu_share=bad)
    assert set(option_table.split({"tensor_parallel_size": 2, "gpu_share": 0.5})["engine"]) == {
        "tensor_parallel_size",
        "gpu_share",
    }
    parser = argparse.ArgumentParser()
    option_table.add_arguments(parser, ["engine"])
    args = parser.parse_args(["--tensor-parallel-size", "2", "--gpu-share", "0.25"])
    chosen = option_table.from_arguments(args, ["engine"])
    assert chosen["tensor_parallel_size"] == 2 and chosen["gpu_share"] == 0.25


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_native_and_hf_refuse_several_gpus(backend):
    name = "tensor_parallel_size"
    with pytest.raises(ValueError, match=rf'{name}=2: the {backend} backend .*backend="vllm"'):
        EngineConfig(backend=backend, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r'pipeline_parallel_size=3: .*backend="vllm"'):
        EngineConfig(backend=backend, pipeline_parallel_size=3)
    # backend="auto" resolved to native or hf: refused before any model loads
    info = SimpleNamespace(native_unsupported=None if backend == "native" else "not Llama")
    auto = EngineConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=rf"{name}=2: the {backend} backend runs on one device"):
        factory.build_backend(auto, info, tokenizer=None)


def test_vllm_backend_passes_parallel_sizes_and_share_to_llm(monkeypatch):
    from llm_operator.engine.vllm import backend as vllm_backend
    from llm_operator.engine.vllm import driver

    monkeypatch.setattr(vllm_backend, "require_vllm", lambda: None)
    monkeypatch.setattr(driver, "on_cpu", lambda: False)  # a GPU platform, without vLLM

    def options(**engine):
        config = EngineConfig(backend="vllm", vllm_options={"max_model_len": 128}, **engine)
        backend = vllm_backend.VLLMBackend("/m", None, config, max_context=256)
        return backend.engine_options()

    plain = options()
    assert "tensor_parallel_size" not in plain and "pipeline_parallel_size" not in plain
    assert "gpu_memory_utilization" not in plain
    assert options(tensor_parallel_size=1)["tensor_parallel_size"] == 1  # given: passed
    split = options(tensor_parallel_size=4, pipeline_parallel_size=2, gpu_share=0.5)
    assert (split["tensor_parallel_size"], split["pipeline_parallel_size"]) == (4, 2)
    assert split["gpu_memory_utilization"] == pytest.approx(0.45)
    assert split["max_model_len"] == 128 and split["model"] == "/m"
    sized = options(gpu_share=0.5, kv_cache_memory="1GiB")  # a fixed budget: no utilization
    assert "gpu_memory_utilization" not in sized and sized["kv_cache_memory_bytes"] == GIB
    config = EngineConfig(
        backend="vllm",
        tensor_parallel_size=2,
        vllm_options={"max_model_len": 128, "tensor_parallel_size": 8},
    )
    backend = vllm_backend.VLLMBackend("/m", None, config, max_context=256)
    assert backend.engine_options()["tensor_parallel_size"] == 8  # vllm_options win
