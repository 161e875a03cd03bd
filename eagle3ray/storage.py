"""Run layout and object storage (fsspec), with atomic commits.

Layout under one root URI (DESIGN.md, a versioned contract)::

    <root>/<run>/config.resolved.yaml
    <root>/<run>/conversations/{conversations.parquet, manifest.json}
    <root>/<run>/hidden_states/{blocks/part-*.parquet, manifest.json, commits/*.json, token_freq.safetensors}
    <root>/<run>/{vocab,checkpoints,export,reports}/

Commit rule: a file is written completely under its final name only after its content exists
(local: write ``name.tmp-<uuid>`` then rename; S3/GCS: one PUT, which readers see whole or not at
all); a manifest lists what is committed, and readers trust only the manifest.

Credentials are never read from configs or logged: s3fs takes them from the environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, instance roles, ...).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

log = logging.getLogger(__name__)


def normalize_root(uri: str) -> str:
    """Make ``file://`` and bare paths absolute (relative to the working directory); keep others."""
    if "://" not in uri:
        return "file://" + os.path.abspath(os.path.expanduser(uri))
    scheme, rest = uri.split("://", 1)
    if scheme == "file":
        return "file://" + os.path.abspath(os.path.expanduser(rest))
    return uri.rstrip("/")


def storage_options(cfg) -> dict:
    """fsspec options for URIs under ``cfg.run.storage`` (the S3-compatible ``run.endpoint_url``; no credentials:
    s3fs reads them from the environment)."""
    if cfg.run.endpoint_url and normalize_root(cfg.run.storage).startswith("s3://"):
        return {"endpoint_url": cfg.run.endpoint_url}
    return {}


