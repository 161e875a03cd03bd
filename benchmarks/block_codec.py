"""Benchmark: what a hidden-state block costs on storage per token, by storage dtype and encoding, and what
float8_e4m3 loses against the bfloat16 states.

Reads the first ``--blocks`` committed blocks of a run's ``hidden_states/`` folder (read only; only blocks the
manifest lists), decodes them with the product's reader (:func:`eagle3ray.blocks.decode_states`) and encodes the
same states again with the product's codec (``blocks.to_storage_bytes`` -> ``blocks.build_block`` ->
``storage.parquet_bytes``, what the extract stage writes) in every ``extract.storage_dtype``. Per dtype x encoding it
prints:

- ``B/token``: bytes of the whole block file per token (input ids, loss mask and Parquet overhead included);
  ``x bf16``: over the raw bfloat16 states (L x H x 2 bytes per token, 4608 for SmolLM2-135M's 4 x 576);
  ``x raw``: over the dtype's own uncompressed payload (:func:`eagle3ray.blocks.bytes_per_token`), the ratio
  ``eagle3ray check`` multiplies by for its storage estimate;
- ``enc s/GB``: states -> block file bytes (to_storage_bytes of every row, build_block, Parquet write);
  ``dec s/GB``: block file bytes -> float32 [T, L, H] per row (read_table, to_pylist, decode_states: the trainer's
  path); both in wall and CPU seconds (this process, all its threads: robust on a shared machine) per GB of
  states at bfloat16 (T x L x H x 2 bytes), medians over ``--rounds`` rounds after one warm-up round, with
  ``--threads`` torch and pyarrow threads (1: the cost per core).

Encodings: ``none``, ``snappy``, ``zstd`` are ``extract.compression``. Two experiments that are not the block
format: ``zstd+bss``, the states as a list<fixed_size_binary(value width)> column (and fp8 scales as a
list<float32> column) with Parquet's BYTE_STREAM_SPLIT encoding before zstd, one page per column chunk
(``max_rows_per_page``; pyarrow's default of 20,000 values per page puts both byte streams of a page into one zstd
block, which undoes the split); ``zstd+split``, the same byte planes (byte k of every value together) inside the
block's own binary column. For one-byte float8_e4m3 values a split changes nothing but the scales.

Then the float8_e4m3 error per layer against the stored bfloat16 states: ``|err|/amax`` per element over the
token's amax in that layer (the unit of its scale) and the relative L2 error per (token, layer)
``||x8 - x|| / ||x||``, mean and max over the tokens.

    .venv/bin/python benchmarks/block_codec.py --hs runs/smollm2-135m-cpu/hidden_states --blocks 3 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3ray import blocks, storage

ENCODINGS = ("none", "snappy", "zstd", "zstd+bss", "zstd+split")
#: One page per column chunk for the BYTE_STREAM_SPLIT experiment (see the module docstring).
_ONE_PAGE = dict(max_rows_per_page=1 << 30, data_page_size=1 << 30, write_batch_size=1 << 20)


def machine() -> str:
    """``lscpu``'s model name, whether the CPU has AMX-BF16, the CPUs this process may use, library versions."""
    import torch

    from eagle3ray.machine import cpu_bf16_is_fast

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except (OSError, subprocess.SubprocessError):
        model = "?"
    return (f"machine: lscpu model name {model!r}, amx_bf16 {'yes' if cpu_bf16_is_fast() else 'no'}, "
            f"{len(os.sched_getaffinity(0))} CPUs; pyarrow {pa.__version__}, torch {torch.__version__}")


def _planes(payload: bytes, storage_dtype: str, n_values: int) -> bytes:
    """The payload with each value's byte k gathered into plane k (fp8: values unchanged, the scales split)."""
    w = blocks.VALUE_BYTES[storage_dtype]
    v = np.frombuffer(payload, np.uint8, count=n_values * w).reshape(-1, w).T.tobytes()
    rest = np.frombuffer(payload, np.uint8, offset=n_values * w)
    return v + (rest.reshape(-1, 4).T.tobytes() if rest.size else b"")


def _unplanes(buf: bytes, storage_dtype: str, n_values: int) -> bytes:
    w = blocks.VALUE_BYTES[storage_dtype]
    v = np.frombuffer(buf, np.uint8, count=n_values * w).reshape(w, -1).T.tobytes()
    rest = np.frombuffer(buf, np.uint8, offset=n_values * w)
    return v + (rest.reshape(4, -1).T.tobytes() if rest.size else b"")


