"""The verifier engine's hidden-state scratch files in /dev/shm (issue 16, review row 23): a private folder
(unpredictable name, mode 0700, never a planted folder or symlink), no file left behind by a call that failed
mid-batch, and the folders of dead engines swept by the next engine on the host."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from eagle3ray.verifier import SCRATCH_PREFIX, HiddenStateScratch


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_scratch_folder_is_private_and_dead_engines_folders_are_swept(tmp_path):
    first = HiddenStateScratch(str(tmp_path))
    second = HiddenStateScratch(str(tmp_path))
    assert first.path != second.path  # not derived from pid + model alone
    assert stat.S_IMODE(os.stat(first.path).st_mode) == 0o700
    space = first.space
    dead = tmp_path / f"{SCRATCH_PREFIX}{space}-{_dead_pid()}-abc123"
    dead.mkdir()
    (dead / "req-1.safetensors").write_bytes(b"x" * 1000)  # a killed replica's states
    live = tmp_path / f"{SCRATCH_PREFIX}{space}-{os.getpid()}-def456"  # a live engine's
    live.mkdir()
    other_space = tmp_path / f"{SCRATCH_PREFIX}0000beef-{_dead_pid()}-xyz"  # another container's pid space
    other_space.mkdir()
    target = tmp_path / "not-ours"
    target.mkdir()
    (target / "keep").write_text("k")
    link = tmp_path / f"{SCRATCH_PREFIX}{space}-{_dead_pid()}-lnk"
    link.symlink_to(target)
    third = HiddenStateScratch(str(tmp_path))
    assert third.swept == [str(dead)]
    assert not dead.exists() and live.exists() and other_space.exists() and (target / "keep").exists()
    for s in (first, second, third):
        s.remove()
        assert not os.path.exists(s.path)


def test_the_connector_refuses_a_scratch_folder_that_is_a_symlink(tmp_path):
    from eagle3ray.connector import _check_scratch_folder

    real = tmp_path / "elsewhere"
    real.mkdir()
    planted = tmp_path / "eagle3ray-hs-planted"
    planted.symlink_to(real)
    with pytest.raises(PermissionError, match="symlink"):
        _check_scratch_folder(str(planted))
    fresh = tmp_path / "fresh"
    _check_scratch_folder(str(fresh))  # a missing folder is created private
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700


_ENGINE_SCRIPT = r"""
import json, os, sys
import vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector as hs
from eagle3ray.verifier import VerifierEngine, VerifierError, VerifierSpec

verifier, scratch_root = sys.argv[1], sys.argv[2]
spec = VerifierSpec(model_path=verifier, layer_ids=[2, 4, 5, 8], max_model_len=256, max_num_batched_tokens=512,
                    dtype="float32", cpu_kv_cache_gib=1, tmp_dir=scratch_root)
engine = VerifierEngine(spec)
samples = [{"sample_id": f"s{i}", "input_ids": [1, 100 + i, 200 + i, 300 + i, 2]} for i in range(4)]
ok = engine.extract(samples)
files_after_ok = os.listdir(engine.scratch.path)
real_load, calls = hs.load_hidden_states, []


def load_with_sample_2_mismatched(path):
    data = real_load(path)
    calls.append(path)
    if len(calls) == 2:
        data["token_ids"] = data["token_ids"] + 1
    return data


engine.probe()  # the replica's idle health probe: a one-token decode, no states file
files_after_probe = os.listdir(engine.scratch.path)
hs.load_hidden_states = load_with_sample_2_mismatched
try:
    engine.extract(samples)
    error = None
except VerifierError as e:
    error = str(e)
print("RESULT " + json.dumps({"ok": len(ok), "files_after_ok": files_after_ok, "error": error,
                              "files_after_probe": files_after_probe,
                              "files_after_error": os.listdir(engine.scratch.path), "scratch": engine.scratch.path}))
"""


@pytest.mark.slow
def test_a_batch_rejected_at_its_second_sample_leaves_no_scratch_file(tiny_verifier, tmp_path):
    """A real vLLM engine (the tiny verifier, in its own process): a batch of 4 whose 2nd sample fails the token-id
    check raises VerifierError naming it, and the scratch folder is empty afterwards (before, samples 2-4's files
    stayed in /dev/shm until the host rebooted)."""
    from eagle3ray.verifier import VerifierSpec  # noqa: F401 - the script's import, checked here first

    out = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, tiny_verifier, str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    assert r["ok"] == 4 and r["files_after_ok"] == [] and r["files_after_probe"] == []
    assert r["error"] and "sample s1" in r["error"] and "token ids" in r["error"]
    assert r["files_after_error"] == []
    assert not os.path.exists(r["scratch"])  # removed at the engine process's exit
