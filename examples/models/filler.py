"""A transformers model sized to fill most of a GPU (for the memory examples)."""

from __future__ import annotations

GIB = 2**30


def fill_device(fraction: float = 0.8) -> dict[str, float]:
    """Build a bf16 Llama of about ``fraction`` of the device's memory, run it once.

    Returns what the driver said was free before it, the model's size and the peak
    torch reserved. Nothing is freed: the caller's process (a spawned test or a
    ``spawnrun.call`` child) ends with it.
    """
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    free, total = torch.cuda.mem_get_info()
    hidden, inner, kv_heads = 8192, 28672, 8
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * hidden // 8 + 3 * hidden * inner)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=inner,
        num_hidden_layers=max(1, int(fraction * total / per_layer)),
        num_attention_heads=64,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        model(torch.arange(16, device="cuda")[None])
    torch.cuda.synchronize()
    return {
        "total_gib": total / GIB,
        "free_gib_at_start": free / GIB,
        "model_gib": size / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
    }
