"""Reproduce vLLM #55005 on this machine with vLLM's own sampling functions, then show eagle3ray's fix.

No engine: synthetic verifier logits for N requests with k draft tokens each, the draft proposing the
verifier's argmax at every position (greedy drafting, as vLLM's EAGLE proposer does). Under vLLM's rejection
rule with no draft probabilities, position j is accepted with probability p_T(argmax) at temperature T, and
counted as accepted only if every earlier position was, so the expected acceptance at position j is
mean over requests of prod_{i<=j} p_T,i. The script prints the expanded temperature the sampler divides by,
and acceptance per position (empirical vs expected), with vLLM's CPU stand-in and with
`eagle3ray.vllm_cpu_fixes.apply()`.

    .venv/bin/python scripts/repro_vllm_cpu_expand.py [--temperature 0.7] [--requests 4000]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def metadata(temperature, n):
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((n,), temperature, dtype=torch.float32), all_greedy=False, all_random=True,
        top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def trial(temperature: float, n: int, k: int, vocab: int, seed: int) -> dict:
    """Acceptance per position from vLLM's apply_sampling_constraints + rejection_sample on synthetic logits."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n * k, vocab, generator=g) * 2.0
    draft = logits.argmax(-1).to(torch.int32).contiguous()
    p = torch.softmax(logits / temperature, -1).gather(1, draft.long()[:, None]).view(n, k)
    expected = torch.cumprod(p, 1).mean(0)
    cu = torch.arange(1, n + 1, dtype=torch.int32) * k
    md = metadata(temperature, n)
    expanded = rs.expand_batch_to_tokens(md.temperature, cu, n * k, replace_from=rs.GREEDY_TEMPERATURE, replace_to=1)
    target = rs.apply_sampling_constraints(logits.clone(), cu, md)
    torch.manual_seed(seed)
    out = rs.rejection_sample(draft, [k] * n, k, cu, None, target, torch.zeros(n, 1, dtype=torch.int32), md)
    accepted = (out[:, :k] == draft.view(n, k)).int().cumprod(1).float().mean(0)
    return {"expanded_temperature": expanded[:6].tolist(), "accepted": accepted.tolist(),
            "expected": expected.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=256)
    a = ap.parse_args()
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    from eagle3ray import vllm_cpu_fixes

    print(f"vLLM platform {current_platform.device_type}, HAS_TRITON={HAS_TRITON}; "
          f"stand-in: {vllm_cpu_fixes.stand_in_status()}")
    current_platform.register_triton_kernel_overrides()  # what every vLLM CPU worker does at start
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    for label in ("vLLM as installed", "after eagle3ray.vllm_cpu_fixes.apply()"):
        if label.startswith("after"):
            print(f"apply(): {vllm_cpu_fixes.apply()}")
        r = trial(a.temperature, a.requests, a.k, a.vocab, seed=0)
        print(f"{label}: T={a.temperature}, {a.requests} requests x k={a.k}")
        print(f"  expanded temperature (first 6 tokens): {fmt(r['expanded_temperature'])}")
        print(f"  acceptance per position, vLLM:     {fmt(r['accepted'])}")
        print(f"  acceptance per position, expected: {fmt(r['expected'])}")


if __name__ == "__main__":
    main()
