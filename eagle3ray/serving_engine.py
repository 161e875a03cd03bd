"""Serving with vLLM, with or without an EAGLE-3 draft, and vLLM's own speculative-decoding counters.

:class:`ServingEngine` is plain Python (hosted in a Ray actor by the validate stage and the tests):
it loads ``vllm.LLM`` for the verifier, optionally with
``speculative_config={"method": "eagle3", "model": draft_dir, "num_speculative_tokens": k}``, decodes
prompts (token ids) and reads the counters vLLM exposes through ``LLM.get_metrics()``:
``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_accepted_tokens_per_pos``.

Mean acceptance length = 1 + accepted / drafts (the bonus token counts, as in vLLM's
``SpecDecodingMetrics`` logs); acceptance rate at position i = accepted_per_pos[i] / drafts.
"""

from __future__ import annotations

import os
import time


def cpu_engine_options(device: str, tensor_parallel_size: int, cpu_threads: int | None = None) -> dict:
    """vLLM ``LLM(...)`` options that run a generation engine's core and its one worker in this process (CPU, TP 1).

    vLLM V1 otherwise starts an engine-core process and a worker process that poll each other; on a
    2-core machine they compete with the model for the cores. ``benchmarks/engine_startup.py`` (SmolLM2-135M
    fp32, 40 prompts x 64 tokens, medians of 2): ``LLM()`` 4.4 s instead of 20.6 s, generation 6.4 s
    instead of 9.9 s (README "Measured"). Used by validation's engines, the dedicated regeneration
    engine and the verifier's extraction engine (which needs
    :meth:`eagle3ray.verifier.VerifierEngine._write_pending_states` in-process). GPUs and tensor
    parallelism keep vLLM's processes (they overlap scheduling with the device).

    Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in this process unless the user set it, and torch's thread
    count to ``cpu_threads`` (default: every core in this process's affinity, as vLLM's CPU worker
    process binds by default). Ray starts an actor with ``OMP_NUM_THREADS`` = its ``num_cpus`` (1 here):
    in such an actor one thread decoded 64 x 16 tokens in 23.3 s, two in 11.7 s. Call before ``LLM()``
    is built.

    Returns:
        extra keyword arguments for ``vllm.LLM`` (empty when nothing changes).
    """
    if device != "cpu" or tensor_parallel_size != 1:
        return {}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        return {}
    import torch

    torch.set_num_threads(cpu_threads or len(os.sched_getaffinity(0)))
    return {"distributed_executor_backend": "uni"}


def engine_threads(engine_options: dict) -> int | None:
    """The torch thread count an in-process CPU engine was built with (None for vLLM's processes)."""
    if engine_options.get("distributed_executor_backend") != "uni":
        return None
    import torch

    return torch.get_num_threads()


def pin_threads(n: int | None) -> None:
    """Set torch's thread count in the *calling* thread before an in-process engine runs.

    OpenMP's thread count is per calling thread, and Ray Serve runs a replica's sync methods in a
    thread pool, not the thread that built the engine: vLLM's CPU attention then fails its check
    that the metadata's thread count equals the running one (``1 vs. 2``). vLLM's CPU worker replaces
    ``torch.set_num_threads`` by a no-op once it has bound its threads, so this calls torch's own setter.
    """
    if n:
        import torch

        torch._C.set_num_threads(n)


