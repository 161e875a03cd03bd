"""float8_e4m3 hidden-state blocks: the codec's error bound, the scale guard, the size on storage, the readers, and
the other dtypes left byte for byte as they were. Pure unit tests (no engine, no Ray)."""

from __future__ import annotations

import typing

import numpy as np
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from eagle3ray import blocks, storage  # noqa: E402
from eagle3ray.config import ConfigError, ExtractSection, load_config  # noqa: E402

FP8 = "float8_e4m3"


def _states(T=64, L=4, H=576, seed=0) -> torch.Tensor:
    """[T, L, H] float32 with rows (token, layer) whose scales span 1e-3 .. 1e3, a few exact zeros and one outlier
    per row (hidden states have a few large channels)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, L, H, generator=g) * 10.0 ** torch.empty(T, L, 1).uniform_(-3, 3, generator=g)
    x[:, :, 7] *= 30  # an outlier channel sets amax
    x[::5, :, 11] = 0.0
    return x


def _fp8(x: torch.Tensor) -> tuple[bytes, np.ndarray]:
    buf = blocks.to_storage_bytes(x, FP8)
    return buf, blocks.from_storage_bytes(buf, tuple(x.shape), FP8)


def test_fp8_round_trip_stays_within_half_an_e4m3_step_of_each_rows_amax():
    x = _states()
    buf, y = _fp8(x)
    T, L, H = x.shape
    assert len(buf) == T * L * H + T * L * 4  # one byte per value + one float32 scale per (token, layer)
    assert y.dtype == np.float32 and y.shape == (T, L, H)
    xn = x.numpy()
    amax = np.abs(xn).max(-1, keepdims=True)
    err = np.abs(y - xn)
    # the coarsest e4m3 step below 448 is 32 (256..448), so rounding is off by at most 16/448 of the row's amax
    assert (err <= amax / 28 * (1 + 1e-5)).all()
    assert (err / amax).max() > 0.02  # the bound is near-tight: the test sees real fp8 rounding
    normal = np.abs(xn) >= amax / 448 * 2.0**-6  # e4m3 normals: 3 mantissa bits, at most 2^-4 relative error
    assert (err[normal] <= np.abs(xn[normal]) * 2.0**-4 * (1 + 1e-5)).all()
    assert (y[xn == 0] == 0).all() and (xn == 0).sum() > 0
    scales = np.frombuffer(buf, "<f4", offset=T * L * H).reshape(T, L)
    np.testing.assert_array_equal(scales, (x.abs().amax(-1) / 448).numpy())  # the whole e4m3 range is used
    np.testing.assert_allclose(np.abs(y).max(-1), amax[..., 0], rtol=1e-6)  # amax itself maps to 448 exactly


def test_an_all_zero_row_is_stored_with_scale_zero_and_decodes_to_zeros():
    x = _states(T=3, L=2, H=16)
    x[1, 0] = 0.0
    x[2] = 0.0
    buf, y = _fp8(x)
    scales = np.frombuffer(buf, "<f4", offset=3 * 2 * 16).reshape(3, 2)
    assert scales[1, 0] == 0 and (scales[2] == 0).all() and (scales[0] > 0).all()
    assert np.isfinite(y).all()
    assert (y[1, 0] == 0).all() and (y[2] == 0).all()
    assert (blocks.from_storage_bytes(blocks.to_storage_bytes(torch.zeros(2, 3, 8), FP8), (2, 3, 8), FP8) == 0).all()
    tiny = torch.tensor([[[3e-41, -1e-41, 2e-41]]])  # amax / 448 is a float32 subnormal: imprecise, still finite
    assert np.isfinite(_fp8(tiny)[1]).all()


def test_the_e4m3_table_decodes_every_byte_as_torch_does():
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(blocks._E4M3FN, want)  # NaN codes (0x7f, 0xff) included
    assert np.nanmax(blocks._E4M3FN) == blocks.FP8_E4M3_MAX and np.isnan(blocks._E4M3FN).sum() == 2


def test_fp8_bytes_of_another_shape_are_refused():
    buf = blocks.to_storage_bytes(torch.ones(4, 2, 8), FP8)
    with pytest.raises(ValueError, match=r"need 96 bytes \(64 values \+ 8 float32 scales\), got 95"):
        blocks.from_storage_bytes(buf[:-1], (4, 2, 8), FP8)
    with pytest.raises(ValueError, match="need 128 bytes"):
        blocks.from_storage_bytes(buf, (4, 2, 12), FP8)


def _bf16_rne(x32: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 values, round to nearest even (no NaN here), computed without torch."""
    bits = x32.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_the_older_dtypes_are_byte_for_byte_what_they_were():
    x = _states(T=16, L=4, H=32)
    x32 = x.numpy()
    assert blocks.to_storage_bytes(x, "float32") == x32.astype("<f4").tobytes()
    assert blocks.to_storage_bytes(x, "float16") == x32.astype("<f2").tobytes()
    bf = blocks.to_storage_bytes(x, "bfloat16")
    assert bf == _bf16_rne(x32).astype("<u2").tobytes()
    # decoding: bfloat16 is its upper 16 bits of float32, the others widen exactly
    up = (np.frombuffer(bf, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(x32.shape)
    np.testing.assert_array_equal(blocks.from_storage_bytes(bf, x32.shape, "bfloat16"), up)
    np.testing.assert_array_equal(blocks.from_storage_bytes(x32.tobytes(), x32.shape, "float32"), x32)
    np.testing.assert_array_equal(blocks.from_storage_bytes(x32.astype("<f2").tobytes(), x32.shape, "float16"),
                                  x32.astype(np.float16).astype(np.float32))


def _block(x: torch.Tensor, dtype: str):
    T = x.shape[0]
    samples = [{"sample_id": "s0", "input_ids": list(range(100, 100 + T)), "loss_mask": [0] * 8 + [1] * (T - 8)}]
    results = [{"sample_id": "s0", "hidden_states": blocks.to_storage_bytes(x, dtype), "shape": tuple(x.shape)}]
    return blocks.build_block(samples, results, dtype)


def test_an_fp8_block_is_half_of_bf16_on_storage_and_the_trainers_reader_decodes_it(tmp_path):
    from eagle3ray.train_worker import row_to_sample

    x = _states(T=512)
    fs, root = storage.filesystem(f"file://{tmp_path}")
    entries = {dt: blocks.write_block(fs, f"{root}/{dt}.parquet", _block(x, dt), "zstd") for dt in (FP8, "bfloat16")}
    raw_bf16 = 512 * blocks.bytes_per_token(4, 576, "bfloat16")
    assert entries[FP8]["tokens"] == 512
    assert entries[FP8]["bytes"] <= 0.53 * raw_bf16  # the target, ids, mask and Parquet overhead included
    assert entries[FP8]["bytes"] < 0.6 * entries["bfloat16"]["bytes"]
    with fs.open(f"{root}/{FP8}.parquet", "rb") as f:
        (row,) = pq.read_table(f).to_pylist()  # what the trainer's iterator does with each Ray Data batch
    assert row["hs_dtype"] == FP8
    st = blocks.decode_states(row)
    np.testing.assert_array_equal(st, _fp8(x)[1])
    s = row_to_sample(row)
    assert s["hidden_states"].dtype == torch.float32 and s["hidden_states"].shape == (511, 3 * 576)
    assert torch.equal(s["hidden_states"], torch.from_numpy(st[:-1, :3].reshape(511, -1)))
    assert torch.equal(s["verifier_last_hidden_states"], torch.from_numpy(st[1:, 3]))


def test_bytes_per_token_counts_the_fp8_scales():
    assert blocks.bytes_per_token(4, 576, "bfloat16") == 4608
    assert blocks.bytes_per_token(4, 576, "float16") == 4608
    assert blocks.bytes_per_token(4, 576, "float32") == 9216
    assert blocks.bytes_per_token(4, 576, FP8) == 4 * 576 + 4 * 4 == 2320
    T, L, H = 7, 4, 576
    assert len(blocks.to_storage_bytes(torch.randn(T, L, H), FP8)) == T * blocks.bytes_per_token(L, H, FP8)


def test_the_config_accepts_float8_e4m3_and_rejects_other_names():
    assert load_config(None, [f"extract.storage_dtype={FP8}"]).extract.storage_dtype == FP8
    for junk in ("float8", "fp8", "float8_e4m3fn", "float8_e5m2"):
        with pytest.raises(ConfigError, match="extract.storage_dtype"):
            load_config(None, [f"extract.storage_dtype={junk}"])
    # the schema and the block contract name the same dtypes
    assert typing.get_args(ExtractSection.model_fields["storage_dtype"].annotation) == blocks.STORAGE_DTYPES


def test_check_estimates_fp8_storage_from_the_raw_size_and_the_measured_ratio(tmp_path):
    from eagle3ray.preflight import GIB, STORED_RATIO, PreflightReport, _storage_estimate

    def estimate(dtype: str) -> PreflightReport:
        cfg = load_config(None, [f"run.storage=file://{tmp_path}/runs", "data.max_samples=1000",
                                 "data.tokens_per_sample_estimate=1000", f"extract.storage_dtype={dtype}",
                                 "extract.max_storage_gib=3"])
        rep = PreflightReport()
        _storage_estimate(cfg, {"hidden_size": 576}, 4, rep, online=False)
        return rep

    rep = estimate(FP8)
    s = rep.storage
    assert s["tokens"] == 1_000_000 and s["bytes_per_token"] == 2320
    assert s["bytes_per_token_from"] == "4 layers x 576 x 1 B + 4 x 4 B scales"
    assert s["gib"] == pytest.approx(2320e6 / GIB)
    assert s["est_ratio"] == STORED_RATIO[(FP8, "zstd")] and "benchmarks/block_codec.py" in s["est_ratio_from"]
    assert s["est_bytes_per_token"] == pytest.approx(2320 * s["est_ratio"])
    assert s["est_bytes_per_token"] < 0.53 * 4608
    assert s["est_gib"] == pytest.approx(s["gib"] * s["est_ratio"])
    assert rep.problems == []  # 2.16 GiB raw fits the 3 GiB limit ...
    (msg,) = estimate("bfloat16").problems  # ... which bf16's 4.29 GiB raw does not
    assert "4 layers x 576 x 2 B, before compression); the limit holds 699,050 tokens" in msg  # 3 GiB / 4608 B


def test_the_extract_summary_reports_bytes_per_token_from_the_manifest(tmp_path):
    from eagle3ray.extract import ExtractSummary

    fs, root = storage.filesystem(f"file://{tmp_path}")
    fresh = blocks.new_manifest({"config_hash": "c"}, [1, 2, 3, 4], FP8, {"sha256": "s", "samples": 0})
    man = blocks.Manifest.open(fs, f"{root}/hs", fresh, "m")
    man.set_rejected({}, {})
    for i, (tokens, nbytes) in enumerate([(1000, 1_800_000), (3000, 5_300_000)]):
        man.commit({"path": f"blocks/b{i}.parquet", "rows": 2, "tokens": tokens, "bytes": nbytes, "sha256": "h"},
                   [f"s{i}a", f"s{i}b"], {})
    s = ExtractSummary()
    s.set_totals(man)
    assert (s.total_samples, s.total_tokens, s.total_bytes) == (4, 4000, 7_100_000)
    assert s.bytes_per_token == 1775.0
    assert "4000 tokens in the manifest, 1,775 B/token on storage (float8_e4m3)" in s.headline()
    assert ("bytes/token on storage (float8_e4m3; manifest bytes / tokens)", "1,775") in s.rows()
    assert ExtractSummary().bytes_per_token == 0.0