def filesystem(uri: str, endpoint_url: str | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(fs, path)`` for a URI; ``endpoint_url`` selects an S3-compatible endpoint."""
    uri = normalize_root(uri)
    options: dict[str, Any] = {}
    if uri.startswith("s3://") and endpoint_url:
        options["endpoint_url"] = endpoint_url
    fs, path = fsspec.core.url_to_fs(uri, **options)
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _fsync_dir(folder: str) -> None:
    """fsync a directory, so that a rename or link in it is durable (POSIX; a no-op where not supported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _publish_local(path: str, data: bytes | memoryview, publish) -> bool:
    """Write ``data`` to an fsynced temp file beside ``path``, then ``publish(tmp, path)`` it (``os.replace``, or
    ``os.link`` for an exclusive create); the temp file never outlives the call, also when the write fails (ENOSPC).
    Returns False when ``publish`` found ``path`` existing (``FileExistsError``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
        _fsync_dir(os.path.dirname(path))  # the rename itself survives a power loss
        return True
    except FileExistsError:
        return False
    finally:
        try:
            os.remove(tmp)  # after os.replace it is gone already; after os.link, path keeps the data
        except OSError:
            pass


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or the new one, never a part.

    Local disk: a temp file beside ``path``, fsynced, then renamed over it; the temp file is removed when the write
    fails (ENOSPC), so a failed write leaves nothing. A process killed mid-write can still leave ``*.tmp-*``:
    :func:`remove_temp_files` sweeps them. Object stores: one PUT (atomic per object)."""
    if is_local(fs):
        _publish_local(path, data, os.replace)
    else:
        fs.pipe_file(path, bytes(data) if isinstance(data, memoryview) else data)


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Create ``path`` with ``data`` only if it does not exist; False (nothing written) when it does.

    Local disk: the data goes to an fsynced temp file that is hard-linked to ``path`` (``link`` fails when the
    name exists, atomically), so a reader sees no file or the whole file. Object stores: a conditional put
    (``If-None-Match: *``, s3fs ``mode="create"``; S3 since 2024, MinIO, moto). Used for the writer lease
    (:mod:`eagle3ray.lease`) and the manifest's commit files (:meth:`eagle3ray.blocks.Manifest.commit`)."""
    if is_local(fs):
        return _publish_local(path, data, os.link)
    try:
        fs.pipe_file(path, data, mode="create")
    except (FileExistsError, OSError) as e:
        if isinstance(e, FileExistsError) or "PreconditionFailed" in repr(e) or "412" in repr(e):
            return False
        raise
    return True


TEMP_NAME = re.compile(r"\.tmp-[0-9a-f]{8}$")  # :func:`_publish_local`'s temp files


def remove_temp_files(fs: fsspec.AbstractFileSystem, folder: str, *, recursive: bool = False,
                      young: tuple[str, float] | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """Delete the ``<name>.tmp-<8 hex>`` files :func:`write_bytes_atomic` / :func:`create_exclusive` left in
    ``folder`` (a process killed mid-write; local disk only: object stores have no temp files); returns them.

    Call it only while holding the run's writer lease (no other writer's temp file is live). ``young`` =
    (file name, seconds) spares temp files of that name younger than that: another process's attempt to take the
    lease (its ``writer.lease.tmp-*`` lives for milliseconds) is the one write the lease does not exclude."""
    if not is_local(fs) or not os.path.isdir(folder):
        return []
    if recursive:
        found = []
        for d, subdirs, names in os.walk(folder):
            subdirs[:] = [s for s in subdirs if s not in skip]  # ``skip``: folder names not walked into
            found += [os.path.join(d, n) for n in names if TEMP_NAME.search(n)]
    else:
        found = [os.path.join(folder, n) for n in os.listdir(folder) if TEMP_NAME.search(n)]
    now, removed = time.time(), []
    for f in found:
        try:
            if young and TEMP_NAME.sub("", os.path.basename(f)) == young[0] and now - os.lstat(f).st_mtime < young[1]:
                continue
            os.remove(f)
            removed.append(f)
        except FileNotFoundError:
            pass
        except OSError as e:  # another user's file, a read-only mount: left, named
            log.warning("could not remove temp file %s (%s)", f, e)
    return removed


MOVE_MARKER = ".moving-to.json"


def move_aside(fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
    """Move the folder ``src`` to ``dst`` (a superseded run folder), so that an interrupted move is never taken
    for a folder to use.

    Local disk: one rename (atomic). Object stores have no rename: ``fs.mv`` copies, then deletes object by
    object, and a move cut short leaves ``src`` with an arbitrary part of its files (a checkpoints folder without
    its ``settings.json``, whose Ray Train checkpoints the next training would resume under new settings: review
    row 8). So a marker ``src/.moving-to.json`` naming ``dst`` is written first and deleted last, and
    :func:`finish_move` completes a move whose marker it finds.
    """
    if is_local(fs):
        fs.mv(src, dst, recursive=True)
        return
    write_json_atomic(fs, f"{src}/{MOVE_MARKER}", {"to": dst})
    _copy_then_delete(fs, src, dst)


def finish_move(fs: fsspec.AbstractFileSystem, src: str) -> str | None:
    """Complete a :func:`move_aside` of ``src`` that was cut short (its marker is there); returns the folder it
    went to, or None when there was none. Copying again is safe: the files still in ``src`` are whole."""
    marker = read_json(fs, f"{src}/{MOVE_MARKER}") if not is_local(fs) else None
    if not marker:
        return None
    _copy_then_delete(fs, src, marker["to"])
    return marker["to"]


def _copy_then_delete(fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
    marker = f"{src}/{MOVE_MARKER}"
    files = [f for f in fs.find(src) if f != marker]
    for f in files:
        fs.copy(f, dst + f[len(src):])
    if files:
        fs.rm(files)
    fs.rm_file(marker)  # last: until now the folder reads as a move in progress


def append_line(fs: fsspec.AbstractFileSystem, path: str, line: str) -> None:
    """Append ``line`` and a newline to a text file (created when missing).

    Local files are opened for append and fsynced, so the cost does not grow with the file. Object stores have
    no append: the object is read and written again whole (one PUT, readers see the old or the new object).
    A reader should ignore a last line without its newline (a local append cut short by a crash).
    """
    data = (line + "\n").encode()
    if is_local(fs):
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return
    old = b""
    if fs.exists(path):
        with fs.open(path, "rb") as f:
            old = f.read()
    fs.pipe_file(path, old + data)


def write_json_atomic(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    write_bytes_atomic(fs, path, json.dumps(obj, indent=1, sort_keys=False).encode())


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any | None:
    """Parsed JSON at ``path``, or None when it does not exist.

    Raises:
        json.JSONDecodeError: the file is not JSON; its message starts with ``path`` (a corrupt manifest, say).
    """
    try:
        with fs.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise json.JSONDecodeError(f"{path}: not valid JSON (corrupt or cut short?): {e.msg}", e.doc, e.pos) from None


def parquet_bytes(table: pa.Table, compression: str = "zstd", **options) -> bytes:
    """A Parquet file's bytes for ``table`` (``compression``: zstd, snappy or none; ``options``: more
    ``pyarrow.parquet.write_table`` arguments)."""
    return bytes(parquet_view(table, compression, **options))


def parquet_size_bound(table: pa.Table) -> int:
    """An upper bound (bytes) of ``table``'s Parquet file in any of our compressions: its Arrow bytes, plus 1% for
    a codec that cannot shrink the data (zstd then stores raw blocks, 3 bytes per 128 KiB) and page headers, plus
    1 MiB for the footer and the levels of list columns."""
    return int(table.nbytes * 1.01) + (1 << 20)


def parquet_view(table: pa.Table, compression: str = "zstd", into: pa.Buffer | None = None,
                 **options) -> memoryview:
    """:func:`parquet_bytes` without the copies: a memoryview of the file's bytes, written into ``into`` (a mutable
    buffer, e.g. :meth:`eagle3ray.blocks.BlockScratch.buffer`; the view is valid until ``into`` is reused) or,
    without it or when the file outgrows it, into a fresh Arrow buffer."""
    codec = None if compression == "none" else compression
    if into is not None:
        sink = pa.FixedSizeBufferWriter(into)
        try:
            pq.write_table(table, sink, compression=codec, **options)
            return memoryview(into)[:sink.tell()]
        except OSError as e:  # "Write out of bounds": the bound was too small; write it the growing way
            if "out of bounds" not in str(e):
                raise
        finally:
            sink.close()
    out = pa.BufferOutputStream()
    pq.write_table(table, out, compression=codec, **options)
    return memoryview(out.getvalue())


def arrow_filesystem(fs: fsspec.AbstractFileSystem) -> pafs.FileSystem:
    """A pyarrow filesystem over an fsspec one (for Ray Data readers)."""
    if is_local(fs):
        return pafs.LocalFileSystem()
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


@dataclass(frozen=True)
class RunPaths:
    """Paths of one run (strings without scheme, valid for ``fs``)."""

    fs: fsspec.AbstractFileSystem
    root: str  # <root>/<run>
    uri: str  # the same with its scheme, for messages

    @classmethod
    def create(cls, storage: str, run_name: str, endpoint_url: str | None = None) -> "RunPaths":
        fs, base = filesystem(storage, endpoint_url)
        root = f"{base.rstrip('/')}/{run_name}"
        scheme = normalize_root(storage).split("://", 1)[0]
        return cls(fs=fs, root=root, uri=f"{scheme}://{root}")

    def sub(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @property
    def conversations(self) -> str:
        return self.sub("conversations")

    @property
    def hidden_states(self) -> str:
        return self.sub("hidden_states")


def run_paths(cfg) -> RunPaths:
    """RunPaths for a :class:`eagle3ray.config.Config`."""
    return RunPaths.create(cfg.run.storage, cfg.run.name, cfg.run.endpoint_url)


def write_resolved_config(cfg, paths: RunPaths) -> None:
    write_bytes_atomic(paths.fs, paths.sub("config.resolved.yaml"), cfg.to_yaml().encode())
