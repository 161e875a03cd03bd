"""Config schema: YAML + dotted overrides, unknown keys rejected with the field named."""

from __future__ import annotations

import pytest
import yaml

from eagle3ray.config import DEFAULT_CONFIG, ConfigError, load_config


def test_default_config_loads_and_overrides_apply():
    cfg = load_config(None, ["data.max_samples=32", "extract.max_tokens_per_batch=2048", "verifier.aux_layer_ids=[1,2,3]"])
    assert cfg.run.name == "smollm2-135m-cpu"
    assert cfg.data.max_samples == 32 and cfg.extract.max_tokens_per_batch == 2048
    assert cfg.verifier.aux_layer_ids == [1, 2, 3]
    default = load_config(DEFAULT_CONFIG)  # the file's own values without overrides: sizes planned for 15 minutes
    assert default.data.max_samples == "plan" and default.train.max_steps == "plan"
    assert default.run.time_budget == "15m"


@pytest.mark.parametrize("override, field", [
    ("extract.max_token_per_batch=10", "extract.max_token_per_batch"),
    ("nosuch.key=1", "nosuch"),
    ("extract.max_tokens_per_batch=0", "extract.max_tokens_per_batch"),
    ("verifier.dtype=int3", "verifier.dtype"),
])
def test_bad_keys_and_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert field in str(e.value) and "smollm2-135m-cpu.yaml" in str(e.value)


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="min_replicas"):
        load_config(None, ["extract.min_replicas=3", "extract.max_replicas=2"])
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        load_config(None, ["verifier.tensor_parallel_size=2"])  # CPU engines are TP=1
    cfg = load_config(None, ["verifier.device=cuda", "verifier.tensor_parallel_size=8", "verifier.dtype=bfloat16"])
    assert cfg.verifier.num_gpus == 8


def test_old_replica_key_names_are_read_with_a_warning(tmp_path, caplog):
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"run": {"name": "r"}, "extract": {"min_actors": 2, "max_actors": 3}}))
    with caplog.at_level("WARNING"):
        cfg = load_config(old)
    assert (cfg.extract.min_replicas, cfg.extract.max_replicas) == (2, 3)
    assert "extract.min_actors is deprecated" in caplog.text
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump({"run": {"name": "r"}, "extract": {"min_actors": 2, "min_replicas": 2}}))
    with pytest.raises(ConfigError, match="old name of extract.min_replicas"):
        load_config(both)


def test_auto_dtype_follows_the_device_and_the_cpu(tmp_path, monkeypatch):
    from eagle3ray import config, machine

    amx, avx2 = tmp_path / "amx", tmp_path / "avx2"
    amx.write_text("processor : 0\nflags : fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    avx2.write_text("processor : 0\nflags : fpu avx2 fma\n")
    assert machine.cpu_bf16_is_fast(amx) and not machine.cpu_bf16_is_fast(avx2)
    zen4, zen3 = tmp_path / "zen4", tmp_path / "zen3"  # AVX512-BF16 without AMX; AVX-512 without bf16
    zen4.write_text("processor : 0\nflags : fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    zen3.write_text("processor : 0\nflags : fpu avx2 avx512f avx512bw avx512_vnni\n")
    assert machine.cpu_bf16_is_fast(zen4) and not machine.cpu_bf16_is_fast(zen3)
    assert machine.cpu_flags(zen4) >= {"avx512_bf16", "avx2"} and machine.cpu_flags(tmp_path / "missing") == set()
    assert not machine.cpu_bf16_is_fast(tmp_path / "missing")
    monkeypatch.setattr(machine, "cpu_bf16_is_fast", lambda: False)
    assert load_config(None, ["verifier.dtype=auto"]).verifier.dtype == "float32"
    assert load_config(None, ["verifier.dtype=auto", "verifier.device=cuda"]).verifier.dtype == "bfloat16"
    monkeypatch.setattr(machine, "cpu_bf16_is_fast", lambda: True)
    cfg = load_config(None, ["verifier.dtype=auto"])
    assert cfg.verifier.dtype == "bfloat16"
    assert yaml.safe_load(cfg.to_yaml())["verifier"]["dtype"] == "bfloat16"  # the resolved config records it
    # left out of a config file, the field's default 'auto' is resolved as well
    no_key = tmp_path / "no_dtype.yaml"
    no_key.write_text(yaml.safe_dump({"run": {"name": "r"}}))
    assert load_config(no_key).verifier.dtype == "bfloat16"
    monkeypatch.setattr(machine, "cpu_bf16_is_fast", lambda: False)
    assert load_config(no_key).verifier.dtype == "float32"
    # the schema itself is pure: 'auto' stays 'auto' until resolve() (which load_config calls)
    assert config.VerifierSection().dtype == "auto"
    assert load_config(no_key, resolved=False).verifier.dtype == "auto"
    assert config.resolve(load_config(no_key, resolved=False)).verifier.dtype == "float32"
    assert machine.resolve_autocast("auto", "cpu") is False and machine.resolve_autocast("auto", "cuda") is True
    assert machine.resolve_autocast("bfloat16", "cpu") is True and machine.resolve_autocast("off", "cuda") is False
    monkeypatch.setattr(machine, "cpu_bf16_is_fast", lambda: True)
    assert machine.resolve_autocast("auto", "cpu") is True
    assert load_config(None, ["verifier.dtype=float32"]).verifier.dtype == "float32"


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.yaml")
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["data.max_samples"])


def test_layer_ids_default_and_validation():
    from eagle3ray.draft import resolve_layer_ids

    assert resolve_layer_ids(None, 30) == [2, 15, 27, 30]  # speculators' default + final pre-norm
    assert resolve_layer_ids([2, 30, 58], 61) == [2, 30, 58, 61]  # Kimi-K2.5's aux layers
    with pytest.raises(ValueError, match="in \\[0, 30\\)"):
        resolve_layer_ids([2, 15, 31], 30)
    with pytest.raises(ValueError, match="appended automatically"):
        resolve_layer_ids([2, 15, 30], 30)


def test_relative_storage_is_resolved_once_against_the_working_directory(tmp_path, monkeypatch):
    # Ray workers run in other directories: a relative root must already be absolute in the config.
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.storage=file://./runs"])
    assert cfg.run.storage == f"file://{tmp_path}/runs"
    assert load_config(None, ["run.storage=s3://bucket/prefix"]).run.storage == "s3://bucket/prefix"


def test_verifier_identity_is_cached_per_folder_and_invalidated_by_changes(tiny_verifier, tmp_path):
    """Jobs after the first read the verifier identity from the cache (no tokenizer load); editing a
    tokenizer or config file gives a new key, so a changed verifier is never mistaken for the old one."""
    import json
    import shutil

    from eagle3ray.verifier import model_identity

    folder = tmp_path / "v"
    shutil.copytree(tiny_verifier, folder)
    cache = tmp_path / "cache"
    a = model_identity(str(folder), cache)
    files = list((cache / "identity").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text()) == a
    assert set(a) >= {"config_hash", "tokenizer_hash", "chat_template_hash", "hidden_size", "num_hidden_layers"}
    assert model_identity(str(folder), cache) == a  # served from the cache
    tc = folder / "tokenizer_config.json"
    cfg = json.loads(tc.read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }}"
    tc.write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    b = model_identity(str(folder), cache)
    assert b["chat_template_hash"] != a["chat_template_hash"] and b["config_hash"] == a["config_hash"]
    assert len(list((cache / "identity").glob("*.json"))) == 2


