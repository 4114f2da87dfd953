"""Which device a worker's engine runs on, and how much of a shared GPU it may count on.

The choice is made of pure functions (``task_placement``, ``worker_placement``) over
plain values, so it is tested without a GPU; thin wrappers read those values where the
work runs (``spark_task_device``: a Spark task's context; ``dask_worker_device``: the
Dask worker running the partition).

- An explicit ``device`` option (anything but "auto") always wins: the wrappers return
  None and the engine keeps the option's device.
- Spark: a task given a "gpu" resource runs on its first address. Addresses are physical
  GPU ids (what the discovery script reports); where ``CUDA_VISIBLE_DEVICES`` is set, the
  process numbers only the devices it lists, so the address becomes its position in that
  list (an address missing from it is an error naming both). The task's share of the GPU
  is ``spark.task.resource.gpu.amount`` (0.25: four tasks per GPU), read from the job's
  local properties (Spark SQL copies the session's ``spark.*`` settings there). A task
  without a GPU resource runs on the CPU.
- Dask: a worker whose ``CUDA_VISIBLE_DEVICES`` names one device (dask-cuda style) runs
  on ``cuda:0``; a worker given a ``gpu_index`` resource runs on that GPU; otherwise the
  worker's position among the workers on its host, modulo the GPU count, picks the GPU,
  and workers that land on one GPU share it evenly. Without CUDA: as before (the option's
  "auto", i.e. the CPU).

A device comes back as a ``Device``: a str ("cuda:1") that also carries the share
(``gpu_share``, None for a whole GPU); ``worker.get_operator`` gives the share to the
engine (``EngineConfig.gpu_share``) unless the options set one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger("llm_operator.integrations")

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
SPARK_TASK_GPU_AMOUNT = "spark.task.resource.gpu.amount"
DASK_GPU_INDEX = "gpu_index"  # a Dask worker resource: the GPU (as the worker numbers them)


class Device(str):
    """A device name that carries the share of its GPU the engine may count on."""

    gpu_share: float | None

    def __new__(cls, name: str, gpu_share: float | None = None) -> Device:
        device = super().__new__(cls, name)
        device.gpu_share = gpu_share
        return device

    def __reduce__(self):
        return (Device, (str(self), self.gpu_share))

    def __repr__(self) -> str:
        return f"Device({str(self)!r}, gpu_share={self.gpu_share!r})"


def is_auto(device: Any) -> bool:
    return isinstance(device, str) and device.strip().lower() == "auto"


def visible_devices(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (None: not set, every device is visible)."""
    value = (os.environ if environ is None else environ).get(VISIBLE_DEVICES)
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def cuda_index(address: str, visible: Sequence[str] | None) -> int:
    """The CUDA index this process uses for the physical GPU ``address``."""
    address = str(address).strip()
    if visible is None:
        if not address.isdigit():
            raise ValueError(
                f"GPU address {address!r} is not a device index and {VISIBLE_DEVICES} is "
                "not set, so it names no device of this process"
            )
        return int(address)
    for position, entry in enumerate(visible):
        if entry == address or (
            entry.isdigit() and address.isdigit() and int(entry) == int(address)
        ):
            return position
    raise ValueError(
        f"this task's GPU address {address!r} is not in {VISIBLE_DEVICES}="
        f"{','.join(visible)!r}: this process cannot see that GPU. Make the GPU discovery "
        f"script report the devices {VISIBLE_DEVICES} lists, or leave {VISIBLE_DEVICES} unset"
    )


def gpu_share_of(amount: Any) -> float | None:
    """A task's GPU amount as the share of one GPU it may count on: None (the whole GPU)
    for 1 or more, or where the amount is missing or not a positive number."""
    try:
        value = float(amount)
    except (TypeError, ValueError):
        return None
    if not 0 < value < 1:  # NaN, <= 0: unknown; >= 1: whole GPUs
        return None
    return value


def task_placement(
    device_option: str,
    gpu_addresses: Sequence[str] | None,
    *,
    visible: Sequence[str] | None = None,
    gpu_amount: Any = None,
) -> str | None:
    """A Spark task's device (module doc): None (the option's device) when ``device`` is
    set, ``Device("cuda:<index>", share)`` for a task given GPUs, else "cpu"."""
    if not is_auto(device_option):
        return None
    if gpu_addresses:
        index = cuda_index(gpu_addresses[0], visible)
        return Device(f"cuda:{index}", gpu_share_of(gpu_amount))
    return "cpu"


