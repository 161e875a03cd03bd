"""``train.data_source: online``: the verifier service's hidden states streamed into Ray Train, nothing stored.

Pipeline (Ray Data, re-run for every epoch by Ray Train's streaming split)::

    conversations (<= verifier.max_model_len; the last train.val_fraction of samples held out)
      -> units: consecutive samples packed up to ``extract.max_tokens_per_batch`` tokens
      -> map_batches(StateRows, ActorPoolStrategy(min_replicas, max_replicas) x writers_per_replica)
           each call: one unit -> verifier service (``extract``, the same Serve application as the extract stage)
           -> the unit's rows in the block schema (:data:`eagle3ray.blocks.BLOCK_SCHEMA`), in Ray's object store
      -> TorchTrainer ``train`` dataset -> :class:`eagle3ray.train_worker.EpochBatches` on each worker

The held-out samples are streamed once, before training, and kept in the object store (``materialize``) for the
evaluations at every checkpoint. The rows are the rows a stored block holds (same columns, same
``extract.storage_dtype`` encoding), so the worker loop, the loss, the step, the checkpoints and the export are the
code of the offline path. Ray Data's streaming executor applies backpressure between the verifier replicas and
the train workers. Nothing is written to storage but the run's checkpoints, reports and draft vocabulary.

Faults: a replica that dies or hangs mid-stream costs its in-flight unit, retried as in extraction
(:class:`eagle3ray.extract.BlockWriter`; a sample that kills its replica alone is left out and logged). A train
worker that dies, or a driver restarted on the run, resumes from the last checkpoint: the samples it records as
consumed in the current epoch are dropped on the worker (:class:`eagle3ray.train_worker.EpochBatches`), so none is
trained twice or skipped; their units are still sent to the verifier again (the stream is the same each epoch).

The draft vocabulary of an online run is counted from the conversations (:func:`conversation_frequencies`): the
loss-masked tokens of the samples extraction would keep, the same counts a complete extraction writes.

This module is the extract stage's streamed form: the pipeline hands :func:`datasets` to the train stage and
:func:`conversation_frequencies` to the vocab stage (stages meet only in storage or through the pipeline).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from . import blocks, storage
from .artifacts import read_conversations
from .extract import BlockWriter, _todo, check_storage_limit, plan_units, unit_items
from .sources import RejectCounter

log = logging.getLogger(__name__)


class StateRows(BlockWriter):
    """Ray Data callable class: one unit -> verifier service -> the unit's rows in the block schema (a
    ``pyarrow.Table``). Retries, timeouts and the split of a unit whose sample kills its replica are
    :class:`eagle3ray.extract.BlockWriter`'s; a sample that kills its replica alone is left out of the stream
    (logged).

    With ``committer`` (``train.data_source: hybrid``, a :class:`Committer` actor handle) the unit's samples that
    are already committed are read back from their blocks instead (no verifier call), and each streamed unit's
    block is also written under ``blocks/`` and committed before its rows go to training."""

    def __init__(self, run: str, committer=None, **kwargs):
        super().__init__(**kwargs)
        self.run, self.committer = run, committer

    def _finish(self, samples: list[dict], got, retries: int, t0: float) -> dict:
        import uuid

        import ray

        from . import metrics

        table = blocks.build_block(samples, got, self.storage_dtype)
        metrics.online_unit(self.run, sum(len(s["input_ids"]) for s in samples), retries)
        if self.committer is not None:  # hybrid: the block is written, then committed (exactly once per sample)
            rel = f"blocks/part-{uuid.uuid4().hex}.parquet"
            entry = blocks.write_block(self.fs, f"{self.hs_root}/{rel}", table, self.compression)
            ray.get(self.committer.commit.remote({"path": rel, **entry}, [s["sample_id"] for s in samples], retries))
        return {"table": table, "retries": retries, "crashed": False}

    def _stored(self, path: str, ids: list[str]):
        """The rows of ``ids`` in the committed block ``path`` (relative to hidden_states/)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from . import metrics

        with self.fs.open(f"{self.hs_root}/{path}", "rb") as f:
            table = pq.read_table(f).select(blocks.BLOCK_SCHEMA.names).cast(blocks.BLOCK_SCHEMA)
        if table.num_rows != len(ids):
            table = table.filter(pc.is_in(table["sample_id"], value_set=pa.array(ids)))
        metrics.online_from_storage(self.run, int(pc.sum(table["seq_len"]).as_py() or 0))
        return table

    def _unit_tables(self, samples: list[dict]) -> list:
        """The tables of one unit's rows: committed samples read back (hybrid), the rest from the verifier."""
        import ray

        out = []
        if self.committer is not None:
            stored, crashed = ray.get(self.committer.lookup.remote([s["sample_id"] for s in samples]))
            out = [self._stored(path, ids) for path, ids in stored.items()]
            have = {i for ids in stored.values() for i in ids} | set(crashed)
            samples = [s for s in samples if s["sample_id"] not in have]
        for r in self._blocks(samples) if samples else []:
            if r["crashed"] and self.committer is not None:
                ray.get(self.committer.crashed.remote(r["sample_ids"][0]))
            if not r["crashed"]:
                out.append(r["table"])
        return out

    def __call__(self, batch: dict):
        import pyarrow as pa

        tables = [t for samples in self.units_of(batch) for t in self._unit_tables(samples)]
        return pa.concat_tables(tables) if tables else blocks.BLOCK_SCHEMA.empty_table()


