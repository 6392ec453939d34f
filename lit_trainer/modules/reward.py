"""RewardModule: train a Bradley-Terry reward model on preference pairs (TRL 1.16 ``RewardTrainer`` semantics)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torchmetrics import MaxMetric, MeanMetric, MinMetric
from transformers import PreTrainedModel
from typing_extensions import override

from lit_trainer.data.preference.collate import MARGIN_KEY
from lit_trainer.data.vision.collate import image_inputs
from lit_trainer.losses.reward import reward_loss, reward_metrics
from lit_trainer.modules.base import BaseModule
from lit_trainer.modules.base._packing import datamodule_packing
from lit_trainer.modules.reference import disable_dropout_in_model

__all__ = ["METRIC_NAMES", "RewardModule"]

#: logged in training (window means) and validation (``val_`` prefix, over the whole set)
METRIC_NAMES = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward", "chosen_reward", "rejected_reward")
_PAIR_MEANS = ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward")


class RewardModule(BaseModule):
    """Train a reward model on preference pairs: a sequence classifier with one output, Bradley-Terry loss.

    The model is ``AutoModelForSequenceClassification`` with ``num_labels=1`` (a preset gets a score head; a causal-LM
    export, e.g. an SFT run's ``hf_model``, gets a new, randomly initialised one). Its reward for a row is the score
    at the row's last non-padding token (transformers' own pooling; ``config.pad_token_id`` is set to the data's
    padding id). Batches are those of :class:`~lit_trainer.data.PreferenceDataModule`: the B chosen rows
    (prompt + chosen) then the B rejected rows (prompt + rejected), in one forward of 2B rows; for conversational
    data, the chat template of the whole conversation, as TRL feeds it. The loss
    (:func:`~lit_trainer.losses.reward_loss`) is ``−log σ(r_c − r_r − m) + c · (r_c + r_r)²`` per pair, with the
    data's ``margin`` column as ``m`` when it has one and ``c = center_rewards_coefficient``.

    Accumulation and ranks: the per-pair losses are summed and divided by the number of pairs of the whole optimizer
    step (every micro-batch, every rank; the data module's first count), so the step's gradient is the gradient of
    the mean over all its pairs, as one batch holding them would give, also for a short last window. With one
    micro-batch on one device this is TRL's loss.

    Logged in training (means over the logging window's micro-batches and ranks): ``accuracy`` (``r_c > r_r``),
    ``margin`` (``mean(r_c − r_r)``), ``mean_reward``, ``min_reward``, ``max_reward`` (TRL's names) and
    ``chosen_reward``/``rejected_reward``; validation logs the same with a ``val_`` prefix, over the whole
    validation set (streaming torchmetrics: the minimum and maximum are the set's), plus ``val_loss``.

    Packing is refused: the score is read at one position per row, so a padding-free row of 2B sequences would give
    one score instead of 2B. Runs on one device, under DDP, or sharded under ``ModelParallelStrategy`` (FSDP2); with
    ``peft_config`` (LoRA, ``task_type="SEQ_CLS"``, the default here) the score head is trained in full and saved
    with the adapter (peft's ``modules_to_save``).

    Args:
        model: preset name (a new reward model), a local directory or hub id (a sequence classifier, or a causal LM
            that gets a new score head), or a ``PreTrainedModel`` with ``num_labels=1``.
        center_rewards_coefficient: ``c`` of the centring term (TRL's; recommended 0.01), None for none.
        disable_dropout: zero every dropout of the model (TRL's default).
        learning_rate: peak learning rate (TRL's ``RewardConfig`` default 1e-4).
        trust_remote_code: passed to ``from_pretrained``.
        **kwargs: optimizer, scheduler, LoRA, sharding and checkpointing options of
            :class:`~lit_trainer.modules.base.BaseModule`; ``peft_config`` without a ``task_type`` gets
            ``"SEQ_CLS"``.

    Raises:
        ValueError: a model without exactly one output (``num_labels != 1``), a negative
            ``center_rewards_coefficient``, a ``peft_config`` of another task type; at setup, a packing data module.

    Example::

        module = RewardModule("tiny", learning_rate=1e-3)
        trainer = lightning.Trainer(max_steps=300)
        trainer.fit(module, datamodule=PreferenceDataModule("tiny", batch_size=64, max_length=32))
    """

    RUN_NAME: ClassVar[str] = "reward"  # the run folder `lit-trainer fit` uses without --run_name

    model_task = "sequence_classification"

    def __init__(
        self,
        model: str | PreTrainedModel = "tiny",
        *,
        center_rewards_coefficient: float | None = None,
        disable_dropout: bool = True,
        learning_rate: float = 1e-4,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> None:
        if center_rewards_coefficient is not None and center_rewards_coefficient < 0:
            raise ValueError(
                f"`RewardModule(center_rewards_coefficient={center_rewards_coefficient})` is invalid: use a "
                "coefficient >= 0 (0.01 is the recommended value), or None for no centring term."
            )
        super().__init__(model, learning_rate=learning_rate, trust_remote_code=trust_remote_code, **kwargs)
        labels = getattr(self.model.config, "num_labels", None)
        if labels != 1:
            raise ValueError(
                f"RewardModule needs a model with one output (num_labels=1), but "
                f"{type(self.model).__name__} has num_labels={labels}: pass a name or path (it is loaded as "
                "a sequence classifier with num_labels=1), or build the model with num_labels=1."
            )
        if disable_dropout:
            disable_dropout_in_model(self.model)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None and self.tokenizer is not None:
            pad = self.tokenizer.eos_token_id
        if pad is not None:
            self.text_config.pad_token_id = pad
        for name in _PAIR_MEANS:
            self.val_metrics.add(name, MeanMetric())
        self.val_metrics.add("mean_reward", MeanMetric())
        self.val_metrics.add("min_reward", MinMetric())
        self.val_metrics.add("max_reward", MaxMetric())

    @property
    def text_config(self) -> Any:
        """The model's (text) config, which holds the ``pad_token_id`` the score is located with."""
        return self.model.config.get_text_config()

    # --------------------------------------------------------------------------------------------- forward and loss
    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The ``(N,)`` rewards of ``N`` right-padded rows (the score at each row's last non-padding token)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.squeeze(-1)

    def rewards(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``(chosen, rejected)`` rewards ``(B,)`` of a preference batch (chosen rows first, then rejected).

        Raises:
            ValueError: for a packed batch (see the class docstring), or a batch with images.
        """
        if image_inputs(batch):  # a sequence classifier's forward here takes token ids only
            raise ValueError(
                "RewardModule does not take preference rows with images: its sequence-classification forward passes no "
                "pixel values, so the pictures would be dropped. Drop the image column, or train DPOModule on them."
            )
        if "seq_lengths" in batch:
            raise ValueError(
                "RewardModule got a packed (padding-free) batch: a sequence classifier reads one score per row, "
                "so the packed sequences would share one reward. Use packing='none' in the data module."
            )
        rewards = self(batch["input_ids"], batch["attention_mask"])
        return torch.chunk(rewards, 2)

    def pair_losses(self, batch: dict[str, Tensor], chosen: Tensor, rejected: Tensor) -> Tensor:
        """``(B,)`` per-pair losses (:func:`~lit_trainer.losses.reward_loss` with the batch's margins, if any)."""
        return reward_loss(
            chosen,
            rejected,
            margin=batch.get(MARGIN_KEY),
            center_rewards_coefficient=self.hparams.center_rewards_coefficient,
        )

    @override
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Sum of the per-pair losses over the step's global pair count (the first count), or their mean."""
        chosen, rejected = self.rewards(batch)
        losses = self.pair_losses(batch, chosen, rejected)
        pairs = losses.numel() if num_items_in_batch is None else num_items_in_batch.reshape(-1)[0]
        return losses.sum() / pairs, reward_metrics(chosen, rejected)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        chosen, rejected = self.rewards(batch)
        pairs = chosen.numel()
        values = reward_metrics(chosen, rejected)
        values["loss"] = self.pair_losses(batch, chosen, rejected).mean()
        for name in _PAIR_MEANS:
            self.val_metrics[name].update(values[name], weight=pairs)
        self.val_metrics["mean_reward"].update(values["mean_reward"], weight=2 * pairs)
        self.val_metrics["min_reward"].update(values["min_reward"])
        self.val_metrics["max_reward"].update(values["max_reward"])

    # ------------------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        packing = datamodule_packing(self.trainer)
        if packing != "none":
            raise ValueError(
                f"RewardModule does not support packing={packing!r}: a sequence classifier reads its score at one "
                "position per row (the last non-padding token), so packed sequences cannot each get a reward. Set "
                "the data module's packing='none' (pairs of a reward model are scored on right-padded rows)."
            )
        datamodule = getattr(self.trainer, "datamodule", None)
        pad = getattr(datamodule, "pad_token_id", None) if datamodule is not None else None
        if isinstance(pad, int) and pad != self.text_config.pad_token_id:
            rank_zero_info(
                f"[lit_trainer] RewardModule: model pad_token_id {self.text_config.pad_token_id} -> {pad} (the data "
                "module's padding id), so each score is read at the row's last real token."
            )
            self.text_config.pad_token_id = pad
        stats = getattr(datamodule, "stats", {}) or {}
        truncated = {k: v for k, v in stats.items() if k.endswith("_rows_truncated") and v}
        if truncated:
            rank_zero_warn(
                f"[lit_trainer] RewardModule: {truncated} preference rows were cut to max_length, so their reward "
                "is read at a cut position. TRL's RewardTrainer drops such pairs instead: set the data module's "
                "truncation_mode='drop' (or raise max_length)."
            )
