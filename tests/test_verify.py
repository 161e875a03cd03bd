"""Committed blocks are verified where they are read, and `eagle3ray verify --repair` turns bad ones into work to
redo. Real damage on disk: a deleted file, a truncated file, one flipped byte in an uncompressed block."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from eagle3ray import blocks, storage
from eagle3ray.cli import app
from eagle3ray.config import load_config


def _run_with_blocks(tmp_path, n_blocks: int = 4, rows: int = 3):
    """A run whose hidden_states/ holds ``n_blocks`` committed, uncompressed blocks (states of 8 x 16 floats)."""
    import torch

    cfg = load_config(None, [f"run.storage=file://{tmp_path}/runs", "run.name=v"])
    paths = storage.run_paths(cfg)
    fresh = blocks.new_manifest({"config_hash": "c", "hidden_size": 16, "num_hidden_layers": 4}, [1, 2, 3, 4],
                                "float32", {"sha256": "s", "samples": n_blocks * rows})
    man = blocks.Manifest.open(paths.fs, paths.hidden_states, fresh, "m")
    man.set_rejected({}, {})
    for b in range(n_blocks):
        samples = [{"sample_id": f"b{b}s{i}", "input_ids": list(range(8)), "loss_mask": [1] * 8} for i in range(rows)]
        results = [{"sample_id": s["sample_id"], "shape": [8, 4, 16],
                    "hidden_states": blocks.to_storage_bytes(torch.randn(8, 4, 16), "float32")} for s in samples]
        rel = f"blocks/part-{b}.parquet"
        entry = blocks.write_block(paths.fs, f"{paths.hidden_states}/{rel}",
                                   blocks.build_block(samples, results, "float32"), "none")
        assert man.commit({**entry, "path": rel}, [s["sample_id"] for s in samples], {}) == []
    man.finish(16, {}, 0)
    return cfg, paths, man


def _damage(paths) -> dict[str, str]:
    root = f"{paths.hidden_states}/blocks"
    paths.fs.rm(f"{root}/part-0.parquet")  # deleted
    with open(f"{root}/part-1.parquet", "r+b") as f:  # truncated
        f.truncate(100)
    data = bytearray(open(f"{root}/part-2.parquet", "rb").read())
    i = data.index(b"\x00", len(data) // 3)  # a byte a third into the file, far from the footer
    data[i] ^= 0x01
    open(f"{root}/part-2.parquet", "wb").write(bytes(data))  # one flipped bit, same size
    return {"blocks/part-0.parquet": "missing", "blocks/part-1.parquet": "truncated",
            "blocks/part-2.parquet": "sha256"}


def test_verify_names_every_missing_truncated_and_corrupt_block_and_repair_redoes_only_them(tmp_path):
    cfg, paths, man = _run_with_blocks(tmp_path)
    r = CliRunner().invoke(app, ["verify", f"run.storage={cfg.run.storage}", "run.name=v"])
    assert r.exit_code == 0 and "all match the manifest" in r.output, r.output
    expected = _damage(paths)
    r = CliRunner().invoke(app, ["verify", f"run.storage={cfg.run.storage}", "run.name=v"])
    assert r.exit_code == 1, r.output
    for path, what in expected.items():
        assert any(path in line and what in line for line in r.output.splitlines()), (path, r.output)
    assert "part-3.parquet" not in r.output  # the intact block is not reported
    r = CliRunner().invoke(app, ["verify", f"run.storage={cfg.run.storage}", "run.name=v", "--repair"])
    assert r.exit_code == 0 and "9 samples dropped" in r.output, r.output
    after = storage.read_json(paths.fs, f"{paths.hidden_states}/manifest.json")
    assert [b["path"] for b in after["blocks"]] == ["blocks/part-3.parquet"] and not after["complete"]
    assert after["counts"]["samples"] == 3
    again = blocks.Manifest.open(paths.fs, paths.hidden_states, after, "m")  # a resume now works
    assert again.committed_ids() == {"b3s0", "b3s1", "b3s2"}  # every other sample is work to redo
    assert again.remove_orphans() == 2  # the corrupt files go when extraction resumes


def test_a_resumed_extraction_refuses_a_missing_block_naming_it_and_the_repair(tmp_path):
    cfg, paths, man = _run_with_blocks(tmp_path)
    man.data["complete"] = False
    man.save()
    fresh = dict(man.data)
    # the blocks an interrupted run committed last (in the commit log) are checked when it resumes
    reopened = blocks.Manifest.open(paths.fs, paths.hidden_states, fresh, "m")
    rel = "blocks/part-late.parquet"
    with paths.fs.open(f"{paths.hidden_states}/blocks/part-3.parquet", "rb") as f:
        paths.fs.pipe_file(f"{paths.hidden_states}/{rel}", f.read())
    assert reopened.commit({**man.data["blocks"][3], "path": rel}, ["late0", "late1", "late2"], {}) == []
    paths.fs.rm(f"{paths.hidden_states}/{rel}")
    with pytest.raises(blocks.CorruptBlocks, match=r"blocks/part-late.parquet: missing.*verify -c CONFIG --repair"):
        blocks.Manifest.open(paths.fs, paths.hidden_states, fresh, "hidden_states/manifest.json")
    # any other missing block is named when the extraction finishes (it reads every block then), not found later
    paths.fs.rm(f"{paths.hidden_states}/blocks/part-2.parquet")
    folded = blocks.Manifest(paths.fs, paths.hidden_states, blocks.read_committed(paths.fs, paths.hidden_states)[0])
    with pytest.raises(blocks.CorruptBlocks, match=r"part-2.parquet: missing"):
        folded.finish(16, {}, 0)


def test_training_refuses_a_corrupt_block_before_ray_train_starts(tmp_path):
    from eagle3ray.train import train

    cfg, paths, _ = _run_with_blocks(tmp_path)
    _damage(paths)
    with pytest.raises(blocks.CorruptBlocks, match="3 committed block") as e:
        train(cfg)
    assert set(e.value.problems) == {"blocks/part-0.parquet", "blocks/part-1.parquet", "blocks/part-2.parquet"}
    size_only = load_config(None, [f"run.storage={cfg.run.storage}", "run.name=v", "train.verify_blocks=size"])
    with pytest.raises(blocks.CorruptBlocks) as e:
        train(size_only)
    assert set(e.value.problems) == {"blocks/part-0.parquet", "blocks/part-1.parquet"}  # size cannot see a flip


def test_repair_holds_the_writer_lease_and_is_refused_beside_a_running_writer(tmp_path):
    """`verify --repair` rewrites the manifest, so it takes the run's writer lease: refused (LeaseHeld, naming the
    holder) while another process holds it, the manifest untouched; plain `verify` only reads and still runs."""
    import subprocess
    import sys
    import textwrap

    cfg, paths, man = _run_with_blocks(tmp_path)
    _damage(paths)
    before = paths.fs.cat_file(f"{paths.hidden_states}/manifest.json")

    code = textwrap.dedent(f"""
        import time
        from eagle3ray import lease, storage
        paths = storage.RunPaths.create({cfg.run.storage!r}, "v")
        with lease.held(paths, "extract", ttl_s=30):
            print("READY", flush=True)
            time.sleep(60)
    """)
    w = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline().strip() == "READY"
        r = CliRunner().invoke(app, ["verify", f"run.storage={cfg.run.storage}", "run.name=v", "--repair"])
        from eagle3ray.lease import LeaseHeld  # eagle3ray's main() prints it as "error: ..." and exits 1

        assert isinstance(r.exception, LeaseHeld), r.output
        assert "another writer holds this run" in str(r.exception) and f"pid {w.pid}" in str(r.exception)
        assert paths.fs.cat_file(f"{paths.hidden_states}/manifest.json") == before
        r = CliRunner().invoke(app, ["verify", f"run.storage={cfg.run.storage}", "run.name=v"])
        assert r.exit_code == 1 and "part-0.parquet" in r.output, r.output  # reading needs no lease
    finally:
        w.kill()
        w.wait()