class Committer:
    """Ray actor: the one writer of a hybrid run's manifest while the train stage streams (the driver's role in
    the extract stage, :func:`eagle3ray.extract._commit_blocks`). :class:`StateRows` actors write the blocks; this
    commits them one at a time under :class:`eagle3ray.blocks.Manifest`'s rules (exactly once per sample: a block
    repeating a committed sample is deleted) and says which block holds a committed sample.

    Opening the manifest resumes it as the extract stage does (same checks, orphan blocks removed), so a hybrid
    run continues the blocks of an interrupted extract or hybrid run, and an offline run continues a hybrid one.

    Raises (in the constructor):
        blocks.ManifestMismatch: stored blocks were made with other settings.
        blocks.CorruptBlocks: a recently committed block is missing or has another size.
    """

    def __init__(self, storage_uri: str, endpoint_url: str | None, hs_root: str, fresh: dict, prepare_rejected: dict,
                 rejected: dict, max_storage_gib: float | None = None, total: int = 0):
        fs, _ = storage.filesystem(storage_uri, endpoint_url)
        self.manifest = blocks.Manifest.open(fs, hs_root, fresh, f"{hs_root}/manifest.json")
        self.block_of: dict[str, str] = {}
        for b in self.manifest.data["blocks"]:
            ids = b.get("sample_ids") or blocks.committed_sample_ids(fs, hs_root, {"blocks": [b]})
            self.block_of.update(dict.fromkeys(ids, b["path"]))
        self.limit_gib, self.total = max_storage_gib, total  # extract.max_storage_gib, the samples to commit
        self.rejected = RejectCounter.from_json(rejected)  # too_long (split_samples); engine_crash added here
        self.crashed_ids: set[str] = set()
        self.stats = {"samples_committed": 0, "samples_from_storage": 0, "duplicates": 0, "retries": 0,
                      "orphans_removed": 0}
        if not self.manifest.complete:
            self.stats["orphans_removed"] = self.manifest.remove_orphans()
            self.manifest.set_rejected(prepare_rejected, self.rejected.to_json())

    def missing(self, sample_ids: list[str]) -> int:
        """How many of ``sample_ids`` no committed block holds."""
        return sum(i not in self.block_of for i in sample_ids)

    def lookup(self, sample_ids: list[str]) -> tuple[dict[str, list[str]], list[str]]:
        """({committed block path: the ids of ``sample_ids`` it holds}, ids rejected as ``engine_crash`` in this
        run); the other ids are not committed yet."""
        stored: dict[str, list[str]] = {}
        for i in sample_ids:
            if i in self.block_of:
                stored.setdefault(self.block_of[i], []).append(i)
        self.stats["samples_from_storage"] += sum(len(v) for v in stored.values())
        return stored, [i for i in sample_ids if i in self.crashed_ids]

    def commit(self, entry: dict, sample_ids: list[str], retries: int) -> list[str]:
        """Commit one written block (:meth:`eagle3ray.blocks.Manifest.commit`); returns the ids that were already
        committed (then the block was deleted and nothing committed).

        Raises:
            eagle3ray.extract.StorageLimitExceeded: the committed blocks passed ``extract.max_storage_gib`` (this
                block stays committed; the stream, and so the train stage, stops).
        """
        self.stats["retries"] += retries
        dup = self.manifest.commit(entry, sample_ids, self.rejected.to_json())
        if dup:
            self.rejected.add("duplicate", dup[0], f"block {entry['path']} repeats {len(dup)} committed samples; "
                              "discarded")
            self.stats["duplicates"] += 1
            return dup
        self.block_of.update(dict.fromkeys(sample_ids, entry["path"]))
        self.stats["samples_committed"] += len(sample_ids)
        c = self.manifest.counts
        check_storage_limit(self.limit_gib, c["bytes"], c["samples"], self.total)  # as the extract stage holds it
        return []

    def crashed(self, sample_id: str) -> None:
        """A sample that killed its replica alone (never committed; a later run tries it again)."""
        if sample_id not in self.crashed_ids:
            self.crashed_ids.add(sample_id)
            self.rejected.add("engine_crash", sample_id, "the verifier replica died (or hung and was replaced) on "
                              "this sample alone")

    def state(self) -> dict:
        """{"stats", "rejected" (RejectCounter JSON), "crashed" (ids), "committed" (samples)}."""
        return {"stats": dict(self.stats), "rejected": self.rejected.to_json(), "crashed": sorted(self.crashed_ids),
                "committed": len(self.block_of)}