class ServingEngine:
    """vLLM engine for generation; ``draft_dir=None`` decodes without speculation.

    Args:
        model_path: verifier folder. dtype/max_model_len/enforce_eager as for the verifier.
        draft_dir: exported speculators-format draft folder, or None.
        num_speculative_tokens: k, draft tokens proposed per step.
    """

    def __init__(self, model_path: str, draft_dir: str | None = None, num_speculative_tokens: int = 3,
                 dtype: str = "float32", max_model_len: int = 2048, enforce_eager: bool = True,
                 max_num_seqs: int = 64, seed: int = 0, cpu_kv_cache_gib: float = 2.0,
                 gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1, device: str = "cpu",
                 cpu_threads: int | None = None):
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, cpu_kv_cache_gib))))
        from vllm import LLM

        from .vllm_cpu_fixes import apply as apply_cpu_fix

        try:  # before LLM(): the sampler's kernels are registered when its worker starts
            self.cpu_fix = apply_cpu_fix()
        except Exception as e:  # noqa: BLE001 - reported; validation refuses T > 0 on it
            self.cpu_fix = f"failed: {type(e).__name__}: {e}"

        kwargs = dict(model=model_path, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
                      max_num_seqs=max_num_seqs, seed=seed, tensor_parallel_size=tensor_parallel_size,
                      disable_log_stats=False)  # get_metrics() needs stat logging
        if device == "cuda":
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if draft_dir:
            kwargs["speculative_config"] = {"method": "eagle3", "model": draft_dir,
                                            "num_speculative_tokens": num_speculative_tokens}
            # each finished request carries its own histogram of accepted drafts (acceptance by category)
            kwargs["per_request_spec_decode_metrics"] = "summary"
        opts = cpu_engine_options(device, tensor_parallel_size, cpu_threads)
        kwargs.update(opts)
        self._threads = engine_threads(opts)
        t0 = time.time()
        self.llm = LLM(**kwargs)
        self.load_seconds = time.time() - t0
        self.k = num_speculative_tokens if draft_dir else 0

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> dict:
        """Decode ``prompts`` (token ids) at ``temperature`` (0 = greedy), ``max_new_tokens`` each.

        Returns:
            {"outputs": [[token ids]], "texts": [...], "seconds" (wall time of the whole batch), "output_tokens",
            "accept_histograms": [[drafts that had j of k tokens accepted, j = 0..k] per request] (a draft
            engine; [] without one)}: vLLM's per-request ``RequestSpecDecodeMetrics`` summary, whose sums
            over the requests equal :meth:`spec_counters`' increments (the validate stage checks it).
        """
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed)
        pin_threads(self._threads)
        t0 = time.time()
        outs = self.llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], sp, use_tqdm=False)
        dt = time.time() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        hists = []
        if self.k:
            for o in outs:
                m = o.outputs[0].spec_decode_metrics
                hists.append(list(m.histogram) if m is not None else [0] * (self.k + 1))
        return {"outputs": ids, "texts": [o.outputs[0].text for o in outs], "seconds": dt,
                "output_tokens": sum(len(i) for i in ids), "accept_histograms": hists}

    def cpu_fix_status(self) -> str:
        """What :func:`eagle3ray.vllm_cpu_fixes.apply` did in this engine's process (``applied``,
        ``not needed: ...`` or ``failed: ...``)."""
        return self.cpu_fix

    def spec_counters(self) -> dict:
        """vLLM's spec-decode counters: drafts, draft_tokens, accepted, accepted_per_pos (list)."""
        out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * self.k}
        for m in self.llm.get_metrics():
            name = m.name
            if name == "vllm:spec_decode_num_drafts":
                out["drafts"] = int(m.value)
            elif name == "vllm:spec_decode_num_draft_tokens":
                out["draft_tokens"] = int(m.value)
            elif name == "vllm:spec_decode_num_accepted_tokens":
                out["accepted"] = int(m.value)
            elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                vals = list(getattr(m, "values", []))
                out["accepted_per_pos"] = [int(v) for v in vals]
        return out


def counters_delta(after: dict, before: dict) -> dict:
    """``after - before`` of two :meth:`ServingEngine.spec_counters` readings (one generate call's counts)."""
    return {"drafts": after["drafts"] - before["drafts"], "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"],
            "accepted_per_pos": [a - b for a, b in zip(after["accepted_per_pos"],
                                                       before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"]))]}


def histogram_counters(histograms: list[list[int]], k: int) -> dict:
    """Counters in :meth:`ServingEngine.spec_counters`' form from per-request acceptance histograms.

    ``histograms[r][j]``: request r's drafts with exactly j of k draft tokens accepted. Acceptance stops at the
    first rejected token (vLLM's rejection sampler), so position i (0-based) was accepted in every draft with
    j > i: ``accepted_per_pos[i] = sum_{j > i} h[j]``; ``accepted = sum_j j h[j]``; ``drafts = sum_j h[j]``.
    ``draft_tokens`` is k per draft (vLLM's own count can be lower where a request ends mid-draft).
    """
    h = [sum(col) for col in zip(*histograms)] if histograms else [0] * (k + 1)
    return {"drafts": sum(h), "draft_tokens": k * sum(h), "accepted": sum(j * c for j, c in enumerate(h)),
            "accepted_per_pos": [sum(h[i + 1:]) for i in range(k)]}


def acceptance(counters: dict) -> dict:
    """Mean acceptance length (1 + accepted/drafts) and acceptance rate per position from vLLM counters."""
    d = counters["drafts"]
    return {
        "mean_acceptance_length": 1.0 + counters["accepted"] / d if d else 1.0,
        "acceptance_per_position": [a / d if d else 0.0 for a in counters["accepted_per_pos"]],
        "num_drafts": d, "num_draft_tokens": counters["draft_tokens"], "num_accepted_tokens": counters["accepted"],
    }
