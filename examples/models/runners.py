"""Model runners in the style of vLLM's test fixtures: load, generate greedily, nothing else.

No ``close``, no ``del``, no ``gc.collect()``, no ``torch.cuda.empty_cache()``: the
process a runner lives in (a spawned test, or a ``spawnrun.call`` child) ends with its
test, and everything it held goes with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# vLLM's engine talks to its processes on this host.
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class HfRunner:
    """A transformers model on this process's device (``cuda:0`` is the test's own GPU)."""

    def __init__(self, model: str | Path, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers import AutoTokenizer

        self.device = device()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer(p).input_ids for p in prompts]

    def generate_greedy(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy decoding, token by token, never stopping at EOS (as vLLM's ignore_eos)."""
        import torch

        outputs = []
        with torch.no_grad():
            for ids in prompt_ids:
                tokens = torch.tensor([ids], device=self.device)
                for _ in range(max_tokens):
                    logits = self.model(tokens).logits[:, -1, :]
                    tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
                outputs.append(tokens[0, len(ids) :].tolist())
        return outputs


class VllmRunner:
    """A vLLM engine (``LLM``) for the same model, greedy and eager."""

    def __init__(self, model: str | Path, **kwargs: Any) -> None:
        from vllm import LLM

        options: dict[str, Any] = {
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": 256,
            "max_num_seqs": 4,
            "seed": 0,
            # A fixed KV cache: on a CPU vLLM otherwise sizes it from the NUMA node's
            # free memory (gpu_memory_utilization), which a small machine may not have.
            "kv_cache_memory_bytes": 64 * 2**20,
        }
        options.update(kwargs)
        self.llm = LLM(model=str(model), **options)

    def generate_greedy(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompts: list[Any] = [{"prompt_token_ids": ids} for ids in prompt_ids]
        return [list(out.outputs[0].token_ids) for out in self.llm.generate(prompts, params)]


def hf_greedy(
    model: str | Path, prompts: list[str], max_tokens: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and transformers' greedy continuation (for ``spawnrun.call``)."""
    hf = HfRunner(model)
    ids = hf.encode(prompts)
    return ids, hf.generate_greedy(ids, max_tokens)
