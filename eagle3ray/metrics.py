"""Application metrics in Ray's metrics system (``ray.util.metrics``): they appear in the cluster's
Prometheus export (``ray start --metrics-export-port``) with Ray's ``ray_`` prefix, and in the
dashboard's Metrics view / Grafana next to Ray's own. Every series carries a ``run`` tag (the run name).

=============================================  =========  ==============================================
name (as exported)                             kind       meaning
=============================================  =========  ==============================================
ray_eagle3ray_extract_tokens_total             counter    tokens whose hidden states were committed
ray_eagle3ray_extract_samples_total            counter    samples whose hidden states were committed
ray_eagle3ray_extract_batch_tokens             histogram  tokens per engine batch (unit)
ray_eagle3ray_extract_retries_total            counter    unit calls retried after a replica/node failure
ray_eagle3ray_extract_blocks_committed_total   counter    blocks committed into the manifest
ray_eagle3ray_extract_tokens_per_s             gauge      committed tokens / s since the stage started
ray_eagle3ray_verifier_replicas_alive          gauge      RUNNING replicas of the verifier service
ray_eagle3ray_online_tokens_streamed_total     counter    tokens whose states the verifier streamed to training
                                                          (``train.data_source: online``; a unit redone after a
                                                          failure or a resume counts again)
ray_eagle3ray_online_tokens_from_storage_total counter    tokens of the stream read back from committed blocks
                                                          (``hybrid``: later epochs, resumed samples)
ray_eagle3ray_online_retries_total             counter    streamed unit calls retried after a replica failure
ray_eagle3ray_train_loss                       gauge      training loss at the last report
ray_eagle3ray_train_accuracy                   gauge      held-out accuracy per TTT position (tag position)
ray_eagle3ray_train_tokens_per_s               gauge      training tokens / s (all workers)
ray_eagle3ray_train_tokens_total               counter    tokens trained (all workers); the stream's counters less
                                                          this one: the tokens between the verifier and training
ray_eagle3ray_train_data_wait_fraction         gauge      share of the last report interval rank 0 waited for its
                                                          data (near 1: the verifier pool is the bottleneck)
=============================================  =========  ==============================================

Metric objects are created once per process, on first use; calls are cheap (Ray batches exports).
Counters are cumulative; gauges are exported while they are being set (Ray evicts a gauge series that
was not refreshed for two report intervals), i.e. while the stage runs.
"""

from __future__ import annotations

_CACHE: dict = {}
_BOUNDS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def _get(kind: str, name: str, desc: str, tags=("run",)):
    if name not in _CACHE:
        from ray.util import metrics as m

        if kind == "counter":
            _CACHE[name] = m.Counter(name, description=desc, tag_keys=tags)
        elif kind == "gauge":
            _CACHE[name] = m.Gauge(name, description=desc, tag_keys=tags)
        else:
            _CACHE[name] = m.Histogram(name, description=desc, boundaries=_BOUNDS, tag_keys=tags)
    return _CACHE[name]


def extract_commit(run: str, tokens: int, samples: int, retries: int, tokens_per_s: float,
                   replicas_alive: int | None) -> None:
    """One block committed into the manifest (called in the driver, so counts are exactly-once: a unit
    redone after a failure is counted when its block commits, never twice)."""
    tags = {"run": run}
    _get("counter", "eagle3ray_extract_tokens", "Tokens whose hidden states were committed").inc(tokens, tags)
    _get("counter", "eagle3ray_extract_samples", "Samples whose hidden states were committed").inc(samples, tags)
    _get("histogram", "eagle3ray_extract_batch_tokens", "Tokens per extraction batch").observe(tokens, tags)
    if retries:
        _get("counter", "eagle3ray_extract_retries", "Unit calls retried after a replica failure").inc(retries, tags)
    _get("counter", "eagle3ray_extract_blocks_committed", "Blocks committed into the manifest").inc(1, tags)
    _get("gauge", "eagle3ray_extract_tokens_per_s", "Committed tokens per second").set(tokens_per_s, tags)
    if replicas_alive is not None:
        _get("gauge", "eagle3ray_verifier_replicas_alive", "RUNNING verifier replicas").set(replicas_alive, tags)


def online_unit(run: str, tokens: int, retries: int = 0) -> None:
    """One unit's states streamed into training (called in the Ray Data actor that received them), after
    ``retries`` retried calls (a replica or node lost mid-unit)."""
    _get("counter", "eagle3ray_online_tokens_streamed", "Tokens whose hidden states were streamed to training").inc(
        tokens, {"run": run})
    if retries:
        _get("counter", "eagle3ray_online_retries", "Streamed unit calls retried after a replica failure").inc(
            retries, {"run": run})


def online_from_storage(run: str, tokens: int) -> None:
    """Tokens of a hybrid run's stream read back from committed blocks instead of the verifier."""
    _get("counter", "eagle3ray_online_tokens_from_storage", "Tokens of the stream read from committed blocks").inc(
        tokens, {"run": run})


def train_report(run: str, report: dict, ttt_steps: int) -> None:
    """One training report (rank 0): loss, held-out accuracy per TTT position, tokens/s."""
    tags = {"run": run}
    if "train_loss" in report:
        _get("gauge", "eagle3ray_train_loss", "Training loss at the last report").set(report["train_loss"], tags)
    acc = _get("gauge", "eagle3ray_train_accuracy", "Held-out accuracy per TTT position", ("run", "position"))
    for k in range(ttt_steps):
        v = report.get(f"val_full_acc_{k}")
        if v is not None:
            acc.set(v, {"run": run, "position": str(k)})
    if "tokens_per_s" in report:
        _get("gauge", "eagle3ray_train_tokens_per_s", "Training tokens per second").set(report["tokens_per_s"], tags)
    if "tokens" in report:
        _get("counter", "eagle3ray_train_tokens", "Tokens trained (all workers)").inc(report["tokens"], tags)
    if "worker_data_s" in report and "worker_step_s" in report:  # rank 0's cumulative seconds since its start
        data, step = report["worker_data_s"], report["worker_step_s"]
        d0, s0 = _LAST_SECONDS.get(run, (0.0, 0.0))
        if data < d0 or step < s0:  # a new worker process (a resume): its seconds start again
            d0, s0 = 0.0, 0.0
        _LAST_SECONDS[run] = (data, step)
        if (data - d0) + (step - s0) > 0:
            _get("gauge", "eagle3ray_train_data_wait_fraction", "Share of the last report interval a train worker "
                 "waited for its data").set((data - d0) / ((data - d0) + (step - s0)), tags)


_LAST_SECONDS: dict[str, tuple[float, float]] = {}
