"""Hidden-state blocks and their manifest: the contract between ``extract`` and ``train`` (schema v1).

A block is a Parquet file, one row per sample:

=============== ============== ==========================================================
column          type           meaning
=============== ============== ==========================================================
sample_id       string         unique id of the conversation (``<source>:<record id>``)
input_ids       list<int32>    T token ids (verifier tokenizer, chat template applied)
loss_mask       list<int8>     T flags, 1 on assistant-answer tokens
hidden_states   large_binary   [T, L, H] array, little-endian, dtype ``hs_dtype``, C order (float8_e4m3:
                               followed by its [T, L] float32 scales, see below)
seq_len         int32          T
num_layers      int32          L = len(manifest.layer_ids) (aux layers + final pre-norm)
hidden_size     int32          H
hs_dtype        string         bfloat16 | float16 | float32 | float8_e4m3
=============== ============== ==========================================================

The ``hidden_states`` bytes are written by :func:`to_storage_bytes` and read by :func:`from_storage_bytes`
(:func:`decode_states` for a row), which returns float32 [T, L, H] whatever the dtype: raw little-endian values,
bfloat16 as its upper 16 bits of float32. ``float8_e4m3`` (torch's ``float8_e4m3fn``: 4 exponent bits, 3 mantissa
bits, no infinities, largest finite 448) is scaled per token and layer: ``scale[t, l] = amax(|x[t, l, :]|) / 448``
(0 for an all-zero row, whose values are then all 0), the T*L*H bytes of ``x / scale`` in e4m3 come first, then
the T*L float32 scales, so a row holds T*L*(H + 4) bytes (:func:`bytes_per_token`) and decodes as
``value * scale``. Blocks of the other dtypes are byte for byte what they were before float8_e4m3 existed.
Nothing but ``extract.compression`` (Parquet's zstd by default) is applied on top: ``benchmarks/block_codec.py``
measured the alternatives, Parquet's BYTE_STREAM_SPLIT among them (docs/results.md).

``hidden_states/manifest.json`` lists the committed blocks (path relative to ``hidden_states/``,
rows, tokens, bytes, sha256, and the block's sample ids). A file under ``blocks/`` that the manifest does not
list does not exist for readers (it is an interrupted write) and is deleted when extraction resumes. The rules of
a commit (exactly once per sample, orphans, counts, the final token frequencies) are :class:`Manifest`'s.

Commits cost O(1): each commit writes one small file ``commits/<seq>.json`` (atomically: rename locally, one
PUT on object stores) instead of rewriting the manifest, and the manifest (a snapshot) is rewritten only when
the commit log has grown as long as the snapshot itself (and at least :data:`COMPACT_MIN` entries), so the
rewrites cost O(1) per commit amortized. The snapshot records the last commit it holds
(``commit_log.folded_through``); readers (:func:`read_committed`) fold the newer commit files in. A complete
manifest has an empty log, so a finished run's ``manifest.json`` alone is the whole truth, as in earlier
versions. ``benchmarks/manifest_commit.py`` measures the per-commit cost from 100 to 100,000 blocks.

This module is the whole contract: it imports no engine and no stage.
"""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import storage

SCHEMA_VERSION = 1
#: dtypes a block's ``hidden_states`` may be stored in (``extract.storage_dtype``).
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3")
#: Bytes per stored value of each storage dtype (float8_e4m3 adds a float32 scale per token and layer).
VALUE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1}
#: The largest finite float8_e4m3fn value (S.1111.110 = 1.75 x 2^8; S.1111.111 is NaN, there is no infinity):
#: a row scaled by amax / 448 uses the whole range.
FP8_E4M3_MAX = 448.0
#: The fields of one committed block in ``manifest["blocks"]`` (and ``sample_ids``, the ids in block order).
ENTRY_FIELDS = ("path", "rows", "tokens", "bytes", "sha256")
#: The commit log's folder under ``hidden_states/``: one ``<seq>.json`` file per commit since the snapshot.
COMMITS_DIR = "commits"
#: The snapshot is rewritten when the commit log holds max(COMPACT_MIN, blocks in the snapshot) commits.
COMPACT_MIN = 256
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


