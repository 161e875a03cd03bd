"""The manifest's commit log: O(1) commits, the same exactly-once guarantees, readers see every commit.

Synthetic entries (no engine): the rules are the manifest's, whatever wrote the blocks."""

from __future__ import annotations

import json

import pytest

from eagle3ray import blocks, storage


def _fresh():
    return blocks.new_manifest({"config_hash": "c", "hidden_size": 8, "num_hidden_layers": 4}, [1, 2, 3, 4],
                               "bfloat16", {"sha256": "s", "samples": 0})


def _entry(i: int) -> dict:
    return {"path": f"blocks/part-{i}.parquet", "rows": 2, "tokens": 10, "bytes": 100, "sha256": f"h{i}"}


def _open(tmp_path):
    fs, root = storage.filesystem(f"file://{tmp_path}")
    man = blocks.Manifest.open(fs, f"{root}/hs", _fresh(), "m")
    man.set_rejected({}, {})
    return fs, f"{root}/hs", man


def _touch_blocks(fs, root, n):
    fs.makedirs(f"{root}/blocks", exist_ok=True)
    for i in range(n):
        fs.pipe_file(f"{root}/blocks/part-{i}.parquet", b"x" * 100)


def test_a_commit_writes_one_small_file_and_leaves_the_manifest_alone(tmp_path, monkeypatch):
    fs, root, man = _open(tmp_path)
    _touch_blocks(fs, root, 10)
    before = fs.cat_file(f"{root}/manifest.json")
    for i in range(3):
        assert man.commit(_entry(i), [f"s{i}a", f"s{i}b"], {"counts": {}}) == []
    assert fs.cat_file(f"{root}/manifest.json") == before  # no rewrite per commit
    assert len(fs.ls(f"{root}/commits")) == 3
    data, files = blocks.read_committed(fs, root)  # readers fold the log in
    assert [b["path"] for b in data["blocks"]] == [_entry(i)["path"] for i in range(3)]
    assert data["counts"]["samples"] == 6 and data["counts"]["tokens"] == 30
    assert data["blocks"][1]["sample_ids"] == ["s1a", "s1b"]
    resumed = blocks.Manifest.open(fs, root, _fresh(), "m")  # a resume: every committed id, no block read
    assert resumed.committed_ids() == {f"s{i}{x}" for i in range(3) for x in "ab"}
    assert resumed.commit(_entry(9), ["s1a", "new"], {}) == ["s1a"]  # exactly once still holds
    assert not fs.exists(f"{root}/blocks/part-9.parquet")  # the duplicate block is discarded


def test_the_snapshot_is_rewritten_when_the_log_is_as_long_as_it(tmp_path, monkeypatch):
    monkeypatch.setattr(blocks, "COMPACT_MIN", 4)
    fs, root, man = _open(tmp_path)
    _touch_blocks(fs, root, 20)
    rewrites = []
    real = storage.write_json_atomic
    monkeypatch.setattr(storage, "write_json_atomic", lambda fs_, p, obj: (rewrites.append(len(obj["blocks"])),
                                                                          real(fs_, p, obj)))
    for i in range(20):
        man.commit(_entry(i), [f"s{i}"], {})
    assert rewrites == [4, 8, 16]  # doubling: O(1) amortized per commit
    assert len(fs.ls(f"{root}/commits")) == 4  # the commits since the last rewrite
    data, _ = blocks.read_committed(fs, root)
    assert len(data["blocks"]) == 20


def test_an_interrupted_rewrite_never_applies_a_commit_twice(tmp_path):
    fs, root, man = _open(tmp_path)
    _touch_blocks(fs, root, 2)
    man.commit(_entry(0), ["a"], {})
    stale = fs.ls(f"{root}/commits")[0]
    kept = fs.cat_file(stale)
    man.save()  # the snapshot holds commit 1 and deletes its file...
    fs.pipe_file(stale, kept)  # ...as if the deletion had not happened before a crash
    man.commit(_entry(1), ["b"], {})
    data, _ = blocks.read_committed(fs, root)
    assert [b["path"] for b in data["blocks"]] == [_entry(0)["path"], _entry(1)["path"]]
    assert data["counts"]["samples"] == 4
    reopened = blocks.Manifest.open(fs, root, _fresh(), "m")
    assert reopened.committed_ids() == {"a", "b"}
    reopened.save()
    assert not fs.exists(stale)  # swept with the next rewrite


