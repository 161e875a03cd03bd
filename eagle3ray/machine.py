"""This machine and its Ray: what the CPU is good at, and the one way a command connects to (or starts) Ray.

Everything here reads the machine it runs on (``/proc/cpuinfo``, ``RAY_ADDRESS``), which is why it is apart
from the schema (:mod:`eagle3ray.config` stays pure: the same YAML validates the same everywhere). The config's
``auto`` values are resolved through these functions once, by :func:`eagle3ray.config.resolve`, in the process
that loads the config (the CLI or the job driver), and recorded in ``<run>/config.resolved.yaml``.

A Ray cluster runs whatever code a caller sends it, so eagle3ray only works on one that checks who is calling:
:func:`ensure_ray` asks the cluster itself whether it refuses a call without a token (:func:`cluster_auth_mode`)
and stops with :class:`UnguardedClusterError` when it does not, unless ``ray.allow_unauthenticated`` says so.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The ``flags`` of the first processor in ``cpuinfo`` (Linux); empty when it cannot be read."""
    try:
        with open(cpuinfo) as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: CPU flags of the bf16 dot-product instructions that oneDNN's bf16 GEMMs (torch, vLLM's CPU backend) run on
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_is_fast(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 dot-product instructions (AMX-BF16 tiles or AVX512-BF16), where bf16 beats fp32.

    Measured (``benchmarks/dtype.py``, ``benchmarks/train_step_cost.py``; figures in docs/results.md): on AVX2-only
    CPUs (among them an AMD EPYC, Zen 3) bf16 runs far slower than fp32; with AMX-BF16
    (Xeon, Sapphire Rapids and later) vLLM's bf16 regeneration and extraction ran 2.9x fp32's; with AVX512-BF16 and
    no AMX (AMD EPYC, family 25 model 17, Zen 4) 1.76x and 1.84x. CPUs with AVX-512 but no AVX512-BF16 were not
    measured and count as slow. Reads the ``flags`` line of ``cpuinfo`` (Linux) of the calling process's machine;
    False when it cannot be read.
    """
    return any(f in cpu_flags(cpuinfo) for f in BF16_FLAGS)


def resolve_dtype(dtype: str, device: str) -> str:
    """A concrete compute dtype for ``auto``: bfloat16 on CUDA and on CPUs with bf16 instructions
    (:func:`cpu_bf16_is_fast`), else float32.

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


#: Where Debian/Ubuntu's libtcmalloc-minimal4 (installed by scripts/setup.sh where apt-get can) puts the library.
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4")


def cpu_engine_env(device: str) -> dict[str, str]:
    """Environment for a process that will host a CPU vLLM engine: tcmalloc preloaded (``LD_PRELOAD``) when it is
    installed, as vLLM's CPU worker asks.

    ``benchmarks/preload.py`` (AMD EPYC, 2 cores, no AMX-BF16; medians of 2 fresh processes per variant, docs/
    results.md): tcmalloc made regeneration 1.11x, extraction 1.14x and decoding 1.14x (1.05x with the draft)
    as fast; Intel OpenMP (libiomp5) gave 0.92-1.07x, so it is not preloaded. Empty for other devices, when
    ``EAGLE3RAY_CPU_PRELOAD=off``, when this process already preloads a tcmalloc, or when none is installed.
    An engine process must *start* with it: eagle3ray's CPU engines run in-process (Ray actors and Serve replicas
    get it through their ``runtime_env``; the plan's probe through its subprocess environment). CPU Ray Train
    workers get it too (``RunConfig.worker_runtime_env``, :func:`eagle3ray.train.train`).
    """
    if device != "cpu" or os.environ.get("EAGLE3RAY_CPU_PRELOAD", "auto") == "off":
        return {}
    current = os.environ.get("LD_PRELOAD", "")
    if "libtcmalloc" in current:
        return {}
    lib = next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)
    if lib is None:
        return {}
    return {"LD_PRELOAD": f"{lib}:{current}" if current else lib}


def tcmalloc_loaded() -> bool:
    """Whether this process has a tcmalloc mapped (``/proc/self/maps``; False where that file does not exist).
    CPU Ray Train workers start with it preloaded where it is installed (:func:`cpu_engine_env`); each train
    metrics row says so as ``worker_tcmalloc``: the fraction of ranks that have it (1.0 on a CPU machine with tcmalloc
    installed, 0.0 on GPU workers or with ``EAGLE3RAY_CPU_PRELOAD=off``)."""
    try:
        with open("/proc/self/maps") as f:
            return "libtcmalloc" in f.read()
    except OSError:
        return False