class CorruptBlocks(ValueError):
    """Committed blocks are missing or differ from their manifest entry (size or sha256).

    ``problems`` maps each block's path (relative to ``hidden_states/``) to what is wrong; the message names them
    and the way out (``eagle3ray verify -c CONFIG --repair`` drops them so that their samples are extracted again).
    """

    def __init__(self, where: str, problems: dict[str, str]):
        self.problems = problems
        shown = "; ".join(f"{p}: {why}" for p, why in list(problems.items())[:5])
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        super().__init__(f"{where}: {len(problems)} committed block(s) are missing or corrupt: {shown}{more}. "
                         "Run `eagle3ray verify -c CONFIG --repair` to drop them from the manifest; `eagle3ray "
                         "extract` then extracts their samples again")


def verify_block(fs, hs_root: str, entry: dict, sha256: bool = True) -> str | None:
    """What is wrong with one committed block, or None when it matches its manifest entry.

    Checks, cheapest first: the file exists; its size is ``entry["bytes"]`` (a truncated or rewritten block);
    with ``sha256``, the sha256 of its bytes (read streamed, 8 MiB at a time) is ``entry["sha256"]`` (a flipped
    byte, which an uncompressed Parquet file would not reveal on read).
    """
    path = f"{hs_root}/{entry['path']}"
    try:
        size = fs.info(path)["size"]
    except FileNotFoundError:
        return "missing"
    if size != entry["bytes"]:
        return f"{size} bytes, the manifest says {entry['bytes']} (truncated or rewritten)"
    if sha256:
        h = hashlib.sha256()
        with fs.open(path, "rb") as f:
            for chunk in iter(lambda: f.read(8 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != entry["sha256"]:
            return "sha256 differs from the manifest's (corrupt bytes)"
    return None


def bytes_per_token(num_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes of one token's states in a row's ``hidden_states`` before compression: L x H values of
    ``storage_dtype``, plus L float32 scales for float8_e4m3 (4 x 576 bf16: 4608; fp8: 2304 + 16 = 2320)."""
    scales = 4 * num_layers if storage_dtype == "float8_e4m3" else 0
    return num_layers * hidden_size * VALUE_BYTES[storage_dtype] + scales


def to_storage_array(states, storage_dtype: str) -> np.ndarray:
    """Encode a torch tensor [T, L, H] (finite: the verifier rejects NaN/Inf) as a row's ``hidden_states``: a flat
    uint8 numpy array of the raw little-endian values of ``storage_dtype``; for float8_e4m3 the scaled e4m3 values
    then the [T, L] float32 scales (module docstring).

    A contiguous tensor already in ``storage_dtype`` is not copied (the array shares its memory), and Ray sends a
    numpy array between processes without pickling its bytes, so the engines return this form: a unit's states
    reach the block writer with one copy into the object store and none out of it (``benchmarks/data_plane.py``).
    """
    import torch

    if storage_dtype == "float8_e4m3":
        x = states.float().contiguous()  # shape: [T, L, H]
        scale = x.abs().amax(dim=-1) / FP8_E4M3_MAX  # shape: [T, L]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: 0 / 1 = 0
        # |x / scale| <= 448 up to rounding, which the cast rounds back to 448; only an amax so small that amax / 448
        # is a float32 subnormal goes past 464, where torch's cast paths differ (NaN or saturation): clamp
        q = (x / safe[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return np.concatenate([q.view(torch.uint8).numpy().reshape(-1),
                               scale.numpy().astype("<f4").view(np.uint8).reshape(-1)])
    t = states.to(getattr(torch, storage_dtype)).contiguous()
    raw = t.view(torch.int16).numpy() if storage_dtype == "bfloat16" else t.numpy()
    return raw.reshape(-1).view(np.uint8)


def to_storage_bytes(states, storage_dtype: str) -> bytes:
    """:func:`to_storage_array` as ``bytes``."""
    return to_storage_array(states, storage_dtype).tobytes()


def _e4m3fn_values() -> np.ndarray:
    """float32 [256]: the value of each float8_e4m3fn byte (sign, 4 exponent bits with bias 7, 3 mantissa bits;
    exponent 0 is subnormal, S.1111.111 is NaN), so decoding is one table lookup and needs no torch."""
    b = np.arange(256)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    mag[(exp == 15) & (man == 7)] = np.nan
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


_E4M3FN = _e4m3fn_values()


def from_storage_bytes(buf: bytes, shape, storage_dtype: str):
    """Decode bytes written by :func:`to_storage_bytes` into a float32 numpy array of ``shape`` [T, L, H].

    Raises:
        ValueError: the bytes are not ``shape`` in ``storage_dtype`` (float8_e4m3: T*L*(H + 4) bytes).
    """
    if storage_dtype == "float8_e4m3":
        T, L, H = shape
        if len(buf) != T * L * (H + 4):
            raise ValueError(f"float8_e4m3 states of shape {tuple(shape)} need {T * L * (H + 4)} bytes "
                             f"({T * L * H} values + {T * L} float32 scales), got {len(buf)}")
        q = np.frombuffer(buf, dtype=np.uint8, count=T * L * H).reshape(T, L, H)
        scale = np.frombuffer(buf, dtype="<f4", offset=T * L * H).reshape(T, L, 1)
        return _E4M3FN[q] * scale
    if storage_dtype == "bfloat16":
        raw = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(shape)
    return np.frombuffer(buf, dtype=np.dtype(storage_dtype)).astype(np.float32).reshape(shape)


def build_block(samples: list[dict], results: list[dict], storage_dtype: str,
                scratch: "BlockScratch | None" = None) -> pa.Table:
    """Rows for one block. ``samples``: {sample_id, input_ids, loss_mask}; ``results``: engine output (its
    ``hidden_states``: bytes, or the flat uint8 array of :func:`to_storage_array`).

    The states column is one contiguous buffer (each row's bytes copied into it once): a fresh one, or with
    ``scratch`` the writer's reused buffer, whose table must then be consumed before that scratch's next block.

    Raises:
        ValueError: a result paired with the wrong sample.
    """
    rows = {k: [] for k in BLOCK_SCHEMA.names if k != "hidden_states"}
    states = []
    for s, r in zip(samples, results, strict=True):
        if s["sample_id"] != r["sample_id"]:
            raise ValueError(f"block assembly: result for {r['sample_id']} paired with {s['sample_id']}")
        T, L, H = r["shape"]
        rows["sample_id"].append(s["sample_id"])
        rows["input_ids"].append(list(map(int, s["input_ids"])))
        rows["loss_mask"].append(list(map(int, s["loss_mask"])))
        hs = r["hidden_states"]
        states.append(hs if isinstance(hs, np.ndarray) else np.frombuffer(hs, dtype=np.uint8))
        rows["seq_len"].append(T)
        rows["num_layers"].append(L)
        rows["hidden_size"].append(H)
        rows["hs_dtype"].append(storage_dtype)
    offsets = np.zeros(len(states) + 1, dtype=np.int64)
    np.cumsum([x.nbytes for x in states], out=offsets[1:])
    data = (scratch or BlockScratch()).buffer("states", int(offsets[-1]))
    flat = np.frombuffer(data, dtype=np.uint8, count=int(offsets[-1]))
    for k, x in enumerate(states):
        flat[offsets[k]:offsets[k + 1]] = x.reshape(-1).view(np.uint8)
    rows["hidden_states"] = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(states), [None, pa.py_buffer(offsets), data.slice(0, int(offsets[-1]))])
    return pa.table({k: rows[k] for k in BLOCK_SCHEMA.names}, schema=BLOCK_SCHEMA)


class BlockScratch:
    """The buffers a block writer reuses from one block to the next: the states column's bytes
    (:func:`build_block`) and the block file's bytes (:func:`write_block`).

    Why: a unit's block is hundreds of MB at real state shapes (8,192 tokens x 32 KiB = 268 MB at Llama-3.1-8B in
    bf16), and a fresh buffer of that size is fresh pages the kernel must fault in and zero on every block; the
    Parquet bytes also grew by doubling (each growth a copy) and were then copied once more into a ``bytes``.
    Reused, the writer's CPU per GB falls (``benchmarks/data_plane.py``, docs/results.md); the price is that a
    writer keeps about twice its largest unit's block in memory between blocks.

    One block at a time: :meth:`hold` lends the buffers to one caller; a second caller meanwhile (a replica
    serving two requests at once) gets fresh buffers instead of waiting.
    """

    #: A buffer that must grow grows to this many times the size asked for, so units of varying size settle.
    GROWTH = 1.25

    def __init__(self):
        import threading

        self._buffers: dict[str, pa.ResizableBuffer] = {}
        self._lock = threading.Lock()

    def buffer(self, name: str, nbytes: int) -> pa.Buffer:
        """A mutable buffer of at least ``nbytes`` bytes (its contents undefined), reused under ``name``."""
        buf = self._buffers.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._buffers[name] = pa.allocate_buffer(max(int(nbytes * self.GROWTH), 1), resizable=True)
        return buf

    def hold(self):
        """Context manager: this scratch while no other caller holds it, else a fresh one."""
        import contextlib

        @contextlib.contextmanager
        def _held():
            if self._lock.acquire(blocking=False):
                try:
                    yield self
                finally:
                    self._lock.release()
            else:
                yield BlockScratch()

        return _held()


#: Parquet options of a block: no dictionary and no min/max statistics on the list and binary columns, which
#: nothing reads and which cost more CPU than the compression itself at real state shapes (the states column's
#: dictionary attempt hashes every value; its statistics compare them; benchmarks/data_plane.py). Readers are
#: unaffected: the encodings are Parquet's plain ones.
BLOCK_PARQUET_OPTIONS = {"use_dictionary": ["sample_id", "hs_dtype"],
                         "write_statistics": ["sample_id", "seq_len", "num_layers", "hidden_size", "hs_dtype"]}


def write_block(fs, path: str, table: pa.Table, compression: str, scratch: BlockScratch | None = None) -> dict:
    """Write a block atomically; returns its manifest entry fields (bytes, sha256, rows, tokens). With
    ``scratch``, the file's bytes are built in its reused buffer (:class:`BlockScratch`)."""
    data = storage.parquet_view(table, compression, (scratch or BlockScratch()).buffer(
        "file", storage.parquet_size_bound(table)), **BLOCK_PARQUET_OPTIONS)
    digest = _Sha256InBackground(data)  # hashing (no GIL) overlaps the write and its fsync wait
    storage.write_bytes_atomic(fs, path, data)
    return {"bytes": len(data), "sha256": digest.hexdigest(), "rows": table.num_rows,
            "tokens": int(pa.compute.sum(table["seq_len"]).as_py() or 0)}


class _Sha256InBackground:
    """sha256 of ``data`` computed in a thread (hashlib releases the GIL), read with :meth:`hexdigest`: a block's
    checksum costs about as much CPU as its write (~0.5-0.7 CPU s per GB here, ``benchmarks/data_plane.py``), and
    the write mostly waits (page cache copy, fsync), so the two overlap instead of adding up."""

    def __init__(self, data):
        import threading

        self._hex: str | None = None
        self._thread = threading.Thread(target=self._run, args=(data,), daemon=True, name="block-sha256")
        self._thread.start()

    def _run(self, data) -> None:
        self._hex = hashlib.sha256(data).hexdigest()

    def hexdigest(self) -> str:
        self._thread.join()
        assert self._hex is not None, "the sha256 thread failed"
        return self._hex


def write_unit_block(fs, hs_root: str, samples: list[dict], results: list[dict], storage_dtype: str,
                     compression: str, scratch: BlockScratch | None = None) -> dict:
    """Build and write one unit's block under ``<hs_root>/blocks/`` (a fresh uuid name, not yet committed).

    Used where the block is written: the Ray Data writer actor (``extract.block_writer: data_actor``) or the
    verifier replica itself (``replica``), each passing its own ``scratch`` (:class:`BlockScratch`) so that a
    block's buffers are reused for the next. Returns the manifest entry fields (path relative to ``hs_root``, rows,
    tokens, bytes, sha256) plus ``sample_ids`` (block order).

    Raises:
        ValueError: a result paired with the wrong sample (:func:`build_block`).
    """
    import uuid

    with (scratch or BlockScratch()).hold() as held:
        table = build_block(samples, results, storage_dtype, held)
        rel = f"blocks/part-{uuid.uuid4().hex}.parquet"
        entry = write_block(fs, f"{hs_root}/{rel}", table, compression, held)
        del table  # it points into held's buffer: gone before the next block may refill it
    return {"path": rel, **entry, "sample_ids": [s["sample_id"] for s in samples]}


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
    """Sample ids of every committed block: from the entries' ``sample_ids``, or for entries written before they
    were recorded, from the block itself (only its ``sample_id`` column is read)."""
    ids: list[str] = []
    for b in manifest["blocks"]:
        if "sample_ids" in b:
            ids.extend(b["sample_ids"])
            continue
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


def _apply(data: dict, rec: dict) -> None:
    """Fold one commit record ({"entry", "rejected_extract"}) into a manifest dict."""
    e = rec["entry"]
    data["blocks"].append(e)
    c = data["counts"]
    c["samples"] += e["rows"]
    c["tokens"] += e["tokens"]
    c["bytes"] += e["bytes"]
    data.setdefault("rejected", {})["extract"] = rec["rejected_extract"]


def _seq(name: str) -> int:
    return int(name.rsplit("/", 1)[-1].split(".", 1)[0])


def _load(fs, hs_root: str) -> tuple[dict | None, list[str], int]:
    """(the snapshot with the newer commit files folded in, those files' paths, the last commit's seq).

    A commit file at or below the snapshot's ``commit_log.folded_through`` is already in the snapshot (its
    deletion after a rewrite was interrupted) and is skipped."""
    data = storage.read_json(fs, f"{hs_root}/manifest.json")
    if data is None:
        return None, [], 0
    seen = int(data.get("commit_log", {}).get("folded_through", 0))
    last = seen
    try:
        files = sorted(f for f in fs.ls(f"{hs_root}/{COMMITS_DIR}", detail=False) if f.endswith(".json"))
    except FileNotFoundError:
        files = []
    newer = [f for f in files if _seq(f) > seen]
    # read concurrently (a resume of 10,000 blocks had 1,808 to read on an object store, benchmarks/data_plane.py);
    # only a file gone meanwhile (swept by a rewrite) is skipped, any other error is raised
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=16) as pool:
        records = list(pool.map(lambda f: storage.read_json(fs, f), newer))
    pending = []
    for f, rec in zip(newer, records):
        if rec is None:
            continue
        _apply(data, rec)
        pending.append(f)
        last = max(last, _seq(f))
    return data, pending, last


def read_committed(fs, hs_root: str) -> tuple[dict, list[str]]:
    """The manifest (commit log folded in) and the storage paths of its committed blocks (what readers may use).

    Raises:
        FileNotFoundError: no manifest (extraction never committed anything).
    """
    man, _, _ = _load(fs, hs_root)
    if man is None:
        raise FileNotFoundError(f"{hs_root}/manifest.json not found: run `eagle3ray extract` first")
    return man, [f"{hs_root}/{b['path']}" for b in man["blocks"]]


class ManifestConflict(RuntimeError):
    """Another writer changed the manifest since this one read it (a second writer on the run that got past the
    writer lease, e.g. one that deleted the lease by hand); nothing of this writer's last write was applied."""


class Manifest:
    """The manifest of one run's hidden states (``<hidden_states>/manifest.json``) and its commit rules.

    - :meth:`commit` adds one written block: exactly once per sample (a block that repeats a committed
      sample, e.g. from a retried unit whose first attempt was committed, is deleted and its repeated ids
      returned), counts updated, one commit file written (O(1); the snapshot is rewritten when the log is as
      long as it);
    - :meth:`remove_orphans` deletes block files the manifest does not list (interrupted writes);
    - :meth:`finish` writes the loss-masked token frequencies and marks the manifest complete.

    Readers trust only what the manifest lists (:func:`read_committed`).
    """

    def __init__(self, fs, hs_root: str, data: dict, pending: list[str] | None = None, seq: int = 0):
        self.fs, self.root, self.data = fs, hs_root, data
        self._ids: set[str] | None = None
        self._pending = list(pending or [])  # commit files newer than the snapshot on storage
        self._seq = max(seq, int(data.get("commit_log", {}).get("folded_through", 0)))
        self._snapshot_blocks = len(data["blocks"]) - len(self._pending)
        self._version = int(data.get("version", 0))  # of the snapshot read (0: none stored yet, or before versions)

    @classmethod
    def open(cls, fs, hs_root: str, fresh: dict, where: str) -> "Manifest":
        """The stored manifest when there is one (commit log folded in; checked against ``fresh`` with
        :func:`check_compatible`), else ``fresh`` (not yet written). An unfinished one, about to be resumed, has
        the blocks committed since its last snapshot (the ones an interrupted run wrote last) and any entry without
        recorded sample ids (read next) checked by size; :meth:`finish` checks every block before reading them.

        Raises:
            ManifestMismatch: the stored blocks were made with other settings.
            CorruptBlocks: a committed block of an unfinished manifest is missing or has another size.
        """
        existing, pending, seq = _load(fs, hs_root)
        if existing is None:
            return cls(fs, hs_root, fresh)
        check_compatible(existing, fresh, where)
        man = cls(fs, hs_root, existing, pending, seq)
        if not man.complete:
            entries, n = man.data["blocks"], man._snapshot_blocks
            recent = entries[n:] + [b for b in entries[:n] if "sample_ids" not in b]
            problems = man.verify(sha256=False, entries=recent)
            if problems:
                raise CorruptBlocks(where, problems)
        return man

    @property
    def path(self) -> str:
        return f"{self.root}/manifest.json"

    @property
    def complete(self) -> bool:
        return bool(self.data.get("complete"))

    @property
    def counts(self) -> dict:
        return self.data["counts"]

    def save(self) -> None:
        """Rewrite the snapshot (every commit so far folded in), then delete the commit files it now holds.

        Conditional on the version read: the stored snapshot's ``version`` must still be the one this writer
        read (or there must be none, for a fresh manifest); each rewrite increments it. The check and the write
        are two storage calls, so this catches a second writer, not a race inside one round trip (the writer
        lease, :mod:`eagle3ray.lease`, keeps a second writer out in the first place).

        Raises:
            ManifestConflict: another writer rewrote the snapshot since it was read.
        """
        stored = storage.read_json(self.fs, self.path)
        have = 0 if stored is None else int(stored.get("version", 0))
        if have != self._version:
            raise ManifestConflict(
                f"{self.path}: another writer changed this manifest (version {have}, this writer read "
                f"{self._version}); two writers on one run would lose each other's blocks. Stop the other writer "
                f"(its lease: writer.lease in the run folder) and run again.")
        self._version += 1
        self.data["version"] = self._version
        self.data["commit_log"] = {"dir": COMMITS_DIR, "folded_through": self._seq}
        storage.write_json_atomic(self.fs, self.path, self.data)
        try:  # every commit file up to the watermark, including any an interrupted rewrite left behind
            old = [f for f in self.fs.ls(f"{self.root}/{COMMITS_DIR}", detail=False)
                   if f.endswith(".json") and _seq(f) <= self._seq]
        except FileNotFoundError:
            old = []
        for f in old:
            try:
                self.fs.rm(f)
            except FileNotFoundError:
                pass
        self._pending = []
        self._snapshot_blocks = len(self.data["blocks"])

    def committed_ids(self) -> set[str]:
        """Sample ids of the committed blocks (from the entries' ``sample_ids``; blocks are read only for entries
        written before those were recorded), then kept up to date by commits."""
        if self._ids is None:
            self._ids = set(committed_sample_ids(self.fs, self.root, self.data))
        return self._ids

    def remove_orphans(self) -> int:
        """Delete the files under ``blocks/`` that the manifest does not list, and temp files a killed writer left
        in the manifest's folders (:func:`eagle3ray.storage.remove_temp_files`); returns how many."""
        committed = {b["path"] for b in self.data["blocks"]}
        temps = sum(len(storage.remove_temp_files(self.fs, d)) for d in (self.root, f"{self.root}/{COMMITS_DIR}"))
        self.fs.invalidate_cache(f"{self.root}/blocks")  # s3fs caches listings: blocks replicas wrote since
        try:
            files = self.fs.ls(f"{self.root}/blocks", detail=False)
        except FileNotFoundError:
            return temps
        removed = temps
        for f in files:
            rel = "blocks/" + f.rstrip("/").rsplit("/", 1)[-1]
            if rel not in committed:
                self.fs.rm(f)
                removed += 1
        return removed

    def verify(self, sha256: bool = True, threads: int = 8, entries: list[dict] | None = None) -> dict[str, str]:
        """``{path: problem}`` for every committed block (or only ``entries``) that :func:`verify_block` finds wrong
        (``threads`` blocks are checked at once; object stores serve them in parallel)."""
        from concurrent.futures import ThreadPoolExecutor

        entries = list(self.data["blocks"] if entries is None else entries)
        self.fs.invalidate_cache(f"{self.root}/blocks")  # s3fs answers sizes from cached listings otherwise
        if not sha256 and len(entries) > 16:
            return self._sizes_from_listing(entries)
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            found = pool.map(lambda e: verify_block(self.fs, self.root, e, sha256), entries)
            return {e["path"]: why for e, why in zip(entries, found) if why is not None}

    def _sizes_from_listing(self, entries: list[dict]) -> dict[str, str]:
        """:meth:`verify` without sha256 from one listing of ``blocks/`` (a few LIST calls on an object store, where a
        size check per block is one HEAD each: a resume of 10,000 blocks, benchmarks/data_plane.py)."""
        try:  # verify() has refreshed the cached listing
            listed = self.fs.ls(f"{self.root}/blocks", detail=True)
        except FileNotFoundError:
            listed = []
        sizes = {"blocks/" + d["name"].rstrip("/").rsplit("/", 1)[-1]: d.get("size") for d in listed}
        out = {}
        for e in entries:
            size = sizes.get(e["path"])
            if size is None:
                out[e["path"]] = "missing"
            elif size != e["bytes"]:
                out[e["path"]] = f"{size} bytes, the manifest says {e['bytes']} (truncated or rewritten)"
        return out

    def drop(self, paths: list[str]) -> int:
        """Remove these blocks from the manifest (their files become orphans, deleted when extraction resumes):
        counts shrink, the manifest is marked incomplete so that ``extract`` extracts their samples again and
        recomputes the token frequencies. Saves; returns the samples dropped."""
        gone = set(paths)
        keep, dropped = [], 0
        c = self.data["counts"]
        for b in self.data["blocks"]:
            if b["path"] in gone:
                dropped += b["rows"]
                c["samples"] -= b["rows"]
                c["tokens"] -= b["tokens"]
                c["bytes"] -= b["bytes"]
            else:
                keep.append(b)
        self.data["blocks"] = keep
        self.data["complete"] = False
        self.data.pop("completed_at", None)
        self.data["dropped_blocks"] = self.data.get("dropped_blocks", 0) + len(gone)
        self._ids = None
        self.save()
        return dropped

    def set_rejected(self, prepare: dict, extract: dict) -> None:
        """Record the rejected samples (``RejectCounter.to_json()`` of prepare and of extract) and save."""
        self.data["rejected"] = {"prepare": prepare, "extract": extract}
        self.save()

    def commit(self, entry: dict, sample_ids: list[str], rejected_extract: dict) -> list[str]:
        """Commit a written block (``entry``: :data:`ENTRY_FIELDS`; ``sample_ids``: the ids its writer wrote).

        Returns the ids already committed by another block: then nothing is committed and the block file is
        deleted. Otherwise the entry is appended, the counts grow, ``rejected.extract`` is set and the manifest
        is saved.
        """
        ids = self.committed_ids()
        dup = [i for i in sample_ids if i in ids]
        if dup:
            self.fs.rm(f"{self.root}/{entry['path']}")
            return dup
        ids.update(sample_ids)
        rec = {"entry": {**{k: entry[k] for k in ENTRY_FIELDS}, "sample_ids": list(sample_ids)},
               "rejected_extract": rejected_extract}
        self._seq += 1
        path = f"{self.root}/{COMMITS_DIR}/{self._seq:012d}.json"
        if not storage.create_exclusive(self.fs, path, json.dumps(rec).encode()):  # the commit point
            self._seq -= 1
            raise ManifestConflict(f"{path}: another writer committed block {self._seq + 1} of this manifest "
                                   "since it was read; this block was not committed. Stop the other writer (its "
                                   "lease: writer.lease in the run folder) and run again.")
        _apply(self.data, rec)
        self._pending.append(path)
        if len(self._pending) >= max(COMPACT_MIN, self._snapshot_blocks):
            self.save()
        return []

    def finish(self, vocab_size: int, rejected_extract: dict, retries: int) -> np.ndarray:
        """Write ``token_freq.safetensors`` (loss-masked counts [vocab_size] int64 over the committed blocks), add
        ``retries`` unit retries, mark the manifest complete and save (the commit log folded into the snapshot).
        Returns the counts.

        Raises:
            CorruptBlocks: a committed block is missing or has another size than its entry.
        """
        from safetensors.numpy import save as st_save

        problems = self.verify(sha256=False)  # every block is read next: name a missing one instead of failing on it
        if problems:
            raise CorruptBlocks(self.path, problems)
        freq = token_frequencies(self.fs, self.root, self.data, vocab_size)
        storage.write_bytes_atomic(self.fs, f"{self.root}/token_freq.safetensors", st_save({"counts": freq}))
        self.data["counts"]["loss_tokens"] = int(freq.sum())
        self.data["token_freq"] = "token_freq.safetensors"
        self.data["rejected"]["extract"] = rejected_extract
        self.data["retries"] = self.data.get("retries", 0) + retries
        self.data["complete"] = True
        self.data["completed_at"] = time.time()
        self.save()
        return freq
