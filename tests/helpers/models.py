"""Tiny Llama models built from a config (nothing is downloaded), the size the tests train on CPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


def tiny_llama(
    seed: int | None = 0,
    hidden: int = 32,
    layers: int = 1,
    dropout: float = 0.0,
    *,
    vocab: int = 384,
    heads: int = 2,
    intermediate: int | None = None,
    positions: int = 128,
    tie: bool = True,
    eos_bias: float | None = None,
) -> LlamaForCausalLM:
    """A very small Llama; by default the ByT5 vocabulary (384 ids, pad 0, EOS 1, no BOS) and tied embeddings.

    Args:
        seed: seeds torch's global generator right before the weights are drawn; ``None`` keeps the caller's state.
        hidden, layers, heads, intermediate, positions, vocab, tie: the architecture (``intermediate`` defaults to
            ``2 * hidden``).
        dropout: the attention dropout.
        eos_bias: when given, the output layer gets a bias that is 0 except ``eos_bias`` on EOS (id 1), so sampled
            completions end at varied lengths (3.0: about 10% per token), and ``generate`` pads with 0 and stops at 1.
    """
    from transformers import LlamaConfig, LlamaForCausalLM  # here: importing helpers stays light

    if seed is not None:
        torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=tie,
        max_position_embeddings=positions,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        attention_dropout=dropout,
    )
    model = LlamaForCausalLM(config)
    if eos_bias is not None:
        _add_eos_bias(model, eos_bias)
    return model


def _add_eos_bias(model: LlamaForCausalLM, eos_bias: float) -> None:
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.generation_config.bos_token_id = None
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    head.weight = model.lm_head.weight  # still tied to the input embedding
    with torch.no_grad():
        head.bias.zero_()
        head.bias[1] = eos_bias
    model.lm_head = head
