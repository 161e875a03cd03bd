"""CPU engine processes start with tcmalloc preloaded where it is installed (eagle3ray.machine.cpu_engine_env)."""

from __future__ import annotations

import os
import subprocess
import sys

from eagle3ray import machine


def test_cpu_engine_env_preloads_an_installed_tcmalloc(tmp_path, monkeypatch):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(machine, "TCMALLOC_PATHS", ("/nonexistent/libtcmalloc_minimal.so.4", str(lib)))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("EAGLE3RAY_CPU_PRELOAD", raising=False)
    assert machine.cpu_engine_env("cpu") == {"LD_PRELOAD": str(lib)}
    assert machine.cpu_engine_env("cuda") == {}
    monkeypatch.setenv("LD_PRELOAD", "/x/libfoo.so")
    assert machine.cpu_engine_env("cpu") == {"LD_PRELOAD": f"{lib}:/x/libfoo.so"}  # kept, tcmalloc first
    monkeypatch.setenv("LD_PRELOAD", "/y/libtcmalloc.so.4")
    assert machine.cpu_engine_env("cpu") == {}  # already preloaded: left as it is
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv("EAGLE3RAY_CPU_PRELOAD", "off")
    assert machine.cpu_engine_env("cpu") == {}
    monkeypatch.setattr(machine, "TCMALLOC_PATHS", ("/nonexistent/libtcmalloc_minimal.so.4",))
    monkeypatch.delenv("EAGLE3RAY_CPU_PRELOAD")
    assert machine.cpu_engine_env("cpu") == {}  # not installed: nothing to preload


def test_a_process_started_with_that_env_has_tcmalloc_loaded():
    env = machine.cpu_engine_env("cpu")
    if not env:
        import pytest

        pytest.skip("no tcmalloc installed here (scripts/setup.sh installs libtcmalloc-minimal4 where apt-get can)")
    code = "print('libtcmalloc' in open('/proc/self/maps').read())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr


def test_engine_actor_options_carry_resources_and_the_cpu_env(tmp_path, monkeypatch):
    """Regeneration's and validation's engine actors get the same options: the verifier's CPUs/GPUs, and on CPU
    the preload environment."""
    from types import SimpleNamespace

    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(machine, "TCMALLOC_PATHS", (str(lib),))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    cpu = SimpleNamespace(num_cpus=1.5, num_gpus=0, device="cpu")
    assert machine.engine_actor_options(cpu) == {"num_cpus": 1.5, "runtime_env": {"env_vars": {"LD_PRELOAD": str(lib)}}}
    gpu = SimpleNamespace(num_cpus=8, num_gpus=1, device="cuda")
    assert machine.engine_actor_options(gpu) == {"num_cpus": 8, "num_gpus": 1}