def spark_task_device(
    context: Any, device_option: str, environ: Mapping[str, str] | None = None
) -> str | None:
    """``task_placement`` for a Spark ``TaskContext`` (None outside a task)."""
    if not is_auto(device_option):
        return None
    addresses, amount = None, None
    if context is not None:
        gpus = context.resources().get("gpu")
        addresses = list(gpus.addresses) if gpus is not None else None
        get_property = getattr(context, "getLocalProperty", None)
        if addresses and get_property is not None:
            try:
                amount = get_property(SPARK_TASK_GPU_AMOUNT)
            except Exception:  # noqa: BLE001 - no local properties: the whole GPU
                amount = None
    return task_placement(
        device_option, addresses, visible=visible_devices(environ), gpu_amount=amount
    )


def worker_placement(
    device_option: str,
    *,
    gpu_count: int,
    visible: Sequence[str] | None = None,
    resources: Mapping[str, Any] | None = None,
    host_position: tuple[int, int] | None = None,
) -> str | None:
    """A Dask worker's device (module doc).

    gpu_count: CUDA devices this process sees. resources: the worker's resources.
    host_position: (this worker's position, workers) among the workers on its host, None
    when unknown (not on a distributed worker).
    """
    if not is_auto(device_option) or gpu_count < 1:
        return None
    index = (resources or {}).get(DASK_GPU_INDEX)
    if index is not None:
        index = int(index)
        if not 0 <= index < gpu_count:
            raise ValueError(
                f"this Dask worker's {DASK_GPU_INDEX} resource is {index}, but it sees "
                f"{gpu_count} GPU(s)"
            )
        return Device(f"cuda:{index}")
    if visible is not None and len(visible) == 1:
        return Device("cuda:0")
    if host_position is None:
        return None  # not a distributed worker: the option's "auto" (the current device)
    position, workers = host_position
    index = position % gpu_count
    tenants = len(range(index, max(workers, position + 1), gpu_count))  # workers on this GPU
    return Device(f"cuda:{index}", 1 / tenants if tenants > 1 else None)


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_host_positions: dict[str, tuple[int, int]] = {}  # worker address -> its host position


def host_position(worker: Any) -> tuple[int, int] | None:
    """(position, count) of ``worker`` among the workers on its host, in the order of
    their names (LocalCluster numbers them 0, 1, ...), then addresses; asked of the
    scheduler once per worker."""
    known = _host_positions.get(worker.address)
    if known is not None:
        return known
    from distributed import get_client

    try:
        info = get_client().scheduler_info(n_workers=-1)
    except TypeError:  # an older distributed
        info = get_client().scheduler_info()
    workers = info.get("workers", {})
    host = _host(worker.address)
    same = [(address, w.get("name")) for address, w in workers.items() if _host(address) == host]
    if worker.address not in {address for address, _ in same}:
        return None
    same.sort(key=lambda item: _name_order(item[1]) + (item[0],))
    position = [address for address, _ in same].index(worker.address)
    _host_positions[worker.address] = (position, len(same))
    return position, len(same)


def _host(address: str) -> str:
    """The host of a worker address ("tcp://10.0.0.1:4000", "inproc://10.0.0.1/pid/n")."""
    try:
        from distributed.comm import get_address_host

        return get_address_host(address)
    except (ImportError, ValueError):
        scheme, _, location = address.rpartition("://")
        if scheme == "inproc":
            return location.split("/", 1)[0]
        return location.rsplit(":", 1)[0]


def _name_order(name: Any) -> tuple:
    if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
        return (0, int(name), "")
    return (1, 0, str(name))


def current_dask_worker() -> Any:
    """The distributed Worker running this task, or None (no distributed, or not inside a
    worker's task)."""
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        return None


def dask_worker_device(device_option: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``worker_placement`` for the Dask worker running this task (None, the option's
    device, where it is explicit, without CUDA, or outside a distributed worker)."""
    if not is_auto(device_option):
        return None
    count = gpu_count()
    if count < 1:
        return None
    worker = current_dask_worker()
    visible = visible_devices(environ)
    state = getattr(worker, "state", None)
    resources = dict(getattr(state, "total_resources", None) or {})
    position = None
    one_visible = visible is not None and len(visible) == 1
    if worker is not None and not one_visible and DASK_GPU_INDEX not in resources:
        try:
            position = host_position(worker)
        except Exception as error:  # noqa: BLE001 - no answer: the current device, as before
            logger.warning("could not place this worker on a GPU (%s); using auto", error)
    return worker_placement(
        device_option,
        gpu_count=count,
        visible=visible,
        resources=resources,
        host_position=position,
    )
