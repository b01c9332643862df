"""A tiny Llama-style model and tokenizer, built locally (nothing is downloaded).

The same seed gives the same weights on every machine. The tokenizer is a byte-level
BPE trained with the ``tokenizers`` library on a few sentences. ``head_dim`` is 32:
vLLM's CPU attention needs at least that.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

#: Bump when the recipe changes: the built model is cached under this name.
RECIPE = "tiny-llama-v1"

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a small model runs on a small machine",
    "each test starts in a fresh process",
    "hello world from a tiny language model",
    "one two three four five six seven eight nine ten",
    "the cat sat on the mat and the dog sat on the log",
] * 20
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
VOCAB = 512


def model_dir() -> Path:
    """The built model's directory (built once per machine; concurrent callers wait)."""
    root = Path(os.environ.get("TINY_MODEL_ROOT") or tempfile.gettempdir())
    target = root / f"spawnrun-{RECIPE}"
    done = target / "DONE"
    if done.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    with open(root / f"spawnrun-{RECIPE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _build(target)
            done.write_text("ok\n")
    return target


def _build(target: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(target)
    tokenizer.save_pretrained(target)