def _bss_table(table: pa.Table, storage_dtype: str) -> pa.Table:
    """The block with ``hidden_states`` as list<fixed_size_binary(w)> (+ ``hs_scale`` list<float32> for fp8)."""
    w = blocks.VALUE_BYTES[storage_dtype]
    vals, scales, offs = [], [], [0]
    for b, T, L, H in zip(table["hidden_states"].to_pylist(), table["seq_len"].to_pylist(),
                          table["num_layers"].to_pylist(), table["hidden_size"].to_pylist()):
        n = T * L * H
        vals.append(b[:n * w])
        scales.append(np.frombuffer(b, "<f4", offset=n * w))  # fp8 only; empty otherwise
        offs.append(offs[-1] + n)
    flat = pa.FixedSizeBinaryArray.from_buffers(pa.binary(w), offs[-1], [None, pa.py_buffer(b"".join(vals))])
    t = table.drop_columns(["hidden_states"]).append_column(
        "hidden_states", pa.ListArray.from_arrays(pa.array(offs, pa.int32()), flat))
    if storage_dtype == "float8_e4m3":
        soffs = np.cumsum([0] + [len(s) for s in scales]).astype(np.int32)
        t = t.append_column("hs_scale", pa.ListArray.from_arrays(pa.array(soffs), pa.array(np.concatenate(scales))))
    return t


def _bss_rows(table: pa.Table, storage_dtype: str) -> list[bytes]:
    """Each row's payload bytes back from the :func:`_bss_table` columns."""
    w = blocks.VALUE_BYTES[storage_dtype]
    col = table["hidden_states"].combine_chunks()
    off, v = col.offsets.to_numpy(), col.values
    flat = np.frombuffer(v.buffers()[1], np.uint8)[v.offset * w:(v.offset + len(v)) * w]
    out = [flat[off[i] * w:off[i + 1] * w].tobytes() for i in range(len(col))]
    if storage_dtype == "float8_e4m3":
        scales = table["hs_scale"].to_numpy(zero_copy_only=False)
        out = [b + np.asarray(s, "<f4").tobytes() for b, s in zip(out, scales)]
    return out


def encode(states: list, samples: list[dict], storage_dtype: str, encoding: str) -> bytes:
    """Block file bytes of these states [T, L, H] (torch float32) in ``storage_dtype`` with ``encoding``."""
    results = [{"sample_id": s["sample_id"], "hidden_states": blocks.to_storage_bytes(st, storage_dtype),
                "shape": tuple(st.shape)} for s, st in zip(samples, states)]
    if encoding == "zstd+split":
        for r in results:
            r["hidden_states"] = _planes(r["hidden_states"], storage_dtype, int(np.prod(r["shape"])))
    table = blocks.build_block(samples, results, storage_dtype)
    if encoding == "zstd+bss":
        cols = ["hidden_states"] + (["hs_scale"] if storage_dtype == "float8_e4m3" else [])
        sink = pa.BufferOutputStream()
        pq.write_table(_bss_table(table, storage_dtype), sink, compression="zstd", use_dictionary=False,
                       column_encoding={f"{c}.list.element": "BYTE_STREAM_SPLIT" for c in cols}, **_ONE_PAGE)
        return sink.getvalue().to_pybytes()
    return storage.parquet_bytes(table, "zstd" if encoding == "zstd+split" else encoding,
                                 **blocks.BLOCK_PARQUET_OPTIONS)


def decode(buf: bytes, storage_dtype: str, encoding: str) -> list[np.ndarray]:
    """float32 [T, L, H] of every row of a block file made by :func:`encode`."""
    table = pq.read_table(pa.BufferReader(buf))
    if encoding == "zstd+bss":
        payloads = _bss_rows(table, storage_dtype)
        rows = table.drop_columns([c for c in ("hidden_states", "hs_scale") if c in table.column_names]).to_pylist()
        return [blocks.decode_states({**r, "hidden_states": p}) for r, p in zip(rows, payloads)]
    rows = table.to_pylist()
    if encoding == "zstd+split":
        for r in rows:
            r["hidden_states"] = _unplanes(r["hidden_states"], storage_dtype,
                                           r["seq_len"] * r["num_layers"] * r["hidden_size"])
    return [blocks.decode_states(r) for r in rows]