def test_a_finished_manifest_alone_is_the_whole_truth(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, root, man = _open(tmp_path)
    for i in range(3):  # real blocks: finish reads their token ids
        t = pa.table({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]})
        fs.makedirs(f"{root}/blocks", exist_ok=True)
        pq.write_table(t, f"{root}/blocks/part-{i}.parquet")
        e = {**_entry(i), "bytes": fs.info(f"{root}/blocks/part-{i}.parquet")["size"], "rows": 1}
        man.commit(e, [f"s{i}"], {})
    freq = man.finish(8, {"counts": {}}, 0)
    assert freq.tolist() == [0, 0, 3, 3, 0, 0, 0, 0]  # loss-masked ids 2 and 3, once per block
    on_disk = json.loads(fs.cat_file(f"{root}/manifest.json"))
    assert on_disk["complete"] and len(on_disk["blocks"]) == 3 and not fs.ls(f"{root}/commits")
    with pytest.raises(FileNotFoundError):
        blocks.read_committed(fs, f"{root}/elsewhere")


def test_a_resume_checks_many_recent_blocks_from_one_listing_and_still_names_each_bad_one(tmp_path, monkeypatch):
    """More than 16 blocks committed since the snapshot: the size check lists blocks/ once (no per-block HEAD on an
    object store) and still names a missing and a truncated block."""
    fs, root, man = _open(tmp_path)
    _touch_blocks(fs, root, 40)
    for i in range(40):
        man.commit(_entry(i), [f"s{i}-a", f"s{i}-b"], {})
    fs.rm(f"{root}/blocks/part-7.parquet")
    fs.pipe_file(f"{root}/blocks/part-9.parquet", b"x" * 60)
    monkeypatch.setattr(blocks, "verify_block", lambda *a, **k: pytest.fail("a check per block"))
    with pytest.raises(blocks.CorruptBlocks) as e:
        blocks.Manifest.open(fs, root, _fresh(), "m")
    assert set(e.value.problems) == {"blocks/part-7.parquet", "blocks/part-9.parquet"}
    assert e.value.problems["blocks/part-7.parquet"] == "missing" and "60 bytes" in e.value.problems["blocks/part-9.parquet"]


def test_blocks_written_by_another_process_are_seen_on_s3_despite_cached_listings(s3_endpoint):
    """s3fs caches a folder's listing; on a resume, blocks a replica wrote after the driver's orphan sweep listed
    blocks/ must still be found by the size check and the end sweep (extract.block_writer: replica writes them
    from another process). Fails with 20 blocks reported missing when the listings are not refreshed."""
    import s3fs

    fs, root = storage.filesystem("s3://eagle3ray/cache", s3_endpoint)
    hs = f"{root}/hs"
    other = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    man = blocks.Manifest.open(fs, hs, _fresh(), "m")
    man.set_rejected({}, {})
    for i in range(20):
        other.pipe_file(f"{hs}/blocks/part-{i}.parquet", b"x" * 100)
        man.commit(_entry(i), [f"s{i}"], {})
    fs.invalidate_cache()  # a resumed driver starts with no cached listing
    man = blocks.Manifest.open(fs, hs, _fresh(), "m")
    assert man.remove_orphans() == 0  # lists blocks/, and s3fs caches that listing
    for i in range(20, 40):  # written by a replica after the listing, committed by the driver
        other.pipe_file(f"{hs}/blocks/part-{i}.parquet", b"x" * 100)
        man.commit(_entry(i), [f"s{i}"], {})
    other.pipe_file(f"{hs}/blocks/part-orphan.parquet", b"y")  # a block whose reply was lost
    assert man.verify(sha256=False) == {}
    assert blocks.verify_block(fs, hs, _entry(25), False) is None
    assert man.remove_orphans() == 1 and not other.exists(f"{hs}/blocks/part-orphan.parquet")


@pytest.mark.parametrize("where", ["file", "s3"])
def test_manifest_writes_are_conditional_on_the_version_the_writer_read(tmp_path, where, request):
    """Two writers that both got past the lease (one deleted it by hand): the second's commit of the same sequence
    number and its snapshot rewrite are refused (ManifestConflict), and what the first committed stays as it was."""
    if where == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        fs, root = storage.filesystem("s3://eagle3ray/cond", endpoint)
    else:
        fs, root = storage.filesystem(f"file://{tmp_path}")
    hs = f"{root}/hs"
    first = blocks.Manifest.open(fs, hs, _fresh(), "m")
    first.set_rejected({}, {})
    _touch_blocks(fs, hs, 4)
    second = blocks.Manifest.open(fs, hs, _fresh(), "m")  # reads the same version as the first
    assert first.commit(_entry(0), ["a"], {}) == []
    with pytest.raises(blocks.ManifestConflict, match="another writer committed block 1"):
        second.commit(_entry(1), ["b"], {})
    first.save()  # version 1 -> 2
    with pytest.raises(blocks.ManifestConflict, match="another writer changed this manifest"):
        second.save()
    data, _ = blocks.read_committed(fs, hs)
    assert [b["path"] for b in data["blocks"]] == [_entry(0)["path"]] and data["version"] == 2
    late = blocks.Manifest.open(fs, hs, _fresh(), "m")  # a writer that reads now is fine
    assert late.commit(_entry(2), ["c"], {}) == []
    late.save()
