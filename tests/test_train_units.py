"""A block row -> speculators' training sample: the shift, the state split and the loss positions."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from eagle3ray.blocks import build_block  # noqa: E402
from eagle3ray.train_worker import row_to_sample  # noqa: E402
from eagle3ray.blocks import to_storage_bytes  # noqa: E402


def _row(T=6, H=4):
    # states[t, l, h] = 100 t + 10 l + h, so every value tells where it came from
    states = (100 * np.arange(T)[:, None, None] + 10 * np.arange(4)[None, :, None]
              + np.arange(H)[None, None, :]).astype(np.float32)
    mask = [0, 0, 0, 1, 1, 1][:T]
    table = build_block([{"sample_id": "s0", "input_ids": list(range(10, 10 + T)), "loss_mask": mask}],
                        [{"sample_id": "s0", "shape": [T, 4, H],
                          "hidden_states": to_storage_bytes(torch.from_numpy(states), "float32")}], "float32")
    return table.to_pylist()[0], states, mask


def test_sample_is_shifted_and_split_into_aux_and_final_states():
    row, states, mask = _row()
    s = row_to_sample(row)
    T = len(mask)
    # token t+1 is paired with the auxiliary states of token t and the final state of token t+1 (speculators)
    assert s["input_ids"].tolist() == list(range(11, 10 + T))
    assert s["hidden_states"].shape == (T - 1, 3 * 4)
    assert torch.equal(s["hidden_states"], torch.from_numpy(states[:-1, :3].reshape(T - 1, -1)))
    assert torch.equal(s["verifier_last_hidden_states"], torch.from_numpy(states[1:, 3]))
    assert s["loss_mask"].tolist() == mask[1:]
    assert int(s["lengths"][0]) == T - 1


def test_all_positions_puts_the_loss_on_prompt_tokens_too():
    row, _, mask = _row()
    s = row_to_sample(row, all_positions=True)
    assert s["loss_mask"].tolist() == [1] * (len(mask) - 1)
    # only the mask changes
    ref = row_to_sample(row)
    for k in ("input_ids", "hidden_states", "verifier_last_hidden_states", "position_ids"):
        assert torch.equal(s[k], ref[k])


def test_changed_train_settings_supersede_old_checkpoints(tmp_path, caplog):
    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.train import _supersede_if_settings_changed, train_settings

    cfg = load_config(None, [f"run.storage=file://{tmp_path}", "run.name=r"])
    paths = storage.run_paths(cfg)
    ck = paths.sub("checkpoints")
    storage.write_json_atomic(paths.fs, f"{paths.sub('vocab')}/vocab.json",
                              {"draft_vocab_size": 8192, "token_freq_sha256": "abc"})
    first = train_settings(cfg, paths)
    _supersede_if_settings_changed(paths, ck, first)
    storage.write_json_atomic(paths.fs, f"{ck}/complete.json", {"max_steps": 120})

    # more steps, another checkpoint interval: same training, kept (a finished run is extended)
    longer = load_config(None, [f"run.storage=file://{tmp_path}", "run.name=r", "train.max_steps=500",
                                "train.checkpoint_every=7"])
    _supersede_if_settings_changed(paths, ck, train_settings(longer, paths))
    assert paths.fs.exists(f"{ck}/complete.json")

    # another learning rate: the old checkpoints are moved aside, nothing is deleted, the change is logged
    other = load_config(None, [f"run.storage=file://{tmp_path}", "run.name=r", "train.lr=0.001"])
    with caplog.at_level("WARNING", logger="eagle3ray.train"):
        _supersede_if_settings_changed(paths, ck, train_settings(other, paths))
    assert not paths.fs.exists(f"{ck}/complete.json")
    assert paths.fs.exists(f"{ck}.superseded-1/complete.json")
    assert "train.lr: 0.0006 -> 0.001" in caplog.text
    assert storage.read_json(paths.fs, f"{ck}/settings.json") == train_settings(other, paths)

    # a rebuilt vocabulary (other token counts) also makes the checkpoints stale
    storage.write_json_atomic(paths.fs, f"{paths.sub('vocab')}/vocab.json",
                              {"draft_vocab_size": 8192, "token_freq_sha256": "def"})
    _supersede_if_settings_changed(paths, ck, train_settings(other, paths))
    assert paths.fs.exists(f"{ck}.superseded-2/settings.json")


def test_a_missing_vocabulary_stops_training_before_any_checkpoint_is_set_aside(tmp_path):
    """Review row 8: vocab.json missing was read as {}, so the settings differed and a finished training was set
    aside before load_vocab failed. Now the train settings cannot be computed without it, and nothing moves."""
    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.train import _supersede_if_settings_changed, train_settings

    cfg = load_config(None, [f"run.storage=file://{tmp_path}", "run.name=r"])
    paths = storage.run_paths(cfg)
    ck = paths.sub("checkpoints")
    storage.write_json_atomic(paths.fs, f"{paths.sub('vocab')}/vocab.json",
                              {"draft_vocab_size": 8192, "token_freq_sha256": "abc"})
    _supersede_if_settings_changed(paths, ck, train_settings(cfg, paths))
    storage.write_json_atomic(paths.fs, f"{ck}/complete.json", {"max_steps": 120})
    paths.fs.rm(f"{paths.sub('vocab')}/vocab.json")
    with pytest.raises(FileNotFoundError, match=r"vocab/vocab.json: no draft vocabulary; run `eagle3ray vocab`"):
        train_settings(cfg, paths)
    assert paths.fs.exists(f"{ck}/complete.json") and not paths.fs.exists(f"{ck}.superseded-1")


def test_a_set_aside_cut_short_on_s3_is_finished_never_resumed_under_new_settings(tmp_path, s3_endpoint):
    """Review row 8: on an object store, setting checkpoints aside is a copy and then deletes; cut short in the
    deletes (here the endpoint errors after deleting half the objects), checkpoints/ kept some of Ray Train's files
    without its settings.json, and the next training resumed them under the new settings. A marker written first
    and deleted last makes the next training finish the move: the old files all reach superseded-1, and training
    starts clean."""
    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.train import _supersede_if_settings_changed, train_settings

    base = ["run.storage=s3://eagle3ray/sup", "run.name=r", f"run.endpoint_url={s3_endpoint}"]
    cfg = load_config(None, base)
    paths = storage.run_paths(cfg)
    fs, ck = paths.fs, paths.sub("checkpoints")
    storage.write_json_atomic(fs, f"{paths.sub('vocab')}/vocab.json", {"draft_vocab_size": 8192,
                                                                        "token_freq_sha256": "abc"})
    _supersede_if_settings_changed(paths, ck, train_settings(cfg, paths))
    old_files = {}
    for i in range(6):
        for name in ("draft_trainable.safetensors", "step.json", "data_rank0.json"):
            key = f"train/checkpoint_{i}/{name}"
            fs.pipe_file(f"{ck}/{key}", f"{key} bytes".encode())
            old_files[key] = f"{key} bytes".encode()
    old_files["settings.json"] = fs.cat_file(f"{ck}/settings.json")

    real_rm = fs.rm

    def rm_half_then_fail(path, *a, **k):
        if isinstance(path, list) and len(path) > 2:
            real_rm(sorted(path)[: len(path) // 2])  # settings.json among the deleted
            raise ConnectionError("endpoint gone mid-delete")
        return real_rm(path, *a, **k)

    fs.rm = rm_half_then_fail
    other = load_config(None, [*base, "train.lr=0.001"])
    try:
        with pytest.raises(ConnectionError):
            _supersede_if_settings_changed(paths, ck, train_settings(other, paths))
    finally:
        del fs.rm
    fs.invalidate_cache()
    left = {f[len(ck) + 1:] for f in fs.find(ck)}
    assert "settings.json" not in left and any(k.startswith("train/") for k in left)  # the dangerous state
    assert storage.MOVE_MARKER in left
    _supersede_if_settings_changed(paths, ck, train_settings(other, paths))  # the next training
    fs.invalidate_cache()
    assert {f[len(ck) + 1:] for f in fs.find(ck)} == {"settings.json"}
    assert storage.read_json(fs, f"{ck}/settings.json") == train_settings(other, paths)
    moved = {f[len(ck) + len(".superseded-1") + 1:]: fs.cat_file(f) for f in fs.find(f"{ck}.superseded-1")}
    assert moved == old_files


def test_a_setting_added_later_at_its_default_keeps_old_checkpoints(tmp_path):
    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.train import _supersede_if_settings_changed, train_settings

    # AdamW, as every run was before train.optimizer existed (the embedded config says muon now)
    cfg = load_config(None, [f"run.storage=file://{tmp_path}", "run.name=r", "train.optimizer=adamw"])
    paths = storage.run_paths(cfg)
    ck = paths.sub("checkpoints")
    storage.write_json_atomic(paths.fs, f"{paths.sub('vocab')}/vocab.json",
                              {"draft_vocab_size": 8192, "token_freq_sha256": "abc"})
    old = train_settings(cfg, paths)
    # an AdamW run's settings hold no muon_* field (they do not apply to it)
    assert old["train.optimizer"] == "adamw" and not [k for k in old if "muon" in k]
    muon = load_config(None, [f"run.storage=file://{tmp_path}", "run.name=r", "train.optimizer=muon"])
    assert {"train.optimizer", "train.muon_lr"} <= set(train_settings(muon, paths))
    del old["train.hidden_noise"], old["train.optimizer"]  # checkpoints written before the options existed
    storage.write_json_atomic(paths.fs, f"{ck}/settings.json", old)
    storage.write_json_atomic(paths.fs, f"{ck}/complete.json", {"max_steps": 120})
    _supersede_if_settings_changed(paths, ck, train_settings(cfg, paths))
    assert paths.fs.exists(f"{ck}/complete.json")
    assert storage.read_json(paths.fs, f"{ck}/settings.json") == train_settings(cfg, paths)
    # the same option set to something else is a change
    noisy = load_config(None, [f"run.storage=file://{tmp_path}", "run.name=r", "train.optimizer=adamw",
                               "train.hidden_noise=0.1"])
    _supersede_if_settings_changed(paths, ck, train_settings(noisy, paths))
    assert paths.fs.exists(f"{ck}.superseded-1/complete.json")


def test_code_fingerprint_tells_another_checkout_apart(tmp_path):
    import importlib.util
    import shutil

    import eagle3ray

    here = eagle3ray.code_fingerprint()
    eagle3ray.check_code_fingerprint(here, "Ray Train worker 0")  # the same code: no error
    eagle3ray.check_code_fingerprint(None, "Ray Train worker 0")  # no fingerprint given: no check
    copy = tmp_path / "eagle3ray"
    shutil.copytree(os.path.dirname(eagle3ray.__file__), copy, ignore=shutil.ignore_patterns("__pycache__"))

    def load(path):
        spec = importlib.util.spec_from_file_location("eagle3ray_copy", path / "__init__.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    assert load(copy).code_fingerprint() == here  # same files elsewhere: same code
    (copy / "train.py").write_text((copy / "train.py").read_text() + "\n# edited\n")
    other = load(copy)
    assert other.code_fingerprint() != here
    with pytest.raises(RuntimeError, match=r"Ray Train worker 1 imports eagle3ray from .*differs from the driver.s"
                       r" .*edited after the job started"):
        other.check_code_fingerprint(here, "Ray Train worker 1")


def test_hidden_noise_is_relative_to_each_auxiliary_layer():
    import torch

    from eagle3ray.train_worker import add_hidden_noise

    torch.manual_seed(0)
    scales = torch.tensor([0.5, 4.0, 40.0])  # layers of very different magnitude, as in a real verifier
    h = (torch.randn(1, 2000, 3, 64) * scales[:, None]).flatten(-2)  # shape: [1, T, 3H]
    out = add_hidden_noise(h, 3, 0.1)
    assert out.shape == h.shape and out.dtype == h.dtype
    noise = (out - h).unflatten(-1, (3, 64))
    rms = h.unflatten(-1, (3, 64)).pow(2).mean(-1).sqrt()  # shape: [1, T, 3]
    ratio = noise.pow(2).mean(-1).sqrt() / rms  # per token and layer: ~0.1 whatever the layer's scale
    assert torch.allclose(ratio.mean(dim=(0, 1)), torch.full((3,), 0.1), rtol=0.05)
    assert not torch.equal(out, h)
    assert torch.equal(add_hidden_noise(h, 3, 0.0), h)


def test_blocks_of_another_compute_dtype_are_not_resumed():
    from eagle3ray.blocks import ManifestMismatch, check_compatible, new_manifest

    conv = {"sha256": "abc", "samples": 3}
    ident = {"config_hash": "c", "tokenizer_hash": "t", "hidden_size": 8, "num_hidden_layers": 4}
    stored = new_manifest({**ident, "compute_dtype": "bfloat16"}, [1, 2, 3, 4], "bfloat16", conv)
    check_compatible(stored, new_manifest({**ident, "compute_dtype": "bfloat16"}, [1, 2, 3, 4], "bfloat16", conv), "m")
    with pytest.raises(ManifestMismatch, match="verifier.dtype 'bfloat16'.*'float32'"):
        check_compatible(stored, new_manifest({**ident, "compute_dtype": "float32"}, [1, 2, 3, 4], "bfloat16", conv),
                         "m")
    # manifests from before the dtype was recorded still resume
    old = new_manifest(ident, [1, 2, 3, 4], "bfloat16", conv)
    check_compatible(old, new_manifest({**ident, "compute_dtype": "float32"}, [1, 2, 3, 4], "bfloat16", conv), "m")


def _tiny_step(tiny_verifier, max_tokens: int = 64, overrides: tuple = ()):
    """A DraftStep on the tiny verifier (draft vocabulary 512), on the CPU."""
    import torch

    from eagle3ray.config import load_config
    from eagle3ray.train_worker import DraftStep

    cfg = load_config(None, ["vocab.draft_vocab_size=512", "train.optimizer=muon",
                             f"train.max_tokens_per_batch={max_tokens}", "train.autocast=off", *overrides])
    d2t, t2d = torch.zeros(512, dtype=torch.long), torch.zeros(49152, dtype=torch.bool)
    t2d[:512] = True
    torch.manual_seed(0)
    step = DraftStep.build(cfg.train.model_dump(), tiny_verifier, [2, 4, 5], d2t, t2d, 128, autocast_bf16=False)
    step.to_device(torch.device("cpu"))
    return step


def _rows(lengths: list[int], bad: bool = False) -> list[dict]:
    import numpy as np

    from eagle3ray.blocks import build_block, to_storage_bytes

    import torch

    samples, results = [], []
    for i, T in enumerate(lengths):
        st = torch.randn(T, 4, 128)
        if bad:
            st[T // 2, 0, 0] = float("nan")
        samples.append({"sample_id": f"s{i}", "input_ids": list(np.arange(T) % 500), "loss_mask": [1] * T})
        results.append({"sample_id": f"s{i}", "hidden_states": to_storage_bytes(st, "float32"), "shape": [T, 4, 128]})
    return build_block(samples, results, "float32").to_pylist()


class _Shard:
    """What the loop calls on a Ray Data shard: iter_batches() -> pyarrow tables."""

    def __init__(self, rows):
        self.rows = rows

    def iter_batches(self, **_):
        import pyarrow as pa

        from eagle3ray.blocks import BLOCK_SCHEMA

        yield pa.Table.from_pylist(self.rows, schema=BLOCK_SCHEMA)


def test_a_nan_loss_stops_training_naming_the_step_and_samples_before_any_update(tiny_verifier):
    import torch

    from eagle3ray.train_worker import EpochBatches, NonFiniteLoss

    step = _tiny_step(tiny_verifier)
    ids, batch = next(iter(EpochBatches(_Shard(_rows([40], bad=True)), step, 0, set())))
    before = {n: p.detach().clone() for n, p in step.core.named_parameters() if p.requires_grad}
    with pytest.raises(NonFiniteLoss, match=r"step 7 \(samples \['s0'\]\): loss is nan"):
        step.step(batch, f"step 7 (samples {ids})")
    assert all(torch.equal(before[n], p) for n, p in step.core.named_parameters() if p.requires_grad)
    _, good = next(iter(EpochBatches(_Shard(_rows([40])), step, 0, set())))
    assert "loss_sum" in step.step(good)  # a finite batch trains as before


def test_samples_longer_than_the_step_budget_are_counted_not_silently_truncated(tiny_verifier, caplog):
    from eagle3ray.train_worker import EpochBatches

    step = _tiny_step(tiny_verifier, max_tokens=64)
    batches = EpochBatches(_Shard(_rows([30, 200, 20, 90])), step, 0, set())
    with caplog.at_level("WARNING"):
        groups = [ids for ids, _ in batches]
    assert ["s1"] in groups and ["s3"] in groups  # each long sample fills a step alone
    assert batches.truncated == 2
    # the first of them in the shuffled order is named
    assert ("sample s1 has 199 tokens > train.max_tokens_per_batch 64" in caplog.text
            or "sample s3 has 89 tokens > train.max_tokens_per_batch 64" in caplog.text)


def test_the_export_check_reads_a_draft_on_an_s3_compatible_endpoint(tmp_path, make_cfg, tiny_verifier, s3_endpoint):
    """The pipeline's check stage passes run.endpoint_url to the draft's reads (it used the default AWS endpoint)."""
    import s3fs
    import torch

    from conftest import write_chat_jsonl
    from eagle3ray.config import load_config
    from eagle3ray.draft import build_draft
    from eagle3ray.pipeline import run_stage

    d2t, t2d = torch.zeros(512, dtype=torch.long), torch.zeros(49152, dtype=torch.bool)
    t2d[:512] = True
    tc = load_config(None, ["vocab.draft_vocab_size=512", "train.optimizer=muon"]).train.model_dump()
    build_draft(tiny_verifier, [2, 4, 5], d2t, t2d, tc).save_pretrained(tmp_path / "export")
    s3fs.S3FileSystem(endpoint_url=s3_endpoint).put(str(tmp_path / "export") + "/", "eagle3ray/runs/t/export/",
                                                    recursive=True)
    cfg = make_cfg([write_chat_jsonl(tmp_path / "t.jsonl", [])], f"run.endpoint_url={s3_endpoint}",
                   "vocab.draft_vocab_size=512", storage="s3://eagle3ray/runs")
    rep = run_stage(cfg, "check")
    assert rep.ok, rep.problems
    assert rep.shapes["lm_head.weight"] == [512, 128]


def test_the_best_checkpoint_is_chosen_from_the_surviving_attempt_not_a_dead_one(tmp_path):
    """Review row 19: an attempt that died after evaluating step 20 (accuracy 0.9), whose step-20 checkpoint Ray
    Train never registered, resumed from step 10 and evaluated step 20 again (0.5). best.json must pair the
    survivor's step-20 weights with the survivor's 0.5, not the dead attempt's 0.9; a step saved twice on storage
    resolves to the later folder."""
    import json

    import fsspec

    from eagle3ray.train import best_of_history, surviving_history
    from eagle3ray.train_worker import WorkerCheckpoint

    history = [{"step": 0, "event": "untrained", "val_full_acc_0": 0.01},
               {"step": 10, "val_full_acc_0": 0.3}, {"step": 20, "val_full_acc_0": 0.9},  # the dead attempt
               {"step": 10, "event": "resumed"},
               {"step": 20, "val_full_acc_0": 0.5}, {"step": 30, "val_full_acc_0": 0.45}]
    assert [m["step"] for m in surviving_history(history)] == [0, 10, 10, 20, 30]
    assert best_of_history(history) == {"step": 20, "val_full_acc_0": 0.5}
    assert best_of_history([{"step": 0, "event": "untrained", "val_full_acc_0": 0.1}]) == {}

    fs = fsspec.filesystem("file")
    root = tmp_path / "train"
    for name, step, whole in (("checkpoint_2026-12-01_10-00-00.000000", 20, True),  # the dead attempt's
                              ("checkpoint_2026-12-01_10-05-00.000000", 20, True),  # the survivor's
                              ("checkpoint_2026-12-01_10-06-00.000000", 30, False)):  # cut short
        d = root / name
        d.mkdir(parents=True)
        (d / "draft_trainable.safetensors").write_bytes(b"w" * 100)
        (d / "data_rank0.json").write_text("{}")
        (d / "step.json").write_text(json.dumps({"step": step, "world": 1, "sizes": {
            "draft_trainable.safetensors": 100 if whole else 200}}))
    found = WorkerCheckpoint.complete_on_storage(fs, str(root))
    assert found == {20: str(root / "checkpoint_2026-12-01_10-05-00.000000")}
    assert WorkerCheckpoint.latest_on_storage(fs, str(root)) == (20, found[20])


def test_a_full_disk_in_a_checkpoint_save_is_named_as_enospc_with_the_file_and_the_step(tiny_verifier, small_disk):
    """A real full file system (a 4 MiB tmpfs, filled): torch.save's own error would be ``basic_ios::clear:
    iostream error``; the save names ENOSPC, the file, the step and the free bytes instead."""
    import errno

    from conftest import fill_disk
    from eagle3ray.train_worker import TRAINABLE_FILE, WorkerCheckpoint

    step = _tiny_step(tiny_verifier)
    d = small_disk / "checkpoint_x"
    d.mkdir()
    fill_disk(small_disk)
    with pytest.raises(OSError) as e:
        WorkerCheckpoint.save(str(d), step, 0, 7, 0, {"s0"})
    assert e.value.errno == errno.ENOSPC
    msg = str(e.value)
    assert f"step-7 checkpoint file {d / TRAINABLE_FILE}" in msg and "bytes free where it needs about" in msg
    assert "TMPDIR" in msg


def test_the_worker_shuffle_buffer_yields_every_row_once_in_a_seeded_order_and_drain_counts_its_rows(tiny_verifier):
    """The shuffle buffer on the worker: every sample of the epoch exactly once (skipped ids never), the order a
    function of the seed, and rows held in the buffer counted by drain() (the epoch's tail)."""
    from eagle3ray.train_worker import EpochBatches

    step = _tiny_step(tiny_verifier, max_tokens=64)
    step.tc["shuffle_buffer_rows"] = 4
    rows = _rows([20] * 12)

    def order(seed, skip=frozenset()):
        return [i for ids, _ in EpochBatches(_Shard(rows), step, seed, set(skip)) for i in ids]

    a, b, c = order(1), order(1), order(2)
    assert sorted(a) == sorted(f"s{i}" for i in range(12)) and len(a) == 12
    assert a == b and a != c and a != [f"s{i}" for i in range(12)]
    assert sorted(order(1, {"s0", "s5"})) == sorted(f"s{i}" for i in range(12) if i not in (0, 5))
    batches = EpochBatches(_Shard(rows), step, 1, set())
    first_ids, _ = next(iter(batches))
    assert len(first_ids) + batches.drain() == 12  # nothing consumed is lost from the tail count


class _CountingShard(_Shard):
    """A shard in several Arrow batches that counts how often it is iterated."""

    def __init__(self, rows, per_batch=3):
        super().__init__(rows)
        self.per_batch, self.passes = per_batch, 0

    def iter_batches(self, **_):
        import pyarrow as pa

        from eagle3ray.blocks import BLOCK_SCHEMA

        self.passes += 1
        for i in range(0, len(self.rows), self.per_batch):
            yield pa.Table.from_pylist(self.rows[i:i + self.per_batch], schema=BLOCK_SCHEMA)


def test_the_shard_cache_replays_a_whole_first_pass_shuffled_and_streams_when_the_share_is_over_its_limit(
        tiny_verifier):
    """train.cache_shard_mib: after one whole pass (drained tails included) later epochs replay the rows from memory
    without iterating the shard: every row once, skipped ids never, the order a function of the seed; a share over
    the limit is dropped and every epoch streams; a replay needs a complete cache."""
    from eagle3ray.train_worker import EpochBatches, ShardCache

    step = _tiny_step(tiny_verifier, max_tokens=64)
    step.tc["shuffle_buffer_rows"] = 4  # so that the first batch does not pull the whole shard
    rows = _rows([20] * 12)
    shard, cache = _CountingShard(rows), ShardCache(64 << 20)
    with pytest.raises(ValueError, match="complete ShardCache"):
        EpochBatches(shard, step, 0, set(), cache=cache, replay=True)
    batches = EpochBatches(shard, step, 0, set(), cache=cache)
    first_ids, _ = next(iter(batches))
    assert not cache.complete
    assert len(first_ids) + batches.drain() == 12  # cut short: the drained rest is recorded too
    assert cache.complete and len(cache.rows) == 12 and shard.passes == 1

    def order(seed, skip=frozenset()):
        b = EpochBatches(shard, step, seed, set(skip), cache=cache, replay=True)
        return [i for ids, _ in b for i in ids]

    a, b, c = order(1), order(1), order(2)
    assert sorted(a) == sorted(f"s{i}" for i in range(12)) and a == b and a != c
    assert sorted(order(3, {"s0", "s5"})) == sorted(f"s{i}" for i in range(12) if i not in (0, 5))
    assert shard.passes == 1  # no replay read the shard
    replay = EpochBatches(shard, step, 4, {"s1"}, cache=cache, replay=True)
    ids, _ = next(iter(replay))
    assert len(ids) + replay.drain() == 11  # the tail count of a replay, as of a streamed epoch

    small = ShardCache(rows[0]["hidden_states"].__len__() * 2)  # room for about two rows' states
    for _ in range(2):
        assert len([i for ids, _ in EpochBatches(shard, step, 0, set(), cache=small) for i in ids]) == 12
    assert small.overflow and not small.complete and small.rows == [] and shard.passes == 3


def test_an_epoch_that_trained_nothing_from_a_fresh_start_stops_the_run_naming_the_workers():
    """Every epoch splits the same rows: one that began with nothing consumed and ended without a step would
    repeat forever (seen with Ray Data's equal=False split of a few blocks over 2 workers). A resumed epoch whose
    rest was all consumed may end without a step; the next one starts fresh."""
    from eagle3ray.train_worker import DataPosition, _check_epoch_trained

    with pytest.raises(RuntimeError, match=r"epoch 3: no batch for some worker of 2 .*train.num_workers"):
        _check_epoch_trained(DataPosition(step=40, epoch=3), 40, True, 2)
    _check_epoch_trained(DataPosition(step=40, epoch=3), 40, False, 2)  # resumed: its samples were consumed
    _check_epoch_trained(DataPosition(step=41, epoch=3), 40, True, 2)  # trained a step


def test_muon_steps_the_matrices_and_adamw_the_rest_and_a_checkpoint_resumes_both_exactly(tiny_verifier, tmp_path,
                                                                                         monkeypatch):
    """train.optimizer: muon is speculators' split (Muon over the 2D matrices, AdamW over the norms and the rest):
    the loss falls on a repeated batch, and a checkpoint written by WorkerCheckpoint.save and read back into a
    freshly built step takes the next step exactly as the step that never stopped (momentum buffers and both
    schedules restored). A checkpoint of one AdamW state (as written before train.optimizer existed) still loads."""
    import ray.train
    import torch

    from eagle3ray.train_worker import EpochBatches, WorkerCheckpoint

    step = _tiny_step(tiny_verifier, overrides=("train.optimizer=muon", "train.warmup_steps=0", "train.max_steps=20"))
    assert [type(o).__name__ for o in step.optimizers] == ["Muon", "AdamW"]
    params = dict(step.core.named_parameters())
    by_opt = [[n for n, p in params.items() if any(p is q for g in o.param_groups for q in g["params"])]
              for o in step.optimizers]
    assert by_opt[0] and all(params[n].ndim == 2 and "lm_head" not in n and "embed" not in n for n in by_opt[0])
    assert by_opt[1] and all(params[n].ndim == 1 for n in by_opt[1])  # the norms (lm_head is frozen here)
    assert sorted(by_opt[0] + by_opt[1]) == sorted(n for n, p in params.items() if p.requires_grad)

    _, batch = next(iter(EpochBatches(_Shard(_rows([40, 20])), step, 0, set())))
    losses = [float(step.step(batch)["loss_sum"]) for _ in range(6)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.98 * losses[0], losses

    monkeypatch.setattr(ray.train, "get_context", lambda: type("C", (), {"get_world_size": lambda self: 1})())
    WorkerCheckpoint.save(str(tmp_path), step, 0, 6, 0, {"s0", "s1"})
    again = _tiny_step(tiny_verifier, overrides=("train.optimizer=muon", "train.warmup_steps=0", "train.max_steps=20"))
    pos = WorkerCheckpoint.restore(ray.train.Checkpoint.from_directory(str(tmp_path)), again)
    assert (pos.step, pos.consumed) == (6, {"s0", "s1"}) and again.lr == step.lr
    step.step(batch)
    again.step(batch)
    for (n, a), b in zip(step.core.named_parameters(), again.core.parameters()):
        assert torch.equal(a, b), n

    adamw = _tiny_step(tiny_verifier, overrides=("train.optimizer=adamw",))
    assert [type(o).__name__ for o in adamw.optimizers] == ["AdamW"]
    adamw.step(batch)
    state = torch.load(tmp_path / "trainer_state.pt", weights_only=True)
    torch.save({**state, "optimizer": adamw.optimizers[0].state_dict(),
                "scheduler": adamw.schedulers[0].state_dict()}, tmp_path / "trainer_state.pt")
    old_format = _tiny_step(tiny_verifier, overrides=("train.optimizer=adamw",))
    WorkerCheckpoint.restore(ray.train.Checkpoint.from_directory(str(tmp_path)), old_format)
    assert old_format.optimizers[0].state_dict()["state"].keys() == adamw.optimizers[0].state_dict()["state"].keys()
    with pytest.raises(RuntimeError, match="holds 1 optimizer states, this config's train.optimizer builds 2"):
        WorkerCheckpoint.restore(ray.train.Checkpoint.from_directory(str(tmp_path)), again)


def test_muon_orthogonalizes_in_float32_on_a_cpu_without_fast_bf16_and_matches_torchs_bf16_iteration(monkeypatch):
    import torch
    from torch.optim import _muon

    from eagle3ray import machine, train_worker

    current = _muon._zeropower_via_newtonschulz  # wrapped already when an earlier test built a Muon draft
    torch_ns = getattr(current, "torch_newton_schulz", current)
    monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz", torch_ns)  # undone after the test
    monkeypatch.setattr(machine, "cpu_bf16_is_fast", lambda *a: False)
    train_worker.use_fp32_newton_schulz_on_slow_bf16_cpus()
    train_worker.use_fp32_newton_schulz_on_slow_bf16_cpus()  # idempotent: wraps once
    ns = _muon._zeropower_via_newtonschulz
    assert ns is not torch_ns and ns.eagle3ray_fp32_on_cpu
    torch.manual_seed(0)
    for shape in [(48, 80), (80, 48)]:  # wide and tall (torch's transposes the tall one)
        g = torch.randn(*shape)
        ours, theirs = ns(g, (3.4445, -4.7750, 2.0315), 5, 1e-7), torch_ns(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16 and ours.shape == g.shape
        assert (ours - theirs.float()).abs().max() < 0.05  # bf16 rounding only
        assert (ours - theirs.float()).abs().max() > 0  # and it did run in float32, not through torch's
    with pytest.raises(ValueError, match="2D"):
        ns(torch.randn(2, 3, 4), (3.4445, -4.7750, 2.0315), 5, 1e-7)  # torch's own checks still apply


def test_the_fused_loss_kernels_get_their_own_autotune_config_lists_with_the_same_configs():
    """speculators 0.9.0 shares one list between its fused loss's forward and backward kernels; torch.compile of
    the draft's forward on CUDA then fails ("already tracked for mutation", H200 run in docs/results.md)."""
    fused = pytest.importorskip("speculators.losses.fused")
    from eagle3ray.train_worker import separate_fused_loss_autotune_configs

    fwd, bwd = fused.loss_forward_kernel, fused.loss_backward_kernel
    before = list(fwd.configs)
    separate_fused_loss_autotune_configs()
    separate_fused_loss_autotune_configs()  # idempotent
    assert fwd.configs is not bwd.configs
    assert [str(c) for c in fwd.configs] == [str(c) for c in bwd.configs] == [str(c) for c in before]
    assert len(before) > 0


def test_the_output_norm_starts_as_the_verifiers_final_norm_only_when_asked(tiny_verifier, tmp_path):
    """``train.output_norm_init: verifier`` copies the verifier's ``model.norm.weight`` into the draft's ``norm``
    (the frozen lm_head's input norm); ``ones`` keeps speculators' init. The tiny verifier's norm is ones, so a copy
    with a distinct norm is made here."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from eagle3ray.config import load_config
    from eagle3ray.draft import build_draft

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier, verifier)
    sd = load_file(verifier / "model.safetensors")
    scale = torch.linspace(-2.0, 3.0, sd["model.norm.weight"].numel()).to(sd["model.norm.weight"].dtype)
    sd["model.norm.weight"] = scale
    save_file(sd, verifier / "model.safetensors", metadata={"format": "pt"})

    d2t, t2d = torch.zeros(512, dtype=torch.long), torch.zeros(49152, dtype=torch.bool)
    t2d[:512] = True
    for init, expect in (("verifier", scale), ("ones", torch.ones_like(scale))):
        tc = load_config(None, ["vocab.draft_vocab_size=512", "train.optimizer=muon",
                                f"train.output_norm_init={init}"]).train.model_dump()
        draft = build_draft(str(verifier), [2, 4, 5], d2t, t2d, tc)
        assert torch.equal(draft.norm.weight.detach(), expect), init
        assert draft.norm.weight.requires_grad  # still trained
        assert torch.equal(draft.verifier_norm.weight.detach(), scale)  # the loss targets' norm is untouched


def test_held_out_blocks_hold_val_fraction_of_the_tokens_not_of_the_block_count():
    """The 170-conversation run of session 29 (docs/results.md): 8 blocks whose last is a 73-token tail. Counting
    blocks held out that tail alone (one sample); counting tokens holds out the last blocks up to 10% of them."""
    from eagle3ray.train import held_out_split

    files = [f"b{i}" for i in range(8)]
    tokens = [1010, 3938, 4041, 4047, 4076, 4096, 4059, 73]
    train_files, val_files = held_out_split(files, tokens, 0.1)
    assert val_files == ["b6", "b7"] and train_files == files[:6]
    assert sum(tokens[6:]) >= 0.1 * sum(tokens) > tokens[7]
    # at least one block each side, whatever the fraction
    assert held_out_split(files, tokens, 0.0) == (files[:7], ["b7"])
    assert held_out_split(files, tokens, 0.99) == (["b0"], files[1:])
    assert held_out_split(["a", "b"], [10, 10], 0.5) == (["a"], ["b"])
    with pytest.raises(ValueError, match="2 blocks"):
        held_out_split(["a"], [10], 0.1)
    with pytest.raises(ValueError, match="token count"):
        held_out_split(["a", "b"], [10], 0.1)
