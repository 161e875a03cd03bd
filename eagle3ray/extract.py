"""Stage ``extract``: conversations -> hidden-state blocks + manifest under ``<run>/hidden_states/``.

Pipeline (Ray Data)::

    conversations (not yet committed, <= max_model_len)
      -> units: consecutive samples packed up to ``extract.max_tokens_per_batch`` tokens
      -> map_batches(BlockWriter, ActorPoolStrategy(min_replicas, max_replicas))
           each call: one unit -> verifier service (one engine batch) -> one Parquet block on storage
           (written by this actor, or by the replica itself: ``extract.block_writer``)
      -> driver: commits each returned block into manifest.json (:class:`eagle3ray.blocks.Manifest`), in
         arrival order
    then: loss-masked token frequencies (token_freq.safetensors), manifest marked complete.

Exactly once: units are formed only from samples that no committed block holds; a block written
but not committed (interrupted run, retried task) is an orphan, never read, and deleted on the next
run. A committed block whose samples were already committed is discarded (counted ``duplicate``).

Rejected samples (``too_long``: more tokens than ``verifier.max_model_len``) are counted with their
id, never truncated; prepare's rejections are carried into the manifest under ``rejected.prepare``.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

from . import blocks, storage
from .artifacts import read_conversations
from .packing import pack_by_tokens
from .sources import RejectCounter

log = logging.getLogger(__name__)


@dataclass
class ExtractSummary:
    samples: int = 0  # committed in this run
    tokens: int = 0
    seconds: float = 0.0  # extraction loop wall time (first unit sent -> last block committed)
    wall_seconds: float = 0.0  # the whole stage, including the verifier start
    bytes_written: int = 0
    blocks: int = 0
    total_samples: int = 0  # committed overall
    total_tokens: int = 0
    total_bytes: int = 0  # of the committed block files, overall (manifest counts.bytes)
    storage_dtype: str = ""
    resumed_from: int = 0  # samples already committed when this run started
    audit: dict | None = None  # manifest["audit"] (eagle3ray.audit)
    orphans_removed: int = 0
    skipped: bool = False
    rejected: dict = field(default_factory=dict)  # stage -> RejectCounter.to_json()
    batch_tokens_max: int = 0
    retries: int = 0  # unit calls retried after a replica/node failure
    orphans_removed_end: int = 0  # blocks written by attempts that never reported back (removed at the end)
    path: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_token(self) -> float:
        """Bytes on storage per token of the committed blocks (the manifest's block bytes / its tokens: states,
        ids, loss mask and Parquet overhead after compression); 0 before anything is committed."""
        return self.total_bytes / self.total_tokens if self.total_tokens else 0.0

    def set_totals(self, manifest: blocks.Manifest) -> None:
        """The overall counts from the manifest (samples, tokens, bytes, dtype, rejected records)."""
        c = manifest.counts
        self.total_samples, self.total_tokens, self.total_bytes = c["samples"], c["tokens"], c["bytes"]
        self.storage_dtype = manifest.data.get("dtype", "")
        self.audit = manifest.data.get("audit")
        self.rejected = manifest.data["rejected"]

    @property
    def title(self) -> str:
        return "extract" + (" (already complete: skipped)" if self.skipped else "")

    def rows(self) -> list[tuple[str, object]]:
        """(label, value) rows for the CLI's table."""
        return [("samples (this run)", self.samples), ("tokens (this run)", self.tokens),
                ("tokens/s (extraction loop)", f"{self.tokens_per_s:.0f}"),
                ("seconds (loop / stage)", f"{self.seconds:.1f} / {self.wall_seconds:.1f}"),
                ("blocks committed", self.blocks), ("bytes written", self.bytes_written),
                ("largest batch (tokens)", self.batch_tokens_max),
                ("samples already committed (resumed)", self.resumed_from),
                ("orphan blocks removed (start / end)", f"{self.orphans_removed} / {self.orphans_removed_end}"),
                ("unit retries (replica failures)", self.retries), ("samples in manifest", self.total_samples),
                ("tokens in manifest", self.total_tokens),
                (f"bytes/token on storage ({self.storage_dtype}; manifest bytes / tokens)",
                 f"{self.bytes_per_token:,.0f}"),
                ("audit vs transformers (mean / max relative error per layer)", self.audit_text()),
                ("output", self.path)]

    def audit_text(self) -> str:
        """The audit in one line: each layer id's mean / max relative error, or why it did not run."""
        a = self.audit
        if not a:
            return "not run"
        if a.get("skipped"):
            return f"skipped: {a['skipped']}"
        return (f"{'passed' if a['passed'] else 'FAILED'} on {len(a['samples'])} samples, {a['tokens']} tokens: "
                + ", ".join(f"{i}: {v['mean_rel_err']:.1e} / {v['max_rel_err']:.1e}" for i, v in a["layers"].items()))

    def headline(self) -> str:
        a = self.audit or {}
        audit = ("" if not a or a.get("skipped") else
                 f", audit max error {max(v['max_rel_err'] for v in a['layers'].values()):.1e}")
        return (f"extract: {self.total_samples} samples, {self.total_tokens} tokens in the manifest, "
                f"{self.bytes_per_token:,.0f} B/token on storage ({self.storage_dtype})" + audit
                + (" (already complete)" if self.skipped else f", {self.tokens_per_s:.0f} tok/s this run"))

    @property
    def rejected_by_stage(self) -> dict:
        return {k: v for k, v in self.rejected.items() if (v or {}).get("counts")}


