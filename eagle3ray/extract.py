"""Stage ``extract``: conversations -> hidden-state blocks + manifest under ``<run>/hidden_states/``.

Pipeline (Ray Data)::

    conversations (not yet committed, <= max_model_len)
      -> units: consecutive samples packed up to ``extract.max_tokens_per_batch`` tokens
      -> map_batches(BlockWriter, ActorPoolStrategy(min_actors, max_actors))
           each call: one unit -> verifier service (one engine batch) -> one Parquet block on storage
      -> driver: commits each returned block into manifest.json (atomic rewrite), in arrival order
    then: loss-masked token frequencies (token_freq.safetensors), manifest marked complete.

Exactly once: units are formed only from samples that no committed block holds; a block written
but not committed (interrupted run, retried task) is an orphan, never read, and deleted on the next
run. A committed block whose samples were already committed is discarded (counted ``duplicate``).

Rejected samples (``too_long``: more tokens than ``verifier.max_model_len``) are counted with their
id, never truncated; prepare's rejections are carried into the manifest under ``rejected.prepare``.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from . import blocks, storage
from .prepare import read_conversations
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
    resumed_from: int = 0  # samples already committed when this run started
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


def plan_units(samples: list[dict], max_tokens: int) -> list[list[dict]]:
    """Pack samples, in order, into units of at most ``max_tokens`` tokens.

    A single sample longer than ``max_tokens`` (but within max_model_len) forms a unit alone; the
    engine's ``max_num_batched_tokens`` (= max_tokens) then prefills it in chunks.
    """
    units: list[list[dict]] = []
    cur: list[dict] = []
    cur_tokens = 0
    for s in samples:
        n = len(s["input_ids"])
        if cur and cur_tokens + n > max_tokens:
            units.append(cur)
            cur, cur_tokens = [], 0
        cur.append(s)
        cur_tokens += n
    if cur:
        units.append(cur)
    return units


class BlockWriter:
    """Ray Data callable class: one unit -> verifier service -> one Parquet block (not yet committed).

    A unit whose call fails because its replica or node died (``RayActorError``, ``ActorUnavailableError``)
    is sent again, up to ``max_retries`` times with a growing pause; Serve routes it to a live replica
    (or the replacement it starts). Errors raised by the engine itself (bad input) are not retried.

    Returns one row per unit: path (relative to hidden_states/), rows, tokens, bytes, sha256,
    seconds (engine + write wall time), retries.
    """

    def __init__(self, app: str, storage_uri: str, endpoint_url: str | None, hs_root: str,
                 storage_dtype: str, compression: str, max_retries: int = 3,
                 retry_pause_s: float = 2.0):
        from ray import serve

        self.handle = serve.get_app_handle(app)
        self.fs, _ = storage.filesystem(storage_uri, endpoint_url)
        self.hs_root = hs_root
        self.storage_dtype = storage_dtype
        self.compression = compression
        self.max_retries = max_retries
        self.retry_pause_s = retry_pause_s

    def _call(self, samples: list[dict]) -> tuple[list[dict], int]:
        from ray.exceptions import ActorUnavailableError, RayActorError

        req = [{"sample_id": s["sample_id"], "input_ids": s["input_ids"]} for s in samples]
        for attempt in range(self.max_retries + 1):
            try:
                return self.handle.extract.remote(req, self.storage_dtype).result(), attempt
            except (RayActorError, ActorUnavailableError) as e:
                if attempt == self.max_retries:
                    raise RuntimeError(f"unit {samples[0]['sample_id']}..{samples[-1]['sample_id']}: verifier "
                                       f"replica failed {attempt + 1} times; last: {type(e).__name__}: {e}") from e
                log.warning("unit %s: replica failed (%s); retry %d/%d", samples[0]["sample_id"],
                            type(e).__name__, attempt + 1, self.max_retries)
                time.sleep(self.retry_pause_s * (attempt + 1))
        raise AssertionError("unreachable")

    def __call__(self, batch: dict) -> dict:
        out = {k: [] for k in ("path", "rows", "tokens", "bytes", "sha256", "seconds", "retries")}
        for sample_ids, input_ids, loss_mask in zip(batch["sample_ids"], batch["input_ids"], batch["loss_mask"]):
            t0 = time.time()
            samples = [{"sample_id": str(s), "input_ids": [int(x) for x in i], "loss_mask": [int(x) for x in m]}
                       for s, i, m in zip(sample_ids, input_ids, loss_mask)]
            results, retries = self._call(samples)
            table = blocks.build_block(samples, results, self.storage_dtype)
            rel = f"blocks/part-{uuid.uuid4().hex}.parquet"
            entry = blocks.write_block(self.fs, f"{self.hs_root}/{rel}", table, self.compression)
            out["path"].append(rel)
            for k in ("rows", "tokens", "bytes", "sha256"):
                out[k].append(entry[k])
            out["seconds"].append(time.time() - t0)
            out["retries"].append(retries)
        return out


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

    Raises:
        whatever a writer raised (the stage fails; committed blocks stay committed).
    """
    import queue
    import threading

    import ray

    q: queue.Queue = queue.Queue()

    def first() -> None:
        try:
            out = BlockWriter(**writer_kwargs)({k: [v] for k, v in items[0].items()})
            q.put(("row", {k: v[0] for k, v in out.items()}))
        except BaseException as e:  # noqa: BLE001 - handed to the committing thread
            q.put(("error", e))
        finally:
            q.put(("done", None))

    def rest() -> None:
        try:
            if len(items) > 1:
                ds = ray.data.from_items(items[1:], override_num_blocks=min(len(items) - 1, 200)).map_batches(
                    BlockWriter, fn_constructor_kwargs=writer_kwargs, batch_size=1, num_cpus=0.1,
                    compute=ray.data.ActorPoolStrategy(min_size=cfg.extract.min_actors,
                                                       max_size=cfg.extract.max_actors))
                for row in ds.iter_rows():
                    q.put(("row", row))
        except BaseException as e:  # noqa: BLE001
            q.put(("error", e))
        finally:
            q.put(("done", None))

    for target in (first, rest):
        threading.Thread(target=target, daemon=True, name=f"extract-{target.__name__}").start()
    finished = 0
    while finished < 2:
        kind, val = q.get()
        if kind == "row":
            yield val
        elif kind == "error":
            raise val
        else:
            finished += 1


