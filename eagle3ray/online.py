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
from .extract import BlockWriter, _todo, plan_units, unit_items
from .sources import RejectCounter

log = logging.getLogger(__name__)


class StateRows(BlockWriter):
    """Ray Data callable class: one unit -> verifier service -> the unit's rows in the block schema (a
    ``pyarrow.Table``, not written anywhere). Retries, timeouts and the split of a unit whose sample kills its
    replica are :class:`eagle3ray.extract.BlockWriter`'s; a sample that kills its replica alone is left out of
    the stream (logged)."""

    def __init__(self, run: str, **kwargs):
        super().__init__(**kwargs)
        self.run = run

    def _finish(self, samples: list[dict], got, retries: int, t0: float) -> dict:
        from . import metrics

        table = blocks.build_block(samples, got, self.storage_dtype)
        metrics.online_unit(self.run, sum(len(s["input_ids"]) for s in samples))
        return {"table": table, "retries": retries, "crashed": False}

    def __call__(self, batch: dict):
        import pyarrow as pa

        tables = [r["table"] for samples in self.units_of(batch) for r in self._blocks(samples) if not r["crashed"]]
        return pa.concat_tables(tables) if tables else blocks.BLOCK_SCHEMA.empty_table()


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


def datasets(cfg, spec, paths: storage.RunPaths):
    """(train, val) Ray Datasets streaming the verifier service's states (module docstring). Starts the verifier
    service, or reuses it when it runs; the held-out dataset is computed here (``materialize``).

    Raises:
        FileNotFoundError, ValueError: see :func:`split_samples`.
        RuntimeError: the verifier service failed to start, or a unit failed after its retries.
    """
    import ray.data

    from .verifier_service import app_name, start_for_config

    train_s, val_s, rejected = split_samples(cfg, paths)
    if rejected.total:
        log.warning("online: %d sample(s) rejected: %s", rejected.total, rejected.to_json())
    t0 = time.time()
    start_for_config(cfg)
    log.info("online: verifier service ready in %.1f s; %d training and %d held-out samples streamed",
             time.time() - t0, len(train_s), len(val_s))
    e = cfg.extract
    kwargs = dict(run=cfg.run.name, app=app_name(spec), storage_uri=cfg.run.storage, endpoint_url=cfg.run.endpoint_url,
                  hs_root=paths.hidden_states, storage_dtype=e.storage_dtype, compression=e.compression,
                  max_retries=e.max_unit_retries, unit_timeout_s=e.unit_timeout_s, queue_depth=e.writers_per_replica)

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


@dataclass
class NotExtracted:
    """The extract stage's summary in a run whose states are streamed (``train.data_source: online``)."""

    data_source: str
    title: str = "extract"

    def headline(self) -> str:
        return (f"extract: not run (train.data_source {self.data_source}: the train stage streams the verifier's "
                "states; none are stored)")

    def rows(self) -> list[tuple[str, object]]:
        return [("data_source", self.data_source), ("hidden-state bytes written", 0)]
