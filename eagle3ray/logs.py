"""A quiet terminal: the stages' own lines and progress bars on the terminal, everything else in ``<run>/logs/``.

By default (``--verbose`` off) a command's terminal shows: one line per stage start and end, one progress bar per
stage, eagle3ray's warnings and errors, and the final report. What goes elsewhere:

- eagle3ray's INFO log (every stage's details): ``<run>/logs/driver.log``;
- the actors' and workers' output (vLLM's periodic stats, Serve's per-call lines, the Ray Train workers' step
  lines): not streamed to the driver (``ray.init(log_to_driver=False)``); on a local cluster the Ray session's
  log folder (one file per worker) is copied to ``<run>/logs/ray/`` at the end of the command, on an attached
  cluster they stay in Ray's logs (dashboard, ``ray logs``);
- Ray Data's progress blocks and INFO lines: Ray Data's own ``ray-data.log`` in the session folder.

Errors still surface in full: a failing actor's exception carries its remote traceback to the driver. Logs go
under the run only on local storage; for object storage they go to ``./eagle3ray-logs/<run>/``.
``--verbose`` (or ``EAGLE3RAY_VERBOSE=1``) shows everything, as before.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys

from . import storage

VERBOSE_ENV = "EAGLE3RAY_VERBOSE"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_QUIET_LOGGERS = ("ray", "ray.data", "ray.train", "ray.serve", "ray.tune", "speculators", "vllm", "filelock",
                  "urllib3", "httpx")


#: Loggers whose warnings are about Ray's own bookkeeping (the notice that Ray Data's progress bars are off; Ray
#: Data's issue detector suggesting memory requests for the block writers every 30 s, 13 lines each).
_QUIET_TO_ERROR = ("ray.data._internal.progress", "ray.data._internal.issue_detection.issue_detector_manager",
                   # "Token authentication is enabled for this Ray cluster": the local cluster's default, which
                   # eagle3ray requires anyway (machine.require_guarded_cluster refuses a cluster without it)
                   "ray._private.authentication.authentication_token_setup")

#: Messages the raylet pushes to the driver that are about Ray's own worker pool, not the user's job: sent to
#: driver.log instead of the terminal. Every other pushed message (a worker killed, out of memory, ...) still
#: reaches the terminal.
RAYLET_NOISE = ("PYTHON worker processes have been started on node",)


class _CurrentStderr(logging.StreamHandler):
    """A console handler that writes to whatever ``sys.stderr`` is now (a test runner or notebook replaces it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def verbose() -> bool:
    """Whether this process (and the Ray cluster it starts) shows everything on the terminal."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def set_verbose(on: bool) -> None:
    """Set for this process and the subprocesses it starts (the probe, local Ray)."""
    if on:
        os.environ[VERBOSE_ENV] = "1"
    else:
        os.environ.pop(VERBOSE_ENV, None)


def log_dir(cfg) -> str:
    """The local folder for this run's logs: ``<run>/logs`` on local storage, else ``./eagle3ray-logs/<run>``."""
    paths = storage.run_paths(cfg)
    if storage.is_local(paths.fs):
        return os.path.join(paths.root, "logs")
    return os.path.abspath(os.path.join("eagle3ray-logs", cfg.run.name))


def setup(cfg=None) -> str | None:
    """Configure this process's logging: the terminal gets WARNING and above (INFO with :func:`verbose`), and with
    ``cfg`` ``<log_dir>/driver.log`` gets INFO and above. Returns the driver log path (None without ``cfg``)."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    level = logging.INFO if verbose() else logging.WARNING
    console = [h for h in root.handlers if getattr(h, "_eagle3ray", "") == "console"]
    if not console:
        h = _CurrentStderr()
        h.setFormatter(logging.Formatter(FORMAT))
        h._eagle3ray = "console"
        root.addHandler(h)
        console = [h]
    console[0].setLevel(level)
    quiet_loggers()
    if cfg is None:
        return None
    d = log_dir(cfg)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "driver.log")
    if not any(getattr(h, "baseFilename", None) == path for h in root.handlers):
        fh = logging.FileHandler(path)
        fh.setLevel(logging.INFO)
        fh.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(fh)
    return path


def quiet_loggers() -> None:
    """Route the libraries' own console handlers through the same level: their INFO lines (Ray Data's execution
    plans, Ray Train's controller, speculators' loading lines) reach driver.log only. Call again after
    ``ray.init`` (Ray installs its handlers then)."""
    if verbose():
        return
    for name in _QUIET_LOGGERS:
        for h in logging.getLogger(name).handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.setLevel(logging.WARNING)
    for name in _QUIET_TO_ERROR:  # their WARNINGs are for Ray's developers: driver.log only
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from ray.data import DataContext

        ctx = DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
    except Exception:  # noqa: BLE001 - Ray Data absent or older: nothing to quiet
        pass
    _filter_raylet_messages()
    try:  # speculators logs through loguru: its INFO/WARNING lines while loading weights
        from loguru import logger as loguru_logger

        loguru_logger.disable("speculators")
    except ImportError:
        pass


def _filter_raylet_messages() -> None:
    """Wrap Ray's printer of the messages the raylet pushes to the driver (``ray._private.worker.
    print_to_stdstream``, called by its ``listen_error_messages`` thread; ``log_to_driver=False`` does not stop
    them) so that those matching :data:`RAYLET_NOISE` go to the ``eagle3ray.raylet`` logger at INFO (driver.log only)."""
    try:
        from ray._private import worker
    except ImportError:
        return
    inner = worker.print_to_stdstream
    if getattr(inner, "_eagle3ray", False):
        return

    def print_to_stdstream(data, *args, **kwargs):
        if data.get("pid") == "raylet" and any(n in line for line in data.get("lines", []) for n in RAYLET_NOISE):
            for line in data["lines"]:
                logging.getLogger("eagle3ray.raylet").info("%s", line)
            return None
        return inner(data, *args, **kwargs)

    print_to_stdstream._eagle3ray = True
    worker.print_to_stdstream = print_to_stdstream


def collect_ray_logs(cfg) -> str | None:
    """Copy the local Ray session's ``logs/`` folder to ``<log_dir>/ray`` (a local cluster this process started;
    attached clusters keep theirs). Returns the destination, or None when there is nothing to copy."""
    try:
        import ray

        node = getattr(ray._private.worker, "_global_node", None)
        if node is None or not ray.is_initialized() or cfg.ray.address or os.environ.get("RAY_ADDRESS"):
            return None
        src = os.path.join(node.get_session_dir_path(), "logs")
    except Exception:  # noqa: BLE001 - best effort: logs are a convenience, never a failure
        return None
    dst = os.path.join(log_dir(cfg), "ray")
    try:
        shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock", "*.lock"))
    except (OSError, shutil.Error):
        return None
    return dst