def fp8_errors(states: list, layer_ids: list[int]) -> list[tuple[int, float, float, float, float]]:
    """(layer id, mean and max |err|/amax, mean and max relative L2) of float8_e4m3 against ``states``."""
    per_el, rel = [], []
    for st in states:
        x = st.numpy()  # shape: [T, L, H]
        y = blocks.from_storage_bytes(blocks.to_storage_bytes(st, "float8_e4m3"), x.shape, "float8_e4m3")
        err = np.abs(y - x)
        amax = np.abs(x).max(-1, keepdims=True)
        per_el.append((err / np.where(amax > 0, amax, 1)).transpose(1, 0, 2).reshape(x.shape[1], -1))
        norm = np.linalg.norm(x, axis=-1)
        rel.append((np.linalg.norm(y - x, axis=-1) / np.where(norm > 0, norm, 1)).T)  # shape: [L, T]
    e, r = np.concatenate(per_el, 1), np.concatenate(rel, 1)
    return [(lid, float(e[i].mean()), float(e[i].max()), float(r[i].mean()), float(r[i].max()))
            for i, lid in enumerate(layer_ids)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hs", default="runs/smollm2-135m-cpu/hidden_states",
                    help="a run's hidden_states folder (read only)")
    ap.add_argument("--blocks", type=int, default=3, help="the first N committed blocks")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default=",".join(blocks.STORAGE_DTYPES))
    ap.add_argument("--threads", type=int, default=1, help="torch and pyarrow threads (costs per core by default)")
    a = ap.parse_args()

    import fsspec
    import torch

    torch.set_num_threads(a.threads)  # on a busy 2-core machine 2 torch threads made the encode ~30x slower
    pa.set_cpu_count(a.threads)

    fs, root = fsspec.filesystem("file"), os.path.abspath(a.hs)
    man, paths = blocks.read_committed(fs, root)
    samples, states, stored = [], [], 0
    for entry, p in list(zip(man["blocks"], paths))[:a.blocks]:
        stored += entry["bytes"]
        with fs.open(p, "rb") as f:
            for row in pq.read_table(f).to_pylist():
                samples.append({k: row[k] for k in ("sample_id", "input_ids", "loss_mask")})
                states.append(torch.from_numpy(blocks.decode_states(row)))  # shape: [T, L, H]
    T = sum(st.shape[0] for st in states)
    _, L, H = states[0].shape
    raw_bf16 = blocks.bytes_per_token(L, H, "bfloat16")
    gb = T * raw_bf16 / 1e9
    print(machine())
    print(f"hidden states: {root}: {min(a.blocks, len(paths))} of {len(paths)} committed blocks, {len(samples)} "
          f"samples, {T:,} tokens, layers {man['layer_ids']} x {H}, stored {man['dtype']} ({stored / T:,.0f} B/token "
          "in the manifest)")
    print(f"raw bfloat16 {raw_bf16} B/token; times: medians of {a.rounds} rounds after a warm-up, {a.threads} "
          "thread(s), seconds per GB of states at bfloat16 (CPU: this process, all threads)", flush=True)
    print(f"{'':<32} {'':>14} {'encode s/GB':>17} {'decode s/GB':>17}")
    print(f"{'dtype':<12} {'encoding':<11} {'B/token':>8} {'x bf16':>7} {'x raw':>6} {'wall':>8} {'CPU':>8} "
          f"{'wall':>8} {'CPU':>8}")
    for dt in a.dtypes.split(","):
        ref: list = []
        for enc in ENCODINGS:
            times: list[tuple[float, float, float, float]] = []  # (enc wall, enc CPU, dec wall, dec CPU)
            for _ in range(a.rounds + 1):  # the first round warms up and is not counted
                w0, c0 = time.perf_counter(), time.process_time()
                buf = encode(states, samples, dt, enc)
                w1, c1 = time.perf_counter(), time.process_time()
                out = decode(buf, dt, enc)
                times.append((w1 - w0, c1 - c0, time.perf_counter() - w1, time.process_time() - c1))
            med = [statistics.median(t[i] for t in times[1:]) / gb for i in range(4)]
            # every encoding is lossless: it decodes as the plain one, and bf16/fp32 as the stored bf16 states
            want = [s.numpy() for s in states] if dt in ("bfloat16", "float32") else ref if enc != "none" else out
            if not all(np.array_equal(o, w, equal_nan=True) for o, w in zip(out, want)):
                what = "the stored bfloat16 states" if dt in ("bfloat16", "float32") else "the plain encoding's"
                raise SystemExit(f"{dt} {enc}: decoded states differ from {what}")
            ref = out if enc == "none" else ref
            bpt = len(buf) / T
            print(f"{dt:<12} {enc:<11} {bpt:>8,.0f} {bpt / raw_bf16:>7.3f} "
                  f"{bpt / blocks.bytes_per_token(L, H, dt):>6.3f}" + "".join(f" {m:>8.2f}" for m in med), flush=True)
    print("float8_e4m3 against the bfloat16 states, per layer (|err|/amax: per element, over the token's amax in "
          "that layer;\n  rel L2: ||x8 - x|| / ||x|| per token and layer; mean and max over the tokens)")
    print(f"{'layer id':>8} {'mean |err|/amax':>16} {'max |err|/amax':>15} {'mean rel L2':>12} {'max rel L2':>11}")
    for lid, em, ex, rm, rx in fp8_errors(states, man["layer_ids"]):
        print(f"{lid:>8} {em:>16.5f} {ex:>15.5f} {rm:>12.5f} {rx:>11.5f}")


if __name__ == "__main__":
    main()