def _remove_orphans(fs, hs_root: str, manifest: dict) -> int:
    committed = {b["path"] for b in manifest["blocks"]}
    try:
        files = fs.ls(f"{hs_root}/blocks", detail=False)
    except FileNotFoundError:
        return 0
    removed = 0
    for f in files:
        rel = "blocks/" + f.rstrip("/").rsplit("/", 1)[-1]
        if rel not in committed:
            fs.rm(f)
            removed += 1
    return removed


def extract(cfg, on_commit=None, progress: bool = True) -> ExtractSummary:
    """Run the extract stage for ``cfg``; resumes a partial run. Returns the summary.

    Args:
        on_commit: optional callback ``f(manifest)`` after each committed block (tests use it to
            interrupt a run at a known point).

    Raises:
        FileNotFoundError: prepare has not completed.
        blocks.ManifestMismatch: existing blocks were made with another verifier/layers/dtype.
        RuntimeError: the verifier service failed to start, or a unit failed after Ray's retries.
    """
    import ray

    from . import metrics
    from .service import app_name, ensure_ray, start_for_config
    from .verifier import VerifierSpec

    t_start = time.time()
    paths = storage.run_paths(cfg)
    storage.write_resolved_config(cfg, paths)
    conv_man, conv = read_conversations(paths)
    spec = VerifierSpec.from_config(cfg)
    hs_root = paths.hidden_states
    man_path = f"{hs_root}/manifest.json"
    fresh = blocks.new_manifest({**spec.model_identity, "compute_dtype": spec.dtype}, spec.layer_ids,
                                cfg.extract.storage_dtype,
                                {"sha256": conv_man["sha256"], "samples": conv_man["counts"]["samples"]})
    manifest = storage.read_json(paths.fs, man_path)
    summary = ExtractSummary(path=paths.uri + "/hidden_states")
    if manifest is not None:
        blocks.check_compatible(manifest, fresh, man_path)
        if manifest.get("complete"):
            summary.skipped = True
            summary.total_samples = manifest["counts"]["samples"]
            summary.total_tokens = manifest["counts"]["tokens"]
            summary.rejected = manifest["rejected"]
            return summary
    else:
        manifest = fresh
    summary.orphans_removed = _remove_orphans(paths.fs, hs_root, manifest)
    done = set(blocks.committed_sample_ids(paths.fs, hs_root, manifest))
    summary.resumed_from = len(done)

    rejected = RejectCounter()
    todo = []
    for sid, ids, mask in zip(conv["sample_id"].to_pylist(), conv["input_ids"].to_pylist(),
                              conv["loss_mask"].to_pylist()):
        if sid in done:
            continue
        if len(ids) > cfg.verifier.max_model_len:
            rejected.add("too_long", sid, f"{len(ids)} tokens > verifier.max_model_len {cfg.verifier.max_model_len}")
            continue
        todo.append({"sample_id": sid, "input_ids": ids, "loss_mask": mask})
    manifest["rejected"] = {"prepare": conv_man.get("rejected", {}), "extract": rejected.to_json()}
    storage.write_json_atomic(paths.fs, man_path, manifest)

    log.info("extract: %d samples to do, %.2f s into the stage", len(todo), time.time() - t_start)
    # the first unit is a small probe (a quarter of the budget): a job commits its first block, and so
    # proves engine, encoding, storage and manifest, after a short engine call
    probe = plan_units(todo, max(1, cfg.extract.max_tokens_per_batch // 4))[:1]
    units = probe + plan_units(todo[len(probe[0]) if probe else 0:], cfg.extract.max_tokens_per_batch)
    summary.batch_tokens_max = max((sum(len(s["input_ids"]) for s in u) for u in units), default=0)
    if units:
        ensure_ray(cfg)
        start_for_config(cfg)
        log.info("extract: verifier service ready, %.2f s into the stage", time.time() - t_start)
        items = [{"sample_ids": [s["sample_id"] for s in u], "input_ids": [s["input_ids"] for s in u],
                  "loss_mask": [s["loss_mask"] for s in u]} for u in units]
        writer_kwargs = dict(app=app_name(spec), storage_uri=cfg.run.storage, endpoint_url=cfg.run.endpoint_url,
                             hs_root=hs_root, storage_dtype=cfg.extract.storage_dtype,
                             compression=cfg.extract.compression, max_retries=cfg.extract.max_unit_retries)
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(u) for u in units), desc="extract", unit="sample", disable=not progress)
        t0 = time.time()
        committed = done
        app, t_replicas, alive = app_name(spec), 0.0, None
        for row in _written_blocks(items, writer_kwargs, cfg):
            if not summary.blocks:
                log.info("extract: first block written, %.2f s into the stage", time.time() - t_start)
            path = row["path"]
            summary.retries += int(row.get("retries", 0))
            ids = blocks.committed_sample_ids(paths.fs, hs_root, {"blocks": [{"path": path}]})
            dup = [i for i in ids if i in committed]
            if dup:  # a retried unit whose first attempt was committed: keep the first
                rejected.add("duplicate", dup[0], f"block {path} repeats {len(dup)} committed samples; discarded")
                paths.fs.rm(f"{hs_root}/{path}")
                continue
            committed.update(ids)
            entry = {k: row[k] for k in ("path", "rows", "tokens", "bytes", "sha256")}
            manifest["blocks"].append(entry)
            c = manifest["counts"]
            c["samples"] += entry["rows"]
            c["tokens"] += entry["tokens"]
            c["bytes"] += entry["bytes"]
            manifest["rejected"]["extract"] = rejected.to_json()
            storage.write_json_atomic(paths.fs, man_path, manifest)
            summary.samples += entry["rows"]
            summary.tokens += entry["tokens"]
            summary.bytes_written += entry["bytes"]
            summary.blocks += 1
            bar.update(entry["rows"])
            tok_s = summary.tokens / max(time.time() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{tok_s:.0f}", retries=summary.retries)
            if time.time() - t_replicas > 5:
                alive, t_replicas = replicas_alive(app), time.time()
            metrics.extract_commit(cfg.run.name, entry["tokens"], entry["rows"], int(row.get("retries", 0)), tok_s,
                                   alive)
            if on_commit is not None:
                on_commit(manifest)
        bar.close()
        summary.seconds = time.time() - t0
        # blocks of attempts that died after writing (their unit was redone): not in the manifest, removed
        summary.orphans_removed_end = _remove_orphans(paths.fs, hs_root, manifest)

    vocab_size = spec.model_identity["vocab_size"]
    freq = blocks.token_frequencies(paths.fs, hs_root, manifest, vocab_size)
    from safetensors.numpy import save as st_save

    storage.write_bytes_atomic(paths.fs, f"{hs_root}/token_freq.safetensors", st_save({"counts": freq}))
    manifest["counts"]["loss_tokens"] = int(freq.sum())
    manifest["token_freq"] = "token_freq.safetensors"
    manifest["rejected"]["extract"] = rejected.to_json()
    manifest["retries"] = manifest.get("retries", 0) + summary.retries
    manifest["complete"] = True
    manifest["completed_at"] = time.time()
    storage.write_json_atomic(paths.fs, man_path, manifest)
    summary.wall_seconds = time.time() - t_start
    summary.total_samples = manifest["counts"]["samples"]
    summary.total_tokens = manifest["counts"]["tokens"]
    summary.rejected = manifest["rejected"]
    return summary


def load_token_frequencies(paths: storage.RunPaths) -> np.ndarray:
    """Loss-masked token counts [V] written by a complete extract."""
    from safetensors.numpy import load as st_load

    with paths.fs.open(f"{paths.hidden_states}/token_freq.safetensors", "rb") as f:
        return st_load(f.read())["counts"]
