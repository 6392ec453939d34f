"""CausalLMModule: supervised fine-tuning of a causal LM (the HF Trainer's default loss, token-exact)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import MeanMetric, Metric, MetricCollection
from typing_extensions import override

from lit_trainer.core import sharding as _sharding
from lit_trainer.data.vision.collate import image_inputs
from lit_trainer.losses.causal_lm import causal_lm_loss
from lit_trainer.losses.logprobs import IGNORE_INDEX
from lit_trainer.metrics import greedy_batch_matches, token_loss_and_accuracy
from lit_trainer.modules.base import BaseModule, _logits
from lit_trainer.modules.base._packing import check_trainer_packing

LossFunc = Callable[..., Tensor]


class CausalLMModule(BaseModule):
    """Fine-tune a causal LM on batches of ``input_ids``/``attention_mask``/``labels`` (or packed batches of
    ``input_ids``/``position_ids``/``labels``, see :mod:`lit_trainer.data.packing`).

    The loss is :func:`~lit_trainer.losses.causal_lm_loss` normalised by the accumulation window's global target
    count, so gradient accumulation and DDP give the full-batch token-mean gradient. A user ``compute_loss_func``
    replaces it and then owns normalisation, exactly as the HF Trainer's: it is called as
    ``compute_loss_func(outputs, labels, num_items_in_batch=N)`` with the model outputs (``.logits``), the UNSHIFTED
    labels and ``N`` = target tokens of the whole optimizer step over all ranks (``None`` when the batches do not come
    from a lit_trainer data module); its return value is what gets backpropagated (times the accumulation/world
    factor that cancels Lightning's and DDP's averaging).

    Validation logs ``val_loss`` (global token mean), ``val_perplexity``, ``val_token_accuracy`` and, with
    ``eval_exact_match=True``, ``val_exact_match``: greedy generation of each prompt's completion compared with the
    reference (only rows that have a prompt). ``preprocess_logits_for_metrics(logits, labels) -> Tensor`` and
    ``eval_metrics`` add user metrics, streamed batch by batch (``metric.update(preds, labels)``) instead of
    concatenating logits.

    Args:
        model: preset name, local directory, hub id, or a ``PreTrainedModel``.
        compute_loss_func: optional ``(outputs, labels, num_items_in_batch) -> loss``.
        eval_exact_match: add the greedy exact-match metric (costs a ``generate`` per validation batch).
        eval_max_new_tokens: generation budget of the exact-match metric.
        preprocess_logits_for_metrics: optional ``(logits, labels) -> preds`` applied per validation batch.
        eval_metrics: optional torchmetrics (a ``Metric``, a ``MetricCollection`` or a dict of them) updated with
            ``(preds, labels)``; logged with a ``val_`` prefix.
        learning_rate: peak learning rate (TRL's ``SFTConfig`` default 2e-5).
        **kwargs: optimizer, scheduler and clipping options of :class:`~lit_trainer.modules.base.BaseModule`.

    Example::

        module = CausalLMModule("tiny", learning_rate=1e-3, warmup_steps=50, eval_exact_match=True)
        trainer = lightning.Trainer(max_steps=800, accumulate_grad_batches=1)
        trainer.fit(module, datamodule=SFTDataModule(batch_size=64, max_length=32))
    """

    RUN_NAME: ClassVar[str] = "sft"  # the run folder `lit-trainer fit` uses without --run_name

    def __init__(
        self,
        model: Any = "tiny",
        *,
        compute_loss_func: LossFunc | None = None,
        eval_exact_match: bool = False,
        eval_max_new_tokens: int = 8,
        preprocess_logits_for_metrics: Callable[[Tensor, Tensor], Tensor] | None = None,
        eval_metrics: Metric | MetricCollection | dict[str, Metric] | None = None,
        learning_rate: float = 2e-5,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, learning_rate=learning_rate, **kwargs)
        if eval_max_new_tokens < 1:
            raise ValueError(f"`eval_max_new_tokens={eval_max_new_tokens}` is invalid: it must be >= 1.")
        self.save_hyperparameters(
            ignore=[
                "model",
                "tokenizer",
                "optimizer",
                "lr_scheduler",
                "compute_loss_func",
                "preprocess_logits_for_metrics",
                "eval_metrics",
            ]
        )
        self.compute_loss_func = compute_loss_func
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        for name in ("loss", "token_accuracy", "exact_match"):
            self.val_metrics.add(name, MeanMetric())
        self._user_metrics: str | None = None  # the name of the user's entry in val_metrics
        if eval_metrics is not None:
            if isinstance(eval_metrics, dict):
                eval_metrics = MetricCollection(eval_metrics)
            self._user_metrics = type(eval_metrics).__name__.lower()  # a collection is logged per key
            self.val_metrics.add(self._user_metrics, eval_metrics)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        **images: Tensor,
    ) -> Any:
        """Run the wrapped model (logits only; the loss is computed by the module).

        ``position_ids`` (packed batches: restarting at 0 per row, no ``attention_mask``) are passed on only when
        given, so models without them keep working on padded batches. ``images``: a vision-language batch's image
        inputs (``pixel_values``, ...; :func:`~lit_trainer.data.vision.collate.image_inputs`).
        """
        extra = {"position_ids": position_ids} if position_ids is not None else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra, **images)

    @override
    def setup(self, stage: str) -> None:
        """Refuse a packed data module on a model that cannot keep packed rows apart (a tiny probe forward)."""
        super().setup(stage)
        if stage == "fit":
            check_trainer_packing(self.trainer, self.model)

    @override
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        labels = batch["labels"]
        if self.compute_loss_func is None and self._chunked():
            extra = {"position_ids": batch["position_ids"]} if batch.get("position_ids") is not None else {}
            extra |= image_inputs(batch)
            total = _logits.summed_logps(
                self.model,
                _logits.next_token_targets(labels),
                chunk_size=self.hparams.get("logits_chunk_size"),
                input_ids=batch["input_ids"],
                attention_mask=batch.get("attention_mask"),
                use_cache=False,
                **extra,
            )
            count = (labels[:, 1:] != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
            return -total / torch.as_tensor(count, device=total.device).clamp(min=1), {}
        outputs = self(
            batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"), **image_inputs(batch)
        )
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        else:
            loss = causal_lm_loss(outputs.logits, labels, num_items_in_batch)
        return loss, {}

    def _chunked(self) -> bool:
        return _logits.wants_chunked(self.model, self.hparams.get("chunked_logits", "auto"))

    def _token_scores(self, batch: dict[str, Any], **options: Any) -> _logits.TokenScores:
        """Chunked per-token scores of ``batch`` (log-probs of each position's next label; ``options``: extra ones)."""
        extra = {"position_ids": batch["position_ids"]} if batch.get("position_ids") is not None else {}
        extra |= image_inputs(batch)
        return self.score_tokens(
            self.model,
            _logits.next_token_targets(batch["labels"]),
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            use_cache=False,
            **extra,
            **options,
        )

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        labels = batch["labels"]
        if self._user_metrics is None and self._chunked():
            scores = self._token_scores({k: v for k, v in batch.items() if k != "position_ids"}, with_hits=True)
            count = (labels[:, 1:] != IGNORE_INDEX).sum()
            loss, accuracy = -scores.logps.sum() / count.clamp(min=1), scores.hits.sum() / count.clamp(min=1)
        else:
            outputs = self(batch["input_ids"], batch.get("attention_mask"), **image_inputs(batch))
            loss, accuracy, count = token_loss_and_accuracy(outputs.logits, labels)
        if count:
            self.val_metrics["loss"].update(loss, weight=count)
            self.val_metrics["token_accuracy"].update(accuracy, weight=count)
        if self._user_metrics is not None:
            preds = outputs.logits
            if self.preprocess_logits_for_metrics is not None:
                preds = self.preprocess_logits_for_metrics(outputs.logits, labels)
            self.val_metrics[self._user_metrics].update(preds, labels)
        if self.hparams.eval_exact_match and "prompt_input_ids" in batch:
            matches = self._greedy_matches(batch)
            if matches.numel():
                self.val_metrics["exact_match"].update(matches.float())

    def _greedy_matches(self, batch: dict[str, Any]) -> Tensor:
        config = self.model.generation_config
        return greedy_batch_matches(
            self.model, batch, max_new_tokens=self.hparams.eval_max_new_tokens, pad_token_id=config.pad_token_id,
            eos_token_id=config.eos_token_id, synced_gpus=_sharding.is_sharded(self.model),  # sharded: stop together
            **image_inputs(batch, per_token=False),  # with images, every row has its prompt (vision.collate.stack)
        )  # fmt: skip

    @override
    def finalize_val_metrics(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        """Add ``val_perplexity = exp(val_loss)`` after ``val_loss``."""
        if "val_loss" not in values:
            return values
        return {"val_loss": values["val_loss"], "val_perplexity": torch.exp(values["val_loss"]), **values}
