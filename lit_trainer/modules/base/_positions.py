"""Sequences longer than the model's positions, named at setup (before the first step), from the data's longest row.

What the model sees as one sequence is known once the data module is set up: its longest tokenized row (the data
modules record each row's length; a packed bin counts row by row, since positions restart at every row), plus
``max_completion_length`` for GRPO, whose completions continue the prompts. Compared with the model config's
``max_position_embeddings`` (the text config of a multimodal model):

* **Refused** when the model has a learned table of absolute positions (an embedding of ``max_position_embeddings``
  rows besides the token embeddings: GPT-2's ``wpe``, OPT's positions with their offset of 2). A longer sequence
  indexes past the table: "index out of range" on the CPU, a device-side assert on a GPU, at the first batch that
  holds such a row, possibly hours into training.
* **Warned** otherwise (rotary positions, as Llama, Qwen and the presets; ALiBi). Nothing fails: rotary positions are
  computed for any index, and a model trained from scratch on longer rows (as the recipes' tiny presets) learns them.
  But a pretrained model's outputs past the context it was trained for are unreliable, and the config's number is the
  only record of that context, so the user hears it once and decides.

* **Silent** when every layer attends through a sliding window no wider than the positions (Mistral's
  ``sliding_window`` without full-attention layers): no query then reaches a key farther than the window, so the
  relative distances stay within what the model was trained on, however long the sequence. A model whose config has
  no ``max_position_embeddings`` (no limit, e.g. ALiBi's BLOOM) is silent too.

The setting alone (``max_length``) is not compared: a limit above the positions that no row reaches changes nothing.
Modules that generate (GRPO, RLOO, distillation) count the longest prompt plus the generation budget
(``sequence_budget``), so a budget past the positions is named before the first round, not minutes into it.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

#: an absolute-position table may have a few more rows than the positions (OPT's offset of 2)
_TABLE_SLACK = 2


def max_positions(model: Any) -> int | None:
    """The model config's ``max_position_embeddings`` (of its text config when it has one); None when it has none."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def position_table(model: torch.nn.Module, positions: int) -> str | None:
    """The name of the model's learned table of absolute positions (an ``nn.Embedding`` other than the token
    embeddings with ``positions`` to ``positions + 2`` rows), or None when it has none (rotary or ALiBi positions)."""
    try:
        tokens = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        tokens = None
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.Embedding)
            and module is not tokens
            and positions <= module.num_embeddings <= positions + _TABLE_SLACK
        ):
            return name
    return None


def slides_everywhere(model: Any, positions: int) -> bool:
    """Whether every attention layer of the model uses a sliding window of at most ``positions`` tokens (its config's
    ``sliding_window``, with no ``layer_types`` entry other than ``"sliding_attention"``)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or not 0 < window <= positions:
        return False
    layer_types = getattr(config, "layer_types", None)
    return not layer_types or all(kind == "sliding_attention" for kind in layer_types)


def check_positions(model: torch.nn.Module, tokens: int, what: str, fix: str) -> None:
    """Refuse or warn (module docstring) when a sequence of ``tokens`` tokens passes the model's positions.

    Args:
        model: the policy (a peft wrapper is looked through).
        tokens: the longest sequence the model will see.
        what: the sentence that names it, e.g. ``"CausalLMModule: the longest row of the data has 600 tokens"``.
        fix: what to change, starting with a verb (``"set the data module's max_length to at most 512"``).

    Raises:
        ValueError: past a learned position table.
    """
    positions = max_positions(model)
    if positions is None or tokens <= positions:
        return
    head = f"{what}, beyond the model's max_position_embeddings={positions}"
    table = position_table(model, positions)
    if table is None and slides_everywhere(model, positions):
        return
    if table is not None:
        raise ValueError(
            f"{head}. The model has a learned table of {positions} positions ({table}), so a longer sequence fails "
            f"with 'index out of range' (on a GPU, a device-side assert) in the middle of training: {fix}."
        )
    rank_zero_warn(
        f"[lit_trainer] {head}. The model's positions are not a learned table (rotary, as Llama's), so it runs, but "
        f"past the context it was trained for a pretrained model's outputs are unreliable: {fix}, or raise "
        "`config.max_position_embeddings` if the model was trained on longer sequences."
    )


def row_budget(longest_row: int, positions: int) -> tuple[int, str, str]:
    """``(tokens, what, fix)`` when the model sees each data row as one sequence (SFT, DPO, reward models)."""
    return (
        longest_row,
        f"the longest row of the data has {longest_row} tokens",
        f"set the data module's `max_length` to at most {positions} (no row is then longer)",
    )


def check_module_positions(module: Any) -> None:
    """:func:`check_positions` of a module's policy for the data module it is fitted with (nothing without one, or
    for a data module without ``longest_row``), with the module's ``sequence_budget``."""
    datamodule = getattr(module.trainer, "datamodule", None)
    longest = datamodule.longest_row() if callable(getattr(datamodule, "longest_row", None)) else None
    positions = max_positions(module.model)
    if longest is None or positions is None:
        return
    tokens, what, fix = module.sequence_budget(longest, positions)
    check_positions(module.model, tokens, f"{type(module).__name__}: {what}", fix)
