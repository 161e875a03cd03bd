"""A guarded fix for vLLM's CPU rejection sampler at temperature > 0 (vLLM issue #55005).

Without a Triton CPU backend, vLLM (``vllm/platforms/cpu.py: register_triton_kernel_overrides``) swaps the
rejection sampler's ``expand_kernel`` for a C++ stand-in, ``vllm.utils.cpu_triton_utils._expand_kernel_impl``.
The stand-in passes ``_ensure_int64(output)`` to C++: for the float32 temperature buffer (and the int32 top-k
buffer) that is a new int64 copy, which C++ fills and Python then drops. The expanded per-token temperature
that divides the verifier's logits in ``apply_sampling_constraints`` is therefore uninitialised memory, and
acceptance at T > 0 collapses (the default run's draft: 1.0026 at k=3, T=0.7). T = 0 is unaffected: the
all-greedy path returns before the expansion. Fix proposed upstream in vLLM PR #55006.

What this module does, only where the broken stand-in is active:

- :func:`stand_in_status` runs the stand-in on a 3-element probe and says whether it drops its output;
- :func:`apply` replaces ``cpu_triton_utils._expand_kernel_impl`` with :func:`expand_kernel_impl` (torch,
  same contract as vLLM's Triton ``expand_kernel``) before vLLM registers its overrides, and re-registers it
  if vLLM already did. Where Triton is present, the platform is not CPU, or the stand-in works (fixed
  upstream), it changes nothing and says why.

It runs in every engine eagle3ray starts (``serving_engine.ServingEngine``) and, as a vLLM general plugin
(entry point ``vllm.general_plugins: eagle3ray_cpu_expand_fix``), in any vLLM process of this venv, such as
``vllm serve`` with the exported draft. ``VLLM_PLUGINS`` can leave the plugin out; the engines still apply it.
Evidence: ``scripts/repro_vllm_cpu_expand.py`` (vLLM's own functions on synthetic logits, before and after).
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"

APPLIED = "applied"
NOT_NEEDED_TRITON = "not needed: Triton has a CPU backend here, vLLM runs its own kernel"
NOT_NEEDED_PLATFORM = "not needed: vLLM's platform is not CPU"
NOT_NEEDED_WORKS = "not needed: vLLM's CPU stand-in expands correctly (fixed upstream)"

_state: dict[str, str] = {}


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """Write ``input_val[i]`` (with ``replace_from`` replaced by ``replace_to``) to request i's token slots.

    The contract of vLLM's Triton ``expand_kernel`` (``vllm/v1/sample/rejection_sampler.py``), for any dtype.

    Args:
        output: [num_tokens] tensor, written in place (float32 temperatures/top-p or int32 top-k).
        input_val: [batch_size] per-request values, same dtype family as ``output``.
        cu_num_tokens: [batch_size] cumulative token counts (int32 or int64); the last is num_tokens.
        replace_from, replace_to: a value to substitute (vLLM replaces the greedy temperature -1 by 1).
        MAX_NUM_TOKENS: the Triton launch constant; unused.
    """
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(vals, counts, output_size=n).to(output.dtype))


def stand_in_status() -> str:
    """One of ``"broken"``, :data:`NOT_NEEDED_TRITON`, :data:`NOT_NEEDED_PLATFORM`, :data:`NOT_NEEDED_WORKS`.

    ``"broken"``: vLLM's C++ stand-in, run on float32 [0.5, 2.0] expanded to 2 + 1 tokens, leaves the output
    untouched (vLLM #55005). Costs one import of vLLM's CPU ops and a 3-element call.
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return NOT_NEEDED_TRITON
    if not current_platform.is_cpu():
        return NOT_NEEDED_PLATFORM
    import torch
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.utils import cpu_triton_utils as cpu_tl

    stand_in = getattr(cpu_tl, "_original_expand_kernel_impl", cpu_tl._expand_kernel_impl)
    out = torch.full((3,), -1.0)
    stand_in(out, torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32), 0, 0)
    return NOT_NEEDED_WORKS if torch.equal(out, torch.tensor([0.5, 0.5, 2.0])) else "broken"


def apply() -> str:
    """Install :func:`expand_kernel_impl` where vLLM's CPU stand-in is broken; idempotent, per process.

    Returns :data:`APPLIED` or the ``not needed`` reason. Call it before the engine is built; if vLLM has
    already registered its CPU overrides in this process, the kernel is re-registered (vLLM logs a warning).
    """
    if "status" in _state:
        return _state["status"]
    status = stand_in_status()
    if status == "broken":
        from vllm.triton_utils import dispatcher
        from vllm.utils import cpu_triton_utils as cpu_tl

        cpu_tl._original_expand_kernel_impl = cpu_tl._expand_kernel_impl
        cpu_tl._expand_kernel_impl = expand_kernel_impl
        if KERNEL in dispatcher._registry:
            dispatcher.register_kernels({KERNEL: expand_kernel_impl})
        status = APPLIED
        log.info("vLLM CPU rejection sampler: expand_kernel stand-in replaced (vLLM #55005)")
    _state["status"] = status
    return status


def register() -> None:
    """vLLM general-plugin entry point: :func:`apply`, never raising (a plugin must not stop vLLM)."""
    try:
        apply()
    except Exception as e:  # pragma: no cover - defensive: report, let vLLM start
        log.warning("eagle3ray CPU expand fix not applied: %s", e)