def plan_units(samples: list[dict], max_tokens: int) -> list[list[dict]]:
    """Pack samples, in order, into units of at most ``max_tokens`` tokens (:func:`eagle3ray.packing.pack_by_tokens`).

    A single sample longer than ``max_tokens`` (but within max_model_len) forms a unit alone; the
    engine's ``max_num_batched_tokens`` (= max_tokens) then prefills it in chunks.
    """
    return list(pack_by_tokens(samples, max_tokens, lambda s: len(s["input_ids"])))


#: Replica deaths during one unit's call after which the unit is split in halves (a single sample: rejected as
#: ``engine_crash``). One death is retried whole: a lost node is not the unit's fault.
DEATHS_BEFORE_SPLIT = 2

#: The columns of :class:`BlockWriter`'s rows.
ROW_COLUMNS = ("path", "rows", "tokens", "bytes", "sha256", "sample_ids", "seconds", "retries", "crashed")


class StorageLimitExceeded(RuntimeError):
    """The committed blocks passed ``extract.max_storage_gib``; what was committed stays committed."""


def check_storage_limit(limit: float | None, committed_bytes: int, committed_samples: int, total: int) -> None:
    """Stop the stage once the committed blocks exceed ``extract.max_storage_gib`` (preflight estimates the size
    beforehand; this holds the limit when the estimate was low, e.g. longer answers than expected).

    Raises:
        StorageLimitExceeded: naming the committed size, the limit and how to go on.
    """
    if limit is None or committed_bytes <= limit * 2**30 or committed_samples >= total:
        return  # (the last block over the limit: the extraction is whole, nothing more will be written)
    per_sample = committed_bytes / max(committed_samples, 1)
    raise StorageLimitExceeded(
        f"extract.max_storage_gib {limit}: the committed blocks hold {committed_bytes / 2**30:.3f} GiB after "
        f"{committed_samples} of {total} samples (about {per_sample * total / 2**30:.2f} GiB for all). Committed "
        "blocks are kept: raise the limit and run extract again to resume, lower data.max_samples, or use "
        "extract.storage_dtype: float8_e4m3 (half the bytes)")


class UnitTimeout(TimeoutError):
    """A unit got no answer from the verifier service within its timeout, on every attempt."""


