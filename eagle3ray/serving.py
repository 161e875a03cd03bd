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


def cpu_engine_options(device: str, tensor_parallel_size: int) -> dict:
    """vLLM ``LLM(...)`` options that run a generation engine's core and its one worker in this process (CPU, TP 1).

    vLLM V1 otherwise starts an engine-core process and a worker process that poll each other; on a
    2-core machine they compete with the model for the cores. ``benchmarks/engine_startup.py`` (SmolLM2-135M
    fp32, 40 prompts x 64 tokens, medians of 2): ``LLM()`` 4.4 s instead of 20.6 s, generation 6.4 s
    instead of 9.9 s (README "Measured"). Used for validation's engines only: the extraction engine
    (``extract_hidden_states`` with its KV connector) hung on its first request in-process, so the
    verifier service keeps vLLM's processes; so do GPUs and tensor parallelism (they overlap
    scheduling with the device). Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in this process unless the
    user set it; call before ``LLM()`` is built.

    Returns:
        extra keyword arguments for ``vllm.LLM`` (empty when nothing changes).
    """
    if device != "cpu" or tensor_parallel_size != 1:
        return {}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        return {}
    return {"distributed_executor_backend": "uni"}


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
                 gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1, device: str = "cpu"):
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, cpu_kv_cache_gib))))
        from vllm import LLM

        kwargs = dict(model=model_path, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
                      max_num_seqs=max_num_seqs, seed=seed, tensor_parallel_size=tensor_parallel_size,
                      disable_log_stats=False)  # get_metrics() needs stat logging
        if device == "cuda":
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if draft_dir:
            kwargs["speculative_config"] = {"method": "eagle3", "model": draft_dir,
                                            "num_speculative_tokens": num_speculative_tokens}
        kwargs.update(cpu_engine_options(device, tensor_parallel_size))
        t0 = time.time()
        self.llm = LLM(**kwargs)
        self.load_seconds = time.time() - t0
        self.k = num_speculative_tokens if draft_dir else 0

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0) -> dict:
        """Decode; returns {"outputs": [[token ids]], "texts": [...], "seconds", "output_tokens"}."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=0)
        t0 = time.time()
        outs = self.llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], sp, use_tqdm=False)
        dt = time.time() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        return {"outputs": ids, "texts": [o.outputs[0].text for o in outs], "seconds": dt,
                "output_tokens": sum(len(i) for i in ids)}

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


def acceptance(counters: dict) -> dict:
    """Mean acceptance length (1 + accepted/drafts) and acceptance rate per position from vLLM counters."""
    d = counters["drafts"]
    return {
        "mean_acceptance_length": 1.0 + counters["accepted"] / d if d else 1.0,
        "acceptance_per_position": [a / d if d else 0.0 for a in counters["accepted_per_pos"]],
        "num_drafts": d, "num_draft_tokens": counters["draft_tokens"], "num_accepted_tokens": counters["accepted"],
    }