def engine_actor_options(v) -> dict:
    """``ray.remote`` options of a dedicated vLLM engine actor (regeneration's engine, validation's engines) for the
    verifier section ``v``: its CPUs and GPUs, and on CPU the :func:`cpu_engine_env` environment it must start with."""
    opts: dict = {"num_cpus": v.num_cpus, **({"num_gpus": v.num_gpus} if v.num_gpus else {})}
    env = cpu_engine_env(v.device)
    if env:
        opts["runtime_env"] = {"env_vars": env}
    return opts


class UnguardedClusterError(RuntimeError):
    """The Ray cluster answers calls that carry no authentication token (or could not be asked), and
    ``ray.allow_unauthenticated`` is false. The message says how to turn token authentication on."""


def cluster_auth_mode(gcs_address: str, timeout_s: float = 10.0) -> str:
    """How the Ray cluster whose GCS listens at ``gcs_address`` (``host:port``) treats a caller without a token.

    Returns ``"token"`` when the GCS refuses an unauthenticated read (gRPC ``UNAUTHENTICATED``), ``"disabled"``
    when it answers it. The call is ``NodeInfoGcsService.GetAllNodeInfo(limit=1)`` on a bare gRPC channel (no
    token attached; TLS when ``RAY_USE_TLS`` is set, as Ray's own channels do): what anyone who can reach the
    GCS port could do. It asks the cluster, not this process: ``RAY_AUTH_MODE`` here only says whether *this*
    process sends a token, and a driver that sends one also connects to a cluster that checks nothing.
    Whether the GCS checks is settled where it starts (Ray 2.60: ``RAY_AUTH_MODE=token``, or a ``ray start``
    that finds ``~/.ray/auth_token``; a cluster ``ray.init()`` starts has it on by default).

    Raises:
        ConnectionError: the GCS gave another answer (unreachable, timed out), named by its gRPC status.
    """
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        from ray._common.tls_utils import load_certs_from_env

        cert_chain, private_key, ca_cert = load_certs_from_env()
        creds = grpc.ssl_channel_credentials(certificate_chain=cert_chain, private_key=private_key,
                                             root_certificates=ca_cert)
        channel = grpc.secure_channel(gcs_address, creds)
    else:
        channel = grpc.insecure_channel(gcs_address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(limit=1), timeout=timeout_s)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            return "token"
        raise ConnectionError(f"the GCS at {gcs_address} did not answer a read: gRPC {e.code().name}") from None
    finally:
        channel.close()
    return "disabled"


def _auth_mode_from_inside() -> str:
    """:func:`cluster_auth_mode` of the cluster this process belongs to (runs as a task on it)."""
    import ray

    return cluster_auth_mode(ray.get_runtime_context().gcs_address)


def connected_cluster_auth_mode() -> str:
    """:func:`cluster_auth_mode` of the cluster ``ray.init`` connected this process to.

    A driver (local cluster, ``ray.address`` host:port or ``auto``, a Ray Job's entrypoint) asks the GCS address
    it is connected to. A Ray Client (``ray://``) has no GCS address of its own: a zero-CPU task asks from inside
    the cluster (so eagle3ray must be importable there, as it is in the images of ``docker/``).

    Raises:
        ConnectionError: as :func:`cluster_auth_mode`; ``ray.exceptions.GetTimeoutError`` when the task does not
            run within 60 s.
    """
    import ray
    from ray.util.client import ray as client_ray

    if client_ray.is_connected():
        return ray.get(ray.remote(num_cpus=0)(_auth_mode_from_inside).remote(), timeout=60)
    return cluster_auth_mode(ray.get_runtime_context().gcs_address)


def _without_userinfo(address: str) -> str:
    """``address`` with anything between ``//`` and ``@`` blanked (it is printed in errors)."""
    return re.sub(r"//[^/@]*@", "//***@", address)


_HOW_TO_GUARD = (
    "Turn token authentication on where the cluster starts: `ray get-auth-token --generate` once, then "
    "`RAY_AUTH_MODE=token ray start ...` on every node with that token (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
    "RAY_AUTH_TOKEN; the manifests in cluster/ do this), and run eagle3ray with RAY_AUTH_MODE=token and the same "
    "token. For a cluster that is private by other means, set ray.allow_unauthenticated=true.")