@pytest.mark.parametrize("name", sorted(p.name for p in (DEFAULT_CONFIG.parent).glob("*.yaml")))
def test_config_show_and_keys_work_on_every_shipped_config(name, monkeypatch):
    """`eagle3ray config show` names where each resolved value came from; `config keys` lists every key."""
    from typer.testing import CliRunner

    from eagle3ray import machine
    from eagle3ray.cli import app

    monkeypatch.setattr(machine, "cpu_bf16_is_fast", lambda: False)
    path = str(DEFAULT_CONFIG.parent / name)
    r = CliRunner().invoke(app, ["config", "show", "-c", path, "train.lr=0.001"])
    assert r.exit_code == 0, r.output
    lines = {ln.split()[0]: ln for ln in r.output.splitlines() if ln.strip()}
    assert lines["train.lr"].endswith("[override]") and "0.001" in lines["train.lr"]
    assert lines["run.name"].endswith("[yaml]")
    assert lines["run.endpoint_url"].endswith("[default]") or lines["run.endpoint_url"].endswith("[yaml]")
    cfg_tree = yaml.safe_load(open(path))
    if cfg_tree["verifier"].get("dtype", "auto") == "auto" and cfg_tree["verifier"].get("device", "cpu") == "cpu":
        assert "resolved (was 'auto')" in lines["verifier.dtype"] and '"float32"' in lines["verifier.dtype"]
    r = CliRunner().invoke(app, ["config", "show", "-c", path, "--yaml"])
    assert r.exit_code == 0 and yaml.safe_load(r.output)["run"]["name"] == cfg_tree["run"]["name"]
    r = CliRunner().invoke(app, ["config", "keys"])
    assert r.exit_code == 0
    shown = {ln.split()[0] for ln in r.output.splitlines() if ln.startswith("  ")}
    assert {f"{sec}.{k}" for sec in cfg_tree for k in (cfg_tree[sec] or {})} <= shown


def test_every_config_key_has_a_description():
    from eagle3ray.config import describe_keys

    assert not [r["key"] for r in describe_keys() if not r["description"]]


def test_urls_with_credentials_are_rejected_without_echoing_them():
    for override in ("run.storage=s3://AKIAXXXX:s3cr3t@bucket/runs", "run.endpoint_url=http://user:pw@127.0.0.1:9000"):
        with pytest.raises(ConfigError, match="carries credentials") as e:
            load_config(None, [override])
        assert "s3cr3t" not in str(e.value) and "pw@" not in str(e.value)
    assert load_config(None, ["run.endpoint_url=http://127.0.0.1:9000"]).run.endpoint_url == "http://127.0.0.1:9000"


def test_autocast_off_is_read_as_written(tmp_path):
    """YAML reads a bare `off` as false; `train.autocast: off` still means off, in a file and as an override."""
    assert load_config(None, ["train.autocast=off"]).train.autocast == "off"
    f = tmp_path / "c.yaml"
    f.write_text("run: {name: r}\ntrain: {autocast: off}\n")
    assert load_config(f).train.autocast == "off"


@pytest.mark.parametrize("uri", ["sftp://host/runs", "hdfs://nn/runs", "webdav://host/runs", "smb://host/share"])
def test_storage_that_cannot_write_atomically_is_refused(uri):
    """Review row 21: on these fsspec protocols a write goes in place, so a crash can leave a manifest cut short;
    only local disk (rename) and object stores (one PUT) are accepted."""
    with pytest.raises(ConfigError, match=r"run.storage .* is not supported: .*atomic|run.storage .*not supported"):
        load_config(None, [f"run.storage={uri}", "run.name=r"])


def test_local_and_object_store_roots_are_accepted():
    for uri in ("file:///tmp/runs", "s3://bucket/runs", "gs://bucket/runs", "az://container/runs"):
        assert load_config(None, [f"run.storage={uri}", "run.name=r"]).run.storage == uri
    assert load_config(None, ["run.storage=./runs", "run.name=r"]).run.storage.startswith("file:///")