class BlockWriter:
    """Ray Data callable class: one unit -> verifier service -> Parquet blocks (not yet committed).

    Faults (issue 16; docs/faults.md):

    - a call whose replica or node died (``RayActorError``, ``ActorUnavailableError``) or whose engine failed (the
      replica then fails Serve's health check and is replaced: :class:`eagle3ray.verifier_service.VerifierDeployment`)
      is sent again, up to ``max_retries`` times with a growing pause; Serve routes it to a live replica (or the
      replacement it starts). ``VerifierError`` (bad input, a wrong output) is not retried;
    - a call with no answer within ``unit_timeout_s`` x (``queue_depth`` + 1) seconds (the unit may wait behind
      ``queue_depth`` others for its replica) is given up and retried the same way; the replica itself fails its
      health check once the engine call has run ``unit_timeout_s`` (its deadline), and Serve replaces it. When every
      attempt timed out, :class:`UnitTimeout` names the unit and the setting;
    - a unit whose replica died :data:`DEATHS_BEFORE_SPLIT` times (a sample that crashes the engine) is split in
      halves, each sent on its own; a sample that still kills its replica alone is not retried again but returned as
      a ``crashed`` row (no block; the driver counts it as ``engine_crash``). So one poisonous sample costs about
      2 log2(unit samples) + 2 replica restarts, and every other sample of its unit is extracted.

    ``block_writer`` (``extract.block_writer``): ``data_actor`` has the states sent back through Ray's object store
    and writes the block here; ``replica`` has the replica write it and send back only the entry
    (:meth:`eagle3ray.verifier_service.VerifierDeployment.extract_block`). Either way a block is a fresh file that
    only the driver's commit makes part of the run.

    Returns one row per block written (a unit split by crashes gives several; one row per crashed sample):
    :data:`ROW_COLUMNS`: path (relative to hidden_states/; "" for a crashed sample), rows, tokens, bytes, sha256,
    sample_ids (the ids written, in block order; the crashed sample's id), seconds (engine + write wall time),
    retries, crashed (bool).
    """

    def __init__(self, app: str, storage_uri: str, endpoint_url: str | None, hs_root: str,
                 storage_dtype: str, compression: str, max_retries: int = 3,
                 retry_pause_s: float = 2.0, block_writer: str = "data_actor", unit_timeout_s: float = 600.0,
                 queue_depth: int = 1):
        self.app = app
        self.storage_uri, self.endpoint_url = storage_uri, endpoint_url
        self.fs, _ = storage.filesystem(storage_uri, endpoint_url)
        self.hs_root = hs_root
        self.storage_dtype = storage_dtype
        self.compression = compression
        self.max_retries = max_retries
        self.retry_pause_s = retry_pause_s
        self.block_writer = block_writer
        self.unit_timeout_s = unit_timeout_s
        self.wait_s = unit_timeout_s * (queue_depth + 1)
        self.scratch = blocks.BlockScratch()  # this writer's block buffers, reused block after block

    @functools.cached_property
    def handle(self):
        """The verifier service's handle, looked up on first use (a hybrid stream that reads every unit back from
        storage needs no service)."""
        from ray import serve

        return serve.get_app_handle(self.app)

    def _request(self, samples: list[dict]):
        """One remote call for the unit: states back (``data_actor``) or the replica's block entry (``replica``)."""
        if self.block_writer == "replica":
            return self.handle.extract_block.remote(samples, self.storage_dtype, self.storage_uri,
                                                    self.endpoint_url, self.hs_root, self.compression,
                                                    self.unit_timeout_s)
        req = [{"sample_id": s["sample_id"], "input_ids": s["input_ids"]} for s in samples]
        return self.handle.extract.remote(req, self.storage_dtype, self.unit_timeout_s)

    def _call(self, samples: list[dict]):
        """(answer, retries) of one unit's call; ``(None, retries)`` after :data:`DEATHS_BEFORE_SPLIT` replica
        deaths (the caller splits the unit). Raises VerifierError, :class:`UnitTimeout` or RuntimeError (see the
        class docstring)."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        from .verifier import VerifierError

        unit = f"unit {samples[0]['sample_id']}..{samples[-1]['sample_id']} ({len(samples)} samples)"
        deaths = timeouts = 0
        for attempt in range(self.max_retries + 1):
            resp = None
            try:
                resp = self._request(samples)
                return resp.result(timeout_s=self.wait_s), attempt
            except VerifierError:
                raise  # bad input or a wrong output: retrying gives the same
            except TimeoutError as e:
                if resp is not None:
                    resp.cancel()
                timeouts += 1
                err: Exception = e
                why = (f"no answer in {self.wait_s:.0f} s (extract.unit_timeout_s {self.unit_timeout_s:.0f} s per "
                       "engine call; its replica fails its health check and is replaced)")
            except (RayActorError, ActorUnavailableError, RuntimeError) as e:  # a dead, broken or unhealthy replica
                err = e
                if isinstance(e, ActorDiedError):
                    deaths += 1
                    if deaths >= DEATHS_BEFORE_SPLIT:
                        log.warning("%s: its replica died %d times; splitting it to find the sample that kills "
                                    "the engine", unit, deaths)
                        return None, attempt
                why = f"replica failed ({type(e).__name__}: {str(e)[:300]})"
            if attempt == self.max_retries:
                if timeouts == attempt + 1:
                    raise UnitTimeout(f"{unit}: {why}, on all {attempt + 1} attempts; raise extract.unit_timeout_s "
                                      "if the engine is only slow, or look at the replica's log") from err
                raise RuntimeError(f"{unit}: verifier replica failed {attempt + 1} times; last: {why}") from err
            log.warning("%s: %s; retry %d/%d", unit, why, attempt + 1, self.max_retries)
            time.sleep(self.retry_pause_s * (attempt + 1))
        raise AssertionError("unreachable")

    def _blocks(self, samples: list[dict]) -> list[dict]:
        """Rows (see the class docstring) for ``samples``, splitting the unit when it kills its replicas."""
        t0 = time.time()
        got, retries = self._call(samples)
        if got is None:
            if len(samples) == 1:
                log.error("sample %s kills the verifier engine: rejected (engine_crash)", samples[0]["sample_id"])
                return [{"path": "", "rows": 0, "tokens": 0, "bytes": 0, "sha256": "",
                         "sample_ids": [samples[0]["sample_id"]], "seconds": time.time() - t0,
                         "retries": retries + 1, "crashed": True}]
            half = len(samples) // 2
            rows = self._blocks(samples[:half]) + self._blocks(samples[half:])
            rows[0]["retries"] += retries + 1
            return rows
        return [self._finish(samples, got, retries, t0)]

    def _finish(self, samples: list[dict], got, retries: int, t0: float) -> dict:
        """The row of one answered unit (``got``: the states, or the replica's block entry): its block written
        here unless the replica wrote it."""
        entry = got if self.block_writer == "replica" else blocks.write_unit_block(
            self.fs, self.hs_root, samples, got, self.storage_dtype, self.compression, self.scratch)
        return {**{k: entry[k] for k in ROW_COLUMNS[:6]}, "seconds": time.time() - t0, "retries": retries,
                "crashed": False}

    @staticmethod
    def units_of(batch: dict):
        """The units of a Ray Data batch of :func:`unit_items` rows, each as a list of samples."""
        for sample_ids, input_ids, loss_mask in zip(batch["sample_ids"], batch["input_ids"], batch["loss_mask"]):
            yield [{"sample_id": str(s), "input_ids": [int(x) for x in i], "loss_mask": [int(x) for x in m]}
                   for s, i, m in zip(sample_ids, input_ids, loss_mask)]

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {k: [] for k in ROW_COLUMNS}
        for samples in self.units_of(batch):
            for row in self._blocks(samples):
                for k in ROW_COLUMNS:
                    out[k].append(row[k])
        return out


def unit_items(units: list[list[dict]]) -> list[dict]:
    """One Ray Data row per unit ({sample_ids, input_ids, loss_mask}, lists in sample order), what
    :class:`BlockWriter` reads back with :meth:`BlockWriter.units_of`."""
    return [{"sample_ids": [s["sample_id"] for s in u], "input_ids": [s["input_ids"] for s in u],
             "loss_mask": [s["loss_mask"] for s in u]} for u in units]


def replicas_alive(app: str) -> int | None:
    """RUNNING replicas of a Serve application (None when Serve cannot say)."""
    from ray import serve

    try:
        st = serve.status().applications[app]
        dep = next(iter(st.deployments.values()))
        return int(sum(v for k, v in dep.replica_states.items() if str(k).endswith("RUNNING")))
    except Exception:
        return None


def _written_blocks(items: list[dict], writer_kwargs: dict, cfg):
    """Rows of written (not yet committed) blocks, in completion order, for the driver to commit.

    The first unit (a small probe, see :func:`extract`) is written from the driver itself (a thread
    calling the service) while Ray Data starts its actor pool for the rest, so a job against a running
    verifier service commits its first block after one short engine call instead of after the pool's
    start-up.

    When the consumer stops (a commit failed, a writer raised), both producers stop: the Ray Data iterator is
    left, which shuts its executor down, so a failed run does not go on writing blocks nobody will commit.

    Raises:
        whatever a writer raised (the stage fails; committed blocks stay committed).
    """
    import queue
    import threading

    import ray

    q: queue.Queue = queue.Queue(maxsize=64)
    stop = threading.Event()  # the committing side failed or finished: stop feeding (and so stop Ray Data)

    def put(item) -> None:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def first() -> None:
        try:
            out = BlockWriter(**writer_kwargs)({k: [v] for k, v in items[0].items()})
            for i in range(len(out["path"])):
                put(("row", {k: v[i] for k, v in out.items()}))
        except BaseException as e:  # noqa: BLE001 - handed to the committing thread
            put(("error", e))
        finally:
            put(("done", None))

    def rest() -> None:
        try:
            if len(items) > 1:
                ds = ray.data.from_items(items[1:], override_num_blocks=min(len(items) - 1, 200)).map_batches(
                    BlockWriter, fn_constructor_kwargs=writer_kwargs, batch_size=1, num_cpus=cfg.extract.writer_num_cpus,
                    compute=ray.data.ActorPoolStrategy(
                        min_size=cfg.extract.min_replicas * cfg.extract.writers_per_replica,
                        max_size=cfg.extract.max_replicas * cfg.extract.writers_per_replica))
                for row in ds.iter_rows():
                    if stop.is_set():  # leaving the iterator shuts Ray Data's executor down: no more blocks
                        break
                    put(("row", row))
        except BaseException as e:  # noqa: BLE001
            put(("error", e))
        finally:
            put(("done", None))

    for target in (first, rest):
        threading.Thread(target=target, daemon=True, name=f"extract-{target.__name__}").start()
    finished = 0
    try:
        while finished < 2:
            kind, val = q.get()
            if kind == "row":
                yield val
            elif kind == "error":
                raise val
            else:
                finished += 1
    finally:
        stop.set()


def _todo(conv, done: set[str], max_model_len: int, rejected: RejectCounter) -> list[dict]:
    """Conversations no committed block holds, as {sample_id, input_ids, loss_mask}; longer than
    ``max_model_len`` tokens: counted in ``rejected`` as ``too_long``, never truncated."""
    todo = []
    for sid, ids, mask in zip(conv["sample_id"].to_pylist(), conv["input_ids"].to_pylist(),
                              conv["loss_mask"].to_pylist()):
        if sid in done:
            continue
        if len(ids) > max_model_len:
            rejected.add("too_long", sid, f"{len(ids)} tokens > verifier.max_model_len {max_model_len}")
            continue
        todo.append({"sample_id": sid, "input_ids": ids, "loss_mask": mask})
    return todo


def _units(todo: list[dict], max_tokens: int) -> list[list[dict]]:
    """Units of ``todo``. The first is a small probe (a quarter of the budget): a job commits its first block,
    and so proves engine, encoding, storage and manifest, after a short engine call."""
    probe = plan_units(todo, max(1, max_tokens // 4))[:1]
    return probe + plan_units(todo[len(probe[0]) if probe else 0:], max_tokens)


def _commit_blocks(cfg, manifest: blocks.Manifest, rows, *, app: str, rejected: RejectCounter,
                   summary: ExtractSummary, total: int, progress: bool, t_start: float, on_commit=None) -> None:
    """Commit the written blocks ``rows`` (from :func:`_written_blocks`) in arrival order; progress bar, summary
    counters and Ray metrics follow each commit."""
    from tqdm.auto import tqdm

    from . import metrics

    bar = tqdm(total=total, desc="extract", unit="sample", disable=not progress)
    planned = manifest.data["counts"]["samples"] + total  # committed before this run, and this run's
    t0, t_replicas, alive = time.time(), 0.0, None
    for row in rows:
        if not summary.blocks:
            log.info("extract: first block written, %.2f s into the stage", time.time() - t_start)
        summary.retries += int(row.get("retries", 0))
        ids = [str(i) for i in row["sample_ids"]]
        if row.get("crashed"):  # killed its replica alone: never committed, so a later run tries it again
            rejected.add("engine_crash", ids[0], f"the verifier replica died (or hung and was replaced) on this "
                         f"sample alone, {DEATHS_BEFORE_SPLIT} times")
            manifest.set_rejected(manifest.data["rejected"].get("prepare", {}), rejected.to_json())
            bar.update(1)
            continue
        dup = manifest.commit(row, ids, rejected.to_json())
        if dup:  # a retried unit whose first attempt was committed: keep the first
            rejected.add("duplicate", dup[0], f"block {row['path']} repeats {len(dup)} committed samples; discarded")
            continue
        summary.samples += row["rows"]
        summary.tokens += row["tokens"]
        summary.bytes_written += row["bytes"]
        summary.blocks += 1
        check_storage_limit(cfg.extract.max_storage_gib, manifest.data["counts"]["bytes"],
                            manifest.data["counts"]["samples"], planned)
        bar.update(row["rows"])
        tok_s = summary.tokens / max(time.time() - t0, 1e-9)
        bar.set_postfix(tok_s=f"{tok_s:.0f}", retries=summary.retries)
        if time.time() - t_replicas > 5:
            alive, t_replicas = replicas_alive(app), time.time()
        metrics.extract_commit(cfg.run.name, row["tokens"], row["rows"], int(row.get("retries", 0)), tok_s, alive)
        if on_commit is not None:
            on_commit(manifest.data)
    bar.close()
    summary.seconds = time.time() - t0


def extract(cfg, on_commit=None, progress: bool = True) -> ExtractSummary:
    """Run the extract stage for ``cfg``; resumes a partial run. Returns the summary.

    Args:
        on_commit: optional callback ``f(manifest dict)`` after each committed block (tests use it to
            interrupt a run at a known point).

    Raises:
        eagle3ray.audit.AuditFailed: the audited states do not match the verifier's at their layer ids (the
            manifest stays incomplete, with the audit's record).
        FileNotFoundError: prepare has not completed.
        blocks.ManifestMismatch: existing blocks were made with another verifier/layers/dtype.
        RuntimeError: the verifier service failed to start, or a unit failed after Ray's retries.
    """
    from .machine import ensure_ray
    from .verifier_service import app_name, start_for_config
    from .verifier import VerifierSpec

    t_start = time.time()
    paths = storage.run_paths(cfg)
    storage.write_resolved_config(cfg, paths)
    conv_man, conv = read_conversations(paths)
    spec = VerifierSpec.from_config(cfg)
    hs_root = paths.hidden_states
    manifest = blocks.Manifest.open(paths.fs, hs_root, fresh_manifest(cfg, spec, conv_man), f"{hs_root}/manifest.json")
    summary = ExtractSummary(path=paths.uri + "/hidden_states")
    if manifest.complete:
        summary.skipped = True
        summary.set_totals(manifest)
        return summary
    summary.orphans_removed = manifest.remove_orphans()
    done = manifest.committed_ids()
    summary.resumed_from = len(done)
    rejected = RejectCounter()
    todo = _todo(conv, done, cfg.verifier.max_model_len, rejected)
    manifest.set_rejected(conv_man.get("rejected", {}), rejected.to_json())

    log.info("extract: %d samples to do, %.2f s into the stage", len(todo), time.time() - t_start)
    units = _units(todo, cfg.extract.max_tokens_per_batch)
    summary.batch_tokens_max = max((sum(len(s["input_ids"]) for s in u) for u in units), default=0)
    if units:
        ensure_ray(cfg)
        start_for_config(cfg)
        log.info("extract: verifier service ready, %.2f s into the stage", time.time() - t_start)
        items = unit_items(units)
        writer_kwargs = dict(app=app_name(spec), storage_uri=cfg.run.storage, endpoint_url=cfg.run.endpoint_url,
                             hs_root=hs_root, storage_dtype=cfg.extract.storage_dtype,
                             compression=cfg.extract.compression, max_retries=cfg.extract.max_unit_retries,
                             block_writer=cfg.extract.block_writer, unit_timeout_s=cfg.extract.unit_timeout_s,
                             queue_depth=cfg.extract.writers_per_replica)
        rows = _written_blocks(items, writer_kwargs, cfg)
        try:
            _commit_blocks(cfg, manifest, rows, app=writer_kwargs["app"], rejected=rejected, summary=summary,
                           total=sum(len(u) for u in units), progress=progress, t_start=t_start, on_commit=on_commit)
        finally:
            rows.close()  # a failed commit stops the writers now, not when the traceback is collected
        # blocks of attempts that died after writing (their unit was redone): not in the manifest, removed
        summary.orphans_removed_end = manifest.remove_orphans()

    seal(cfg, paths, manifest, spec, rejected, summary.retries, audit_again=bool(units))
    summary.wall_seconds = time.time() - t_start
    summary.set_totals(manifest)
    return summary


def fresh_manifest(cfg, spec, conv_man: dict) -> dict:
    """The manifest a new extraction of ``cfg`` starts from (:func:`eagle3ray.blocks.new_manifest`): the verifier's
    identity and compute dtype, its layer ids, ``extract.storage_dtype`` and the conversations' sha256 and count
    (``conv_man``: the conversations' manifest). A stored manifest must match it to be resumed or read."""
    return blocks.new_manifest({**spec.model_identity, "compute_dtype": spec.dtype}, spec.layer_ids,
                               cfg.extract.storage_dtype,
                               {"sha256": conv_man["sha256"], "samples": conv_man["counts"]["samples"]})


def seal(cfg, paths: storage.RunPaths, manifest: blocks.Manifest, spec, rejected: RejectCounter, retries: int,
         audit_again: bool) -> None:
    """Audit the committed states against transformers (when there is no passed audit yet, or ``audit_again``:
    blocks were committed since), then finish the manifest (token frequencies, ``complete``). Used by the extract
    stage and by a hybrid run's train stage (:func:`eagle3ray.online.HybridStream`).

    Raises:
        eagle3ray.audit.AuditFailed: the audited states differ from the verifier's (the manifest stays incomplete,
            with the audit's record).
        blocks.CorruptBlocks: a committed block is missing or has another size (:meth:`blocks.Manifest.finish`).
    """
    if "audit" not in manifest.data or not manifest.data["audit"].get("passed", True) or audit_again:
        from .audit import audit_run, check

        manifest.data["audit"] = audit_run(paths.fs, paths.hidden_states, manifest.data, spec.model_path,
                                           cfg.extract.audit_samples, spec.dtype, cfg.verifier.device,
                                           spec.engine)
        if not manifest.data["audit"].get("skipped") and not manifest.data["audit"]["passed"]:
            manifest.save()  # the failed audit recorded; the manifest stays incomplete
            check(manifest.data["audit"], f"{paths.uri}/hidden_states")
    manifest.finish(spec.model_identity["vocab_size"], rejected.to_json(), retries)