def split_samples(cfg, paths: storage.RunPaths) -> tuple[list[dict], list[dict], RejectCounter]:
    """(train samples, held-out samples, rejected) of the run's conversations, as ``{sample_id, input_ids,
    loss_mask}``: those longer than ``verifier.max_model_len`` are rejected (``too_long``) as extraction rejects
    them; the last ``train.val_fraction`` of the rest (>= 1) are held out.

    Raises:
        FileNotFoundError: prepare has not completed.
        ValueError: fewer than 2 samples fit the verifier.
    """
    _, conv = read_conversations(paths)
    rejected = RejectCounter()
    todo = _todo(conv, set(), cfg.verifier.max_model_len, rejected)
    if len(todo) < 2:
        raise ValueError(f"{paths.uri}/conversations: {len(todo)} sample(s) fit verifier.max_model_len "
                         f"{cfg.verifier.max_model_len}; training needs >= 2 (one is held out)")
    n_val = max(1, round(len(todo) * cfg.train.val_fraction))
    return todo[:-n_val], todo[-n_val:], rejected


def token_frequencies(samples: list[dict], vocab_size: int) -> np.ndarray:
    """Loss-masked token counts [vocab_size] int64 over ``samples`` (what :func:`eagle3ray.blocks.token_frequencies`
    counts over the committed blocks of the same samples)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        ids, mask = np.asarray(s["input_ids"], dtype=np.int64), np.asarray(s["loss_mask"], dtype=bool)
        np.add.at(counts, ids[mask], 1)
    return counts


def conversation_frequencies(cfg) -> np.ndarray:
    """The draft vocabulary's input for an online run: :func:`token_frequencies` over every sample an extraction
    would keep (held-out ones too, as the extract stage counts every committed block).

    Raises:
        FileNotFoundError, ValueError: see :func:`split_samples`.
    """
    from .verifier import VerifierSpec

    train_s, val_s, _ = split_samples(cfg, storage.run_paths(cfg))
    return token_frequencies(train_s + val_s, VerifierSpec.from_config(cfg).model_identity["vocab_size"])


def datasets(cfg, spec, paths: storage.RunPaths, committer=None):
    """(train, val) Ray Datasets streaming the verifier service's states (module docstring). Starts the verifier
    service, or reuses it when it runs; the held-out dataset is computed here (``materialize``).

    Args:
        committer: ``train.data_source: hybrid``: a :class:`Committer` actor handle (:class:`HybridStream` passes
            it); streamed blocks are committed, committed ones read back. The service is not started when every
            sample is committed already.

    Raises:
        FileNotFoundError, ValueError: see :func:`split_samples`.
        RuntimeError: the verifier service failed to start, or a unit failed after its retries.
    """
    import ray
    import ray.data

    from .verifier_service import app_name, start_for_config

    train_s, val_s, rejected = split_samples(cfg, paths)
    if rejected.total:
        log.warning("online: %d sample(s) rejected: %s", rejected.total, rejected.to_json())
    t0 = time.time()
    todo = len(train_s) + len(val_s)
    if committer is not None:
        todo = ray.get(committer.missing.remote([s["sample_id"] for s in train_s + val_s]))
    if todo:
        start_for_config(cfg)
    log.info("online: verifier service %s in %.1f s; %d training and %d held-out samples streamed%s",
             "ready" if todo else "not needed", time.time() - t0, len(train_s), len(val_s),
             "" if committer is None else f" ({todo} not committed yet; the rest read from their blocks)")
    e = cfg.extract
    kwargs = dict(run=cfg.run.name, app=app_name(spec), storage_uri=cfg.run.storage, endpoint_url=cfg.run.endpoint_url,
                  hs_root=paths.hidden_states, storage_dtype=e.storage_dtype, compression=e.compression,
                  max_retries=e.max_unit_retries, unit_timeout_s=e.unit_timeout_s, queue_depth=e.writers_per_replica,
                  committer=committer)

    def stream(samples: list[dict]):
        items = unit_items(plan_units(samples, e.max_tokens_per_batch))
        return ray.data.from_items(items, override_num_blocks=min(len(items), 200)).map_batches(
            StateRows, fn_constructor_kwargs=kwargs, batch_size=1, num_cpus=e.writer_num_cpus,
            compute=ray.data.ActorPoolStrategy(min_size=e.min_replicas * e.writers_per_replica,
                                               max_size=e.max_replicas * e.writers_per_replica))

    t0 = time.time()
    val = stream(val_s).materialize()
    log.info("online: %d held-out samples streamed in %.1f s (kept in the object store)", val.count(),
             time.time() - t0)
    return stream(train_s), val


class HybridStream:
    """``train.data_source: hybrid``: the train stage's stream with every unit's block committed too.

    Use::

        with HybridStream(cfg) as h:
            train(cfg, stream=h.datasets)
        h.summary  # what the stream committed and read back; whether the manifest is now complete

    :meth:`datasets` starts a :class:`Committer` actor (the manifest's one writer while training runs) and hands
    it to :func:`datasets`. On a clean exit the committer is stopped and, once every sample that fits the verifier
    is committed (the first epoch has run through), the manifest is audited and marked complete
    (:func:`eagle3ray.extract.seal`): the run's ``hidden_states/`` is then a complete extraction that later epochs,
    later runs and ``train.data_source: offline`` read without the verifier. Short of that it stays incomplete, and
    ``eagle3ray extract`` (offline) commits the rest. On an error the committer is stopped; every commit so far stays.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.actor = None
        self.summary: dict = {}

    def datasets(self, cfg, spec, paths: storage.RunPaths):
        """:func:`datasets` with a new :class:`Committer` (its constructor's errors are raised here)."""
        import ray

        from .extract import fresh_manifest

        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        train_s, val_s, rejected = split_samples(cfg, paths)
        conv_man, _ = read_conversations(paths)
        fresh = fresh_manifest(cfg, spec, conv_man)
        # stored blocks of other settings are refused here, naming the field, rather than as the actor's death
        blocks.Manifest.open(paths.fs, paths.hidden_states, fresh, f"{paths.hidden_states}/manifest.json")
        # on the driver's node: a verifier or train node lost mid-run must not take the manifest's writer with it
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.actor = ray.remote(Committer).options(num_cpus=0, scheduling_strategy=here).remote(
            cfg.run.storage, cfg.run.endpoint_url, paths.hidden_states, fresh, conv_man.get("rejected", {}),
            rejected.to_json(), cfg.extract.max_storage_gib, len(train_s) + len(val_s))
        return datasets(cfg, spec, paths, committer=self.actor)

    def __enter__(self) -> "HybridStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        import ray

        state = None
        if self.actor is not None:
            try:
                state = ray.get(self.actor.state.remote(), timeout=120)
            except Exception as e:  # noqa: BLE001 - its commits are on storage; the manifest is reopened below
                log.warning("hybrid: the committer did not answer (%s); its commits are on storage", e)
            ray.kill(self.actor)
            self.actor = None
        if exc_type is None:
            self.summary = finish_hybrid(self.cfg, state)
        return False


def finish_hybrid(cfg, state: dict | None = None) -> dict:
    """After a hybrid train stage: seal the manifest when every sample that fits the verifier is committed (or was
    rejected as ``engine_crash`` in ``state``, the :class:`Committer`'s last :meth:`Committer.state`). Returns
    ``{"committed", "expected", "complete", **state["stats"]}``.

    Raises:
        eagle3ray.audit.AuditFailed, blocks.CorruptBlocks: see :func:`eagle3ray.extract.seal`.
    """
    from .extract import fresh_manifest, seal
    from .verifier import VerifierSpec

    paths = storage.run_paths(cfg)
    spec = VerifierSpec.from_config(cfg)
    conv_man, _ = read_conversations(paths)
    train_s, val_s, rejected = split_samples(cfg, paths)
    state = state or {}
    out = {"expected": len(train_s) + len(val_s), **state.get("stats", {})}
    man = blocks.Manifest.open(paths.fs, paths.hidden_states, fresh_manifest(cfg, spec, conv_man),
                               f"{paths.hidden_states}/manifest.json")
    done = man.committed_ids()
    out["committed"] = len(done)
    if not man.complete:
        crashed = set(state.get("crashed", []))
        missing = [s["sample_id"] for s in train_s + val_s if s["sample_id"] not in done | crashed]
        if missing:
            log.info("hybrid: %d of %d samples committed; hidden_states/ stays incomplete (`eagle3ray extract -c CONFIG "
                     "train.data_source=offline` commits the rest)", len(done), out["expected"])
        else:
            man.remove_orphans()
            if state.get("rejected"):
                rejected = RejectCounter.from_json(state["rejected"])
            seal(cfg, paths, man, spec, rejected, int(state.get("stats", {}).get("retries", 0)), audit_again=True)
            log.info("hybrid: every sample committed; hidden_states/ is a complete extraction (%d samples)", len(done))
    out["complete"] = man.complete
    return out


@dataclass
class NotExtracted:
    """The extract stage's summary in a run whose states are streamed (``train.data_source: online | hybrid``)."""

    data_source: str
    title: str = "extract"

    def headline(self) -> str:
        if self.data_source == "hybrid":
            return ("extract: not run (train.data_source hybrid: the train stage streams the verifier's states and "
                    "commits them under hidden_states/)")
        return (f"extract: not run (train.data_source {self.data_source}: the train stage streams the verifier's "
                "states; none are stored)")

    def rows(self) -> list[tuple[str, object]]:
        stored = "by the train stage" if self.data_source == "hybrid" else 0
        return [("data_source", self.data_source), ("hidden-state bytes written", stored)]
