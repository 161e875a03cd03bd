"""Readers (and the few shared writers) of each stage's output: stages meet here, in storage, never in each other.

Every stage reads what the stages before it committed through these functions and the block contract
(:mod:`eagle3ray.blocks`), never by importing another stage, so each stage can be re-run, resumed or run on
another cluster (DESIGN.md: storage is the handoff). Paths follow the layout of :mod:`eagle3ray.storage`:

=========================================  ==================================  =================
file                                       written by                          read with
=========================================  ==================================  =================
conversations/{conversations.parquet,      prepare                             read_conversations
manifest.json}
hidden_states/token_freq.safetensors       extract (:meth:`blocks.Manifest.    load_token_frequencies
                                           finish`)
vocab/{vocab.safetensors, vocab.json}      vocab                               load_vocab, read_vocab_meta
checkpoints/metrics.jsonl                  train (rank 0, appended)            read_metrics
checkpoints/best.json                      train                               read_best
export/provenance.json                     export (written last)               read_export_provenance
=========================================  ==================================  =================
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import storage

#: ``conversations.parquet``: one row per training conversation (prepare's output).
CONV_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("source", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
])


def read_conversations(paths: storage.RunPaths) -> tuple[dict, pa.Table]:
    """The conversations manifest and table (:data:`CONV_SCHEMA`) of a run.

    The table's bytes are checked against the manifest's ``sha256`` and ``bytes``: prepare writes the table
    before the manifest, so a prepare killed between the two (or a file replaced by hand) would otherwise pair an
    old manifest with a new table, and extraction would record the old hash for blocks made from the new data.

    Raises:
        FileNotFoundError: prepare has not completed for this run.
        ValueError: the table differs from what its manifest records (names the file and both hashes).
    """
    import hashlib

    man = storage.read_json(paths.fs, f"{paths.conversations}/manifest.json")
    if not man or not man.get("complete"):
        raise FileNotFoundError(f"{paths.uri}/conversations: no complete manifest; run `eagle3ray prepare` first")
    path = f"{paths.conversations}/{man['file']}"
    with paths.fs.open(path, "rb") as f:
        buf = f.read()
    digest = hashlib.sha256(buf).hexdigest()
    if man.get("sha256") and (digest != man["sha256"] or len(buf) != man.get("bytes", len(buf))):
        raise ValueError(f"{paths.uri}/conversations/{man['file']}: {len(buf)} bytes, sha256 {digest[:16]}..., but "
                         f"manifest.json records {man.get('bytes')} bytes, sha256 {man['sha256'][:16]}... (a prepare "
                         "cut short between its two writes, or the file replaced); run `eagle3ray prepare` again")
    return man, pq.read_table(pa.BufferReader(buf))


def load_token_frequencies(paths: storage.RunPaths) -> np.ndarray:
    """Loss-masked token counts [V] int64 written by a complete extract.

    Raises:
        FileNotFoundError: extract has not completed.
    """
    from safetensors.numpy import load as st_load

    with paths.fs.open(f"{paths.hidden_states}/token_freq.safetensors", "rb") as f:
        return st_load(f.read())["counts"]


def read_vocab_meta(paths: storage.RunPaths) -> dict | None:
    """``vocab/vocab.json`` (draft_vocab_size, target_vocab_size, coverage, token_freq_sha256), or None."""
    return storage.read_json(paths.fs, f"{paths.sub('vocab')}/vocab.json")


def load_vocab(paths: storage.RunPaths):
    """(d2t [Vd] int64, t2d [V] bool) torch tensors of a run (speculators' draft-vocabulary mapping: target id =
    draft id + d2t[draft id]).

    Raises:
        FileNotFoundError: vocab has not run.
    """
    from safetensors.torch import load as st_load

    with paths.fs.open(f"{paths.sub('vocab')}/vocab.safetensors", "rb") as f:
        d = st_load(f.read())
    return d["d2t"], d["t2d"]


def metrics_path(paths: storage.RunPaths) -> str:
    """``<run>/checkpoints/metrics.jsonl``: one JSON line per training report and event."""
    return f"{paths.sub('checkpoints')}/metrics.jsonl"


def progress_path(paths: storage.RunPaths) -> str:
    """``<run>/checkpoints/progress.json``: rank 0's latest step, rewritten every 10 steps (the driver's bar)."""
    return f"{paths.sub('checkpoints')}/progress.json"


def read_metrics(paths: storage.RunPaths) -> list[dict]:
    """Every line of ``<run>/checkpoints/metrics.jsonl`` (reports, 'untrained' and 'resumed' events). A last line
    without its newline (an append cut short) is not a record and is ignored."""
    p = metrics_path(paths)
    if not paths.fs.exists(p):
        return []
    with paths.fs.open(p, "rb") as f:
        lines = f.read().decode().split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def read_best(paths: storage.RunPaths) -> dict | None:
    """``checkpoints/best.json`` ({"step", "checkpoint", "metrics"}) of a finished training, or None."""
    return storage.read_json(paths.fs, f"{paths.sub('checkpoints')}/best.json")


def read_export_provenance(paths: storage.RunPaths) -> dict | None:
    """``export/provenance.json`` of a finished export (written last, so None means unfinished), or None."""
    return storage.read_json(paths.fs, f"{paths.sub('export')}/provenance.json")