def require_guarded_cluster(allow_unauthenticated: bool, where: str) -> str:
    """Check that the cluster ``ray.init`` connected to refuses callers without a token.

    Returns the mode found (``"token"``, ``"disabled"``, or ``"unknown"`` when it could not be asked and
    ``allow_unauthenticated`` is true; a warning is logged for the last two).

    Raises:
        UnguardedClusterError: the cluster answers unauthenticated calls, or could not be asked, and
            ``allow_unauthenticated`` is false. Fails closed: a cluster whose answer is unknown is refused.
    """
    try:
        mode = connected_cluster_auth_mode()
    except Exception as e:  # noqa: BLE001 - any failure to ask means "not known to be guarded"
        if allow_unauthenticated:
            log.warning("could not tell whether the Ray cluster at %s requires a token (%s); "
                        "ray.allow_unauthenticated is true, going on", where, e)
            return "unknown"
        raise UnguardedClusterError(f"could not tell whether the Ray cluster at {where} requires an authentication "
                                    f"token ({e}), so eagle3ray does not use it. {_HOW_TO_GUARD}") from None
    if mode != "token":
        if not allow_unauthenticated:
            raise UnguardedClusterError(
                f"the Ray cluster at {where} answers calls that carry no authentication token: anyone who can "
                f"reach its ports can run code on it and read what eagle3ray puts there (weights, data, the "
                f"credentials in its environment). {_HOW_TO_GUARD}")
        log.warning("the Ray cluster at %s accepts calls without a token (ray.allow_unauthenticated is true)", where)
    return mode


#: True once :func:`ensure_ray` has started a local cluster in this process (it ends with the process).
STARTED_LOCAL_CLUSTER = False


def ensure_ray(cfg) -> bool:
    """Connect to (or start) Ray per ``cfg.ray``; returns True when this call started the connection.

    ``ray.address`` (or ``RAY_ADDRESS``, set for drivers of ``ray job submit``) attaches to a running cluster;
    otherwise a local cluster of ``ray.num_cpus`` logical CPUs starts for the duration of the process, with
    token authentication on (Ray 2.60 turns it on for a cluster ``ray.init()`` starts unless ``RAY_AUTH_MODE``
    says otherwise; a ``RAY_AUTH_MODE`` other than ``token`` is refused before anything starts). Either way the
    cluster is then asked whether it refuses a call without a token (:func:`require_guarded_cluster`); one that
    does not is disconnected from and refused unless ``ray.allow_unauthenticated`` is true. A local cluster
    binds to 127.0.0.1 and starts no dashboard unless ``ray.include_dashboard`` is set. Actors' output reaches
    this terminal only with ``--verbose`` (:mod:`eagle3ray.logs`). A Ray this process had already initialised
    is used as it is (the caller connected it).

    Raises:
        UnguardedClusterError: the cluster does not require a token (see :func:`require_guarded_cluster`).
    """
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    allow = cfg.ray.allow_unauthenticated
    from .logs import quiet_loggers, verbose

    if address:
        ray.init(address=address, namespace=cfg.ray.namespace, log_to_driver=verbose())
        where = _without_userinfo(address)
    else:
        mode = os.environ.get("RAY_AUTH_MODE")
        if mode is not None and mode.lower() != "token" and not allow:
            raise UnguardedClusterError(
                f"RAY_AUTH_MODE={mode} in this environment would start the local Ray cluster without token "
                "authentication; unset it (a cluster ray.init() starts has token authentication on) or set "
                "ray.allow_unauthenticated=true")
        # address="local": always a cluster of its own. Without it ray.init() attaches to any cluster already running
        # on this machine (`ray start`, another run's), then fails on num_cpus ("When connecting to an existing
        # cluster, num_cpus and num_gpus must not be provided"): seen when a run started beside a test cluster
        ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.include_dashboard,
                 namespace=cfg.ray.namespace, _node_ip_address="127.0.0.1", log_to_driver=verbose(),
                 runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
        where = "127.0.0.1 (started by this command)"
        global STARTED_LOCAL_CLUSTER
        STARTED_LOCAL_CLUSTER = True
    quiet_loggers()
    try:
        require_guarded_cluster(allow, where)
    except UnguardedClusterError:
        ray.shutdown()
        raise
    return True
