"""Hidden-state blocks and their manifest: the contract between ``extract`` and ``train`` (schema v1).

A block is a Parquet file, one row per sample:

=============== ============== ==========================================================
column          type           meaning
=============== ============== ==========================================================
sample_id       string         unique id of the conversation (``<source>:<record id>``)
input_ids       list<int32>    T token ids (verifier tokenizer, chat template applied)
loss_mask       list<int8>     T flags, 1 on assistant-answer tokens
hidden_states   large_binary   [T, L, H] array, little-endian, dtype ``hs_dtype``, C order
seq_len         int32          T
num_layers      int32          L = len(manifest.layer_ids) (aux layers + final pre-norm)
hidden_size     int32          H
hs_dtype        string         bfloat16 | float16 | float32
=============== ============== ==========================================================

``hidden_states/manifest.json`` lists the committed blocks (path relative to ``hidden_states/``,
rows, tokens, bytes, sha256). A file under ``blocks/`` that the manifest does not list does not
exist for readers (it is an interrupted write) and is deleted when extraction resumes.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import storage
from .verifier import from_storage_bytes

SCHEMA_VERSION = 1
LAYER_ID_CONVENTION = (
    "vLLM/speculators eagle_aux_hidden_state_layer_ids: id i < L is the input of decoder layer i "
    "(= transformers hidden_states[i]); id L is the last layer's output before the final norm"
)

BLOCK_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("hidden_states", pa.large_binary()),
    ("seq_len", pa.int32()),
    ("num_layers", pa.int32()),
    ("hidden_size", pa.int32()),
    ("hs_dtype", pa.string()),
])


class ManifestMismatch(ValueError):
    """Existing blocks were made with other settings than the current config."""


def build_block(samples: list[dict], results: list[dict], storage_dtype: str) -> pa.Table:
    """Rows for one block. ``samples``: {sample_id, input_ids, loss_mask}; ``results``: engine output."""
    rows = {k: [] for k in BLOCK_SCHEMA.names}
    for s, r in zip(samples, results, strict=True):
        if s["sample_id"] != r["sample_id"]:
            raise ValueError(f"block assembly: result for {r['sample_id']} paired with {s['sample_id']}")
        T, L, H = r["shape"]
        rows["sample_id"].append(s["sample_id"])
        rows["input_ids"].append(list(map(int, s["input_ids"])))
        rows["loss_mask"].append(list(map(int, s["loss_mask"])))
        rows["hidden_states"].append(r["hidden_states"])
        rows["seq_len"].append(T)
        rows["num_layers"].append(L)
        rows["hidden_size"].append(H)
        rows["hs_dtype"].append(storage_dtype)
    return pa.table(rows, schema=BLOCK_SCHEMA)


def write_block(fs, path: str, table: pa.Table, compression: str) -> dict:
    """Write a block atomically; returns its manifest entry fields (bytes, sha256, rows, tokens)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=None if compression == "none" else compression)
    buf = sink.getvalue().to_pybytes()
    storage.write_bytes_atomic(fs, path, buf)
    return {"bytes": len(buf), "sha256": hashlib.sha256(buf).hexdigest(), "rows": table.num_rows,
            "tokens": int(pa.compute.sum(table["seq_len"]).as_py() or 0)}


def decode_states(row: dict) -> np.ndarray:
    """float32 [T, L, H] array of one block row (a dict as read from Parquet)."""
    shape = (row["seq_len"], row["num_layers"], row["hidden_size"])
    return from_storage_bytes(row["hidden_states"], shape, row["hs_dtype"])


def new_manifest(verifier: dict, layer_ids: list[int], storage_dtype: str, conversations: dict) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "eagle3ray.hidden_states",
        "complete": False,
        "verifier": verifier,
        "layer_ids": list(layer_ids),
        "layer_id_convention": LAYER_ID_CONVENTION,
        "dtype": storage_dtype,
        "conversations": conversations,
        "blocks": [],
        "counts": {"samples": 0, "tokens": 0, "loss_tokens": 0, "bytes": 0},
        "rejected": {},
        "created_at": time.time(),
    }


def check_compute_dtype(existing: dict | None, dtype: str, where: str) -> None:
    """Raise :class:`ManifestMismatch` when stored blocks were extracted at another verifier compute dtype
    (``verifier.dtype: auto`` may resolve differently on another machine). Manifests written before the
    dtype was recorded pass."""
    stored = (existing or {}).get("verifier", {}).get("compute_dtype")
    if stored is not None and stored != dtype:
        raise ManifestMismatch(f"{where}: these blocks were extracted with verifier.dtype {stored!r} but this config "
                               f"resolves it to {dtype!r}; set verifier.dtype={stored} to resume, or use another "
                               "run.name")


def check_compatible(existing: dict, fresh: dict, where: str) -> None:
    """Raise :class:`ManifestMismatch` naming the first differing field."""
    for key in ("schema_version", "layer_ids", "dtype"):
        if existing.get(key) != fresh.get(key):
            raise ManifestMismatch(f"{where}: field {key!r} is {existing.get(key)!r} in the stored blocks but "
                                   f"{fresh.get(key)!r} for this config; use another run.name or remove the folder")
    for key in ("config_hash", "tokenizer_hash", "chat_template_hash", "hidden_size", "num_hidden_layers"):
        a, b = existing.get("verifier", {}).get(key), fresh.get("verifier", {}).get(key)
        if a != b:
            raise ManifestMismatch(f"{where}: field 'verifier.{key}' is {a!r} in the stored blocks but {b!r} for this "
                                   "config; use another run.name or remove the folder")
    check_compute_dtype(existing, fresh.get("verifier", {}).get("compute_dtype"), where)
    a, b = existing.get("conversations", {}).get("sha256"), fresh.get("conversations", {}).get("sha256")
    if a != b:
        raise ManifestMismatch(f"{where}: the conversations changed since these blocks were extracted "
                               f"(sha256 {a} vs {b}); use another run.name or remove the folder")


def committed_sample_ids(fs, hs_root: str, manifest: dict) -> list[str]:
    """Sample ids of every committed block (reads only the ``sample_id`` column)."""
    ids: list[str] = []
    for b in manifest["blocks"]:
        with fs.open(f"{hs_root}/{b['path']}", "rb") as f:
            ids.extend(pq.read_table(f, columns=["sample_id"])["sample_id"].to_pylist())
    return ids


def token_frequencies(fs, hs_root: str, manifest: dict, vocab_size: int) -> np.ndarray:
    """Counts [vocab_size] int64 of loss-masked tokens over all committed blocks."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for b in manifest["blocks"]:
        with fs.open(f"{hs_root}/{b['path']}", "rb") as f:
            t = pq.read_table(f, columns=["input_ids", "loss_mask"])
        ids = t["input_ids"].combine_chunks().flatten().to_numpy()
        mask = t["loss_mask"].combine_chunks().flatten().to_numpy().astype(bool)
        np.add.at(counts, ids[mask], 1)
    return counts


def read_committed(fs, hs_root: str) -> tuple[dict, list[str]]:
    """The manifest and the storage paths of its committed blocks (what readers may use).

    Raises:
        FileNotFoundError: no manifest (extraction never committed anything).
    """
    man = storage.read_json(fs, f"{hs_root}/manifest.json")
    if man is None:
        raise FileNotFoundError(f"{hs_root}/manifest.json not found: run `eagle3ray extract` first")
    return man, [f"{hs_root}/{b['path']}" for b in man["blocks"]]
