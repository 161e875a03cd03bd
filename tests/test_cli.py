"""The command line on the real default config (SmolLM2-135M-Instruct, ShareGPT, MT-Bench held out)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from eagle3ray import storage
from eagle3ray.cli import app
from eagle3ray.config import load_config

runner = CliRunner()


def test_help_teaches_each_stage():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "prepare" in r.output and "extract" in r.output
    r = runner.invoke(app, ["extract", "--help"])
    assert r.exit_code == 0 and "Resumes" in r.output and "overrides" in r.output.lower()


def test_unknown_override_exits_2_naming_the_field():
    r = runner.invoke(app, ["prepare", "data.max_sample=3"])
    assert r.exit_code == 2 and "data.max_sample" in r.output


@pytest.mark.slow
def test_extract_default_config_real_verifier(ray_session, tmp_path):
    storage_uri = f"file://{tmp_path}/runs"
    args = ["extract", "-c", "configs/smollm2-135m-cpu.yaml", "data.max_samples=6", f"run.storage={storage_uri}",
            "--no-progress"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    for field in ("tokens/s", "blocks committed", "bytes written", "samples in manifest"):
        assert field in r.output
    cfg = load_config("configs/smollm2-135m-cpu.yaml", ["data.max_samples=6", f"run.storage={storage_uri}"])
    paths = storage.run_paths(cfg)
    man = storage.read_json(paths.fs, f"{paths.hidden_states}/manifest.json")
    assert man["complete"] and man["layer_ids"] == [2, 15, 27, 30]
    assert man["verifier"]["hidden_size"] == 576 and man["dtype"] == "bfloat16"
    rejected = sum(man["rejected"]["extract"]["counts"].values())
    assert man["counts"]["samples"] + rejected == 6
    assert paths.fs.exists(paths.sub("config.resolved.yaml"))
    r2 = runner.invoke(app, args)  # second run: both stages already complete
    assert r2.exit_code == 0 and "already complete" in r2.output
    # a quiet terminal: eagle3ray's INFO log goes to <run>/logs/driver.log, not to the terminal
    driver_log = (tmp_path / "runs" / "smollm2-135m-cpu" / "logs" / "driver.log").read_text()
    assert "INFO eagle3ray.extract" in driver_log and "INFO eagle3ray" not in r.output
    assert not (tmp_path / "runs" / "smollm2-135m-cpu" / "plan.json").exists()  # extract's size was given: no probe
