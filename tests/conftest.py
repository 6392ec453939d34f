"""Shared fixtures: tiny models and tokenizers built from a config (nothing is downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, int(os.environ.get("LIT_TRAINER_TEST_THREADS", "1"))))


def tiny_llama(seed: int = 0, hidden: int = 32, layers: int = 1, dropout: float = 0.0):
    """A very small Llama with the ByT5 vocabulary (384 ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=384, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         attention_dropout=dropout)
    return LlamaForCausalLM(config)


@pytest.fixture
def tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()
