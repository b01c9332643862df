"""Model tests as GPU projects write them, without a line of cleanup code.

Every test is marked ``gpu``: each runs in a fresh spawned child, on its own device.
"""

from __future__ import annotations

import filler
import pytest
import runners

import spawnrun

MAX_TOKENS = 8
needs_cuda = pytest.mark.skipif(
    "not __import__('torch').cuda.is_available()", reason="needs a CUDA device"
)


@pytest.mark.gpu
def test_transformers_greedy_is_reproducible(hf_runner, model_dir, example_prompts):
    hf = hf_runner(model_dir)
    ids = hf.encode(example_prompts)
    first = hf.generate_greedy(ids, MAX_TOKENS)
    assert first == hf.generate_greedy(ids, MAX_TOKENS)
    assert all(len(tokens) == MAX_TOKENS for tokens in first)


@pytest.mark.gpu
def test_vllm_matches_transformers(vllm_runner, model_dir, example_prompts):
    # Two heavy phases in one test: transformers in a child of its own (everything it
    # held is gone when the call returns), then vLLM in this test's process.
    prompt_ids, expected = spawnrun.call(runners.hf_greedy, model_dir, example_prompts, MAX_TOKENS)
    vllm = vllm_runner(model_dir)
    assert vllm.generate_greedy(prompt_ids, MAX_TOKENS) == expected


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("turn", ["first", "second"])
def test_a_model_that_fills_the_device(turn, record_property):
    # Run twice in a row: each gets the whole device, though neither frees anything.
    figures = filler.fill_device(0.8)
    for name, value in figures.items():
        record_property(name, round(value, 2))
    assert figures["free_gib_at_start"] >= 0.9 * figures["total_gib"]
    assert figures["model_gib"] >= 0.7 * figures["total_gib"]


@pytest.mark.gpu
@needs_cuda
def test_a_phase_in_a_call_gives_its_memory_back(record_property):
    import torch

    figures = spawnrun.call(filler.fill_device, 0.8)
    free, total = torch.cuda.mem_get_info()
    record_property("call_model_gib", round(figures["model_gib"], 2))
    record_property("free_gib_after_call", round(free / filler.GIB, 2))
    assert figures["model_gib"] >= 0.7 * figures["total_gib"]
    assert free >= 0.9 * total
