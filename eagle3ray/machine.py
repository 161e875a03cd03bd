"""This machine and its Ray: what the CPU is good at, and the one way a command connects to (or starts) Ray.

Everything here reads the machine it runs on (``/proc/cpuinfo``, ``RAY_ADDRESS``), which is why it is apart
from the schema (:mod:`eagle3ray.config` stays pure: the same YAML validates the same everywhere). The config's
``auto`` values are resolved through these functions once, by :func:`eagle3ray.config.resolve`, in the process
that loads the config (the CLI or the job driver), and recorded in ``<run>/config.resolved.yaml``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cpu_bf16_is_fast(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AMX-BF16 tiles (Intel Sapphire Rapids and later), where bf16 matmuls beat fp32.

    On AVX2-only CPUs bf16 runs much slower than fp32; with AMX-BF16 it runs faster (measured by
    ``benchmarks/dtype.py`` and ``benchmarks/train_step_cost.py``; figures in the documentation). CPUs with
    AVX512-BF16 but no AMX were not measured, so they count as slow. Reads the ``flags`` line of ``cpuinfo``
    (Linux) of the calling process's machine; False when it cannot be read.
    """
    try:
        with open(cpuinfo) as fh:
            for line in fh:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str, device: str) -> str:
    """A concrete compute dtype for ``auto``: bfloat16 on CUDA and on CPUs with AMX-BF16, else float32.

    Other values are returned unchanged. Raises nothing.
    """
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" or cpu_bf16_is_fast() else "float32"


def resolve_autocast(setting: str, device_type: str) -> bool:
    """Whether the draft's forward runs under bf16 autocast for ``train.autocast`` (auto|bfloat16|off) on
    ``device_type`` ("cuda"/"cpu"): auto follows :func:`resolve_dtype`. Raises nothing."""
    if setting == "auto":
        return resolve_dtype("auto", device_type) == "bfloat16"
    return setting == "bfloat16"


def ensure_ray(cfg) -> bool:
    """Connect to (or start) Ray per ``cfg.ray``; returns True when this call started the connection.

    ``ray.address`` (or ``RAY_ADDRESS``, set for drivers of ``ray job submit``) attaches to a running cluster;
    otherwise a local cluster of ``ray.num_cpus`` logical CPUs starts for the duration of the process. Token
    authentication stays as Ray configures it (on by default in Ray 2.60); a local cluster binds to 127.0.0.1
    and starts no dashboard unless ``ray.include_dashboard`` is set. Actors' output reaches this terminal only
    with ``--verbose`` (:mod:`eagle3ray.logs`).
    """
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    from .logs import quiet_loggers, verbose

    if address:
        ray.init(address=address, namespace=cfg.ray.namespace, log_to_driver=verbose())
    else:
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.include_dashboard,
                 namespace=cfg.ray.namespace, _node_ip_address="127.0.0.1", log_to_driver=verbose(),
                 runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    quiet_loggers()
    return True
