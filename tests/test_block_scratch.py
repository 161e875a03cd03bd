"""A block writer's reused buffers (blocks.BlockScratch) change no byte of what it writes."""

import hashlib

import numpy as np
import pyarrow.parquet as pq
import pytest

from eagle3ray import blocks, storage
from eagle3ray.verifier import StandInEngine

L, H = 4, 64


def _unit(first: int, lengths: list[int], dtype: str):
    samples = [{"sample_id": f"s{first + k}", "input_ids": list(range(first * 7 + k, first * 7 + k + n)),
                "loss_mask": [k % 2] * n} for k, n in enumerate(lengths)]
    results = [{"sample_id": s["sample_id"], "shape": (len(s["input_ids"]), L, H),
                "hidden_states": blocks.to_storage_array(StandInEngine.states_bf16(s["input_ids"], L, H), dtype)}
               for s in samples]
    return samples, results


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3", "float32"])
def test_blocks_written_through_one_scratch_are_byte_identical_to_fresh_ones(tmp_path, dtype):
    fs, _ = storage.filesystem(f"file://{tmp_path}")
    scratch = blocks.BlockScratch()
    # large, then small (stale bytes of the first stay in the buffers), then larger than both (the buffers grow)
    for first, lengths in [(0, [40, 33, 50]), (10, [5]), (20, [90, 64, 77, 81])]:
        samples, results = _unit(first, lengths, dtype)
        reused = blocks.write_unit_block(fs, str(tmp_path), samples, results, dtype, "zstd", scratch)
        fresh = blocks.write_unit_block(fs, str(tmp_path), samples, results, dtype, "zstd")
        a, b = (fs.cat_file(f"{tmp_path}/{e['path']}") for e in (reused, fresh))
        assert a == b and reused["sha256"] == fresh["sha256"] == hashlib.sha256(a).hexdigest()
        assert reused["bytes"] == len(a) and reused["tokens"] == sum(lengths)
        rows = pq.read_table(f"{tmp_path}/{reused['path']}").to_pylist()
        for s, row in zip(samples, rows, strict=True):
            want = blocks.from_storage_bytes(blocks.to_storage_bytes(
                StandInEngine.states_bf16(s["input_ids"], L, H), dtype), (len(s["input_ids"]), L, H), dtype)
            assert row["sample_id"] == s["sample_id"] and np.array_equal(blocks.decode_states(row), want)


def test_a_file_larger_than_the_buffer_is_written_the_growing_way_with_the_same_bytes():
    samples, results = _unit(0, [30, 20], "bfloat16")
    table = blocks.build_block(samples, results, "bfloat16")
    small = blocks.BlockScratch().buffer("file", 100)  # far below the file's size
    assert bytes(storage.parquet_view(table, "none", small)) == storage.parquet_bytes(table, "none")


def test_a_second_caller_while_the_scratch_is_held_gets_its_own_buffers():
    scratch = blocks.BlockScratch()
    with scratch.hold() as first:
        with scratch.hold() as second:
            assert first is scratch and second is not scratch
    with scratch.hold() as again:
        assert again is scratch
