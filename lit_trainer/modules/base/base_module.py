"""Shared base of the lit_trainer LightningModules: model loading, optimizer/scheduler wiring, token-exact
gradient accumulation and step logging.

Token-exact accumulation. Lightning divides every micro-batch loss by ``accumulate_grad_batches`` (N) and DDP
averages gradients over the W ranks, so the optimizer sees the mean of per-micro-batch means. Our training loader
attaches to every micro-batch the number of loss items of its whole optimizer step (``num_items_in_batch``), over the
windows Lightning really steps on (:mod:`lit_trainer.data.windows`: a window cut by ``limit_train_batches``, the
epoch's short last window, the current N of a ``GradientAccumulationScheduler``); the first micro-batch of each
window all-reduces it over ranks (one collective per optimizer step). A subclass returns ``sum(item losses) /
global_count`` for its micro-batch, and the base returns that times ``N * W`` to Lightning, cancelling both divisions:
the step's gradient is exactly the full-batch mean gradient. A count may be a vector (DPO: pairs and chosen tokens).
A normaliser known only at the window's last micro-batch (GRPO's completion tokens when a step spans generation
rounds) goes through :meth:`BaseModule.rescale_step_gradients` instead. ``docs/exactness.md`` lists what is exact.

Logging over the window of ``log_every_n_steps`` optimizer steps is the mixin
:class:`~lit_trainer.modules.base._step_logging.StepLoggingMixin`; the default optimizer, schedule and gradient clipping
are :class:`~lit_trainer.modules.base._optimization.OptimizationMixin`.
"""

from __future__ import annotations

import copy
import inspect
from functools import partial
from typing import Any, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics import Metric
from transformers import PreTrainedModel
from typing_extensions import override

from lit_trainer import quantization as quantized
from lit_trainer.core import sharding as _sharding
from lit_trainer.data.loader import NUM_ITEMS_KEY, TrainLoader
from lit_trainer.data.vision.collate import image_inputs
from lit_trainer.data.windows import step_windows
from lit_trainer.metrics import ValidationMetrics
from lit_trainer.models import Task, load_model, load_tokenizer
from lit_trainer.modules.base import _adapter_checkpoint, _logits, _peft, _positions, _vision_tower
from lit_trainer.modules.base._logits import ChunkedLogits
from lit_trainer.modules.base._optimization import TORCH_OPTIMS, OptimizationMixin, OptimName, check_optim
from lit_trainer.modules.base._schedules import SchedulerName, check_schedule
from lit_trainer.modules.base._step_logging import StepLoggingMixin


def _check_quantized_has_adapter(model: Any, peft_config: Any, adapter_path: str | None, by_us: bool) -> None:
    if peft_config is None and adapter_path is None:
        other = "remove `quantization`" if by_us else "pass the model unquantized"
        raise ValueError(
            f"The base model is quantized ({type(model).__name__} with bitsandbytes weights) but no adapter is "
            "given: quantized weights are packed integers that cannot take gradients or optimizer updates, so "
            "full fine-tuning of a quantized model is impossible. Add `peft_config` (e.g. {r: 16, lora_alpha: 32, "
            f"target_modules: all-linear}}) to train LoRA adapters on the quantized base (QLoRA), or {other} to "
            "fine-tune every weight."
        )


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An in-memory, eval-mode, gradient-free copy of ``model`` (the DPO/GRPO reference model)."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref


class BaseModule(StepLoggingMixin, OptimizationMixin, pl.LightningModule):
    """Base LightningModule for causal-LM training recipes.

    Validation metrics take one path: a subclass adds torchmetrics to ``self.val_metrics`` (a
    :class:`~lit_trainer.metrics.ValidationMetrics`) in ``__init__``, e.g. ``self.val_metrics.add("loss",
    MeanMetric())``, and updates them in ``validation_step`` (``self.val_metrics["loss"].update(value,
    weight=count)``); it writes no ``on_validation_epoch_end``. At the end of each validation the base computes every
    metric updated since the last validation (reduced over ranks), passes ``{"val_<name>": value}`` through
    :meth:`finalize_val_metrics` (derived values, e.g. a perplexity), resets them and logs the result.

    Args:
        model: a preset name (``"tiny"``), a local directory, a hub id, or a ``PreTrainedModel`` from Python.
        tokenizer: a tokenizer object (default: loaded from ``model`` when it is a string); used for export and
            generation.
        trust_remote_code: passed to ``from_pretrained``; False unless you set it.
        optimizer: an ``OptimizerCallable`` (``params -> Optimizer``) from the CLI; default AdamW with
            ``learning_rate``/``weight_decay`` (no decay on biases and norms, as HF), using torch's fused kernel when
            every parameter supports it (as HF's default ``adamw_torch_fused``; see
            :func:`~lit_trainer.modules.base._optimization.fused_adamw_supported`).
        optim: the default optimizer, by the HF Trainer's names: ``"adamw_torch_fused"`` (torch's AdamW, fused kernel
            where every parameter supports it), ``"adamw_torch"`` (torch's AdamW, unfused), ``"adamw_8bit"`` (AdamW
            from bitsandbytes with 8-bit state; embeddings keep 32-bit state, as in the HF Trainer),
            ``"paged_adamw_8bit"``/``"paged_adamw_32bit"`` (paged state on CUDA: spilled to CPU memory under memory
            pressure; on a CPU they behave as unpaged). The bitsandbytes ones need ``pip install "lit_trainer[qlora]"``;
            see :mod:`lit_trainer.modules.base._optimization`. Ignored by a custom ``optimizer`` (giving both with a
            non-default ``optim`` is refused).
        lr_scheduler: an ``LRSchedulerCallable`` (``optimizer -> scheduler``), stepped per optimizer step; default:
            transformers' ``scheduler`` over ``trainer.estimated_stepping_batches`` optimizer steps.
        learning_rate: peak learning rate of the default optimizer.
        weight_decay: weight decay of the default optimizer.
        warmup_steps: warmup length in optimizer steps, or a fraction (< 1) of the total steps (rounded up), as HF.
        scheduler: a ``TrainingArguments.lr_scheduler_type`` name (``linear``, the default as in transformers and
            TRL, ``cosine``, ``cosine_with_min_lr``, ``warmup_stable_decay``, ...; see
            :mod:`lit_trainer.modules.base._schedules`), built with ``transformers.get_scheduler``: the same rate per
            step as the HF Trainer.
        scheduler_kwargs: the scheduler's extra arguments (HF's ``lr_scheduler_kwargs``), e.g. ``{"min_lr_rate":
            0.1}`` for ``cosine_with_min_lr`` (what ``min_lr_ratio`` did before) or ``{"num_decay_steps": 100}`` for
            ``warmup_stable_decay``.
        max_grad_norm: gradient clipping by global norm when the Trainer sets no ``gradient_clip_val`` (HF's default
            1.0); None or 0 disables clipping (the norm is still logged).
        peft_config: train adapters instead of all weights (needs ``pip install "lit_trainer[peft]"``): a
            ``peft.LoraConfig`` (any ``peft.PeftConfig``), or a mapping such as ``{r: 16, lora_alpha: 32,
            target_modules: all-linear}`` (``LoraConfig(**mapping)``; with a ``peft_type`` key,
            ``peft.get_peft_config``). The model is wrapped here; checkpoints then hold only the trainable weights
            (see :mod:`lit_trainer.modules.base._peft` and :mod:`lit_trainer.modules.base._adapter_checkpoint`).
            Under ``ModelParallelStrategy`` the wrapped model is then sharded: adapters over a sharded, frozen base.
        adapter_path: start from a saved adapter (trainable) instead of a new one; exclusive with ``peft_config``.
        train_vision_tower: for a vision-language model, train its vision tower too. False (default): the tower is
            frozen (full fine-tuning and peft) and a ``peft_config``'s adapters go to the language model only, the
            projector training fully (peft's ``modules_to_save``, unless the config sets that itself). True: full
            fine-tuning trains every weight, and under peft the tower gets adapters where ``target_modules`` match its
            layers (see :mod:`lit_trainer.modules.base._vision_tower`). True on a text-only model is refused.
        quantization: QLoRA: load the base quantized with bitsandbytes (``"nf4"``, ``"fp4"``, ``"int8"`` or the
            arguments of ``transformers.BitsAndBytesConfig``; see :mod:`lit_trainer.quantization`) and prepare it for
            k-bit training (peft's ``prepare_model_for_kbit_training``). Needs ``peft_config`` or ``adapter_path``
            (quantized weights cannot be trained) and ``pip install "lit_trainer[qlora]"``. A model given as an object
            is used as loaded: quantize it with ``from_pretrained(..., quantization_config=...)``. One device or DDP;
            refused under ``ModelParallelStrategy`` (docs/sharding.md).
        gradient_checkpointing: recompute activations in the backward pass (transformers' activation checkpointing,
            non-reentrant): less activation memory, about one more forward of compute. Works under sharding too.
        shard_blocks: under ``ModelParallelStrategy``: class names of the transformer blocks sharded one by one
            (default: the model's ``_no_split_modules``); see :mod:`lit_trainer.core.sharding`.
        shard_param_dtype: under ``ModelParallelStrategy``: compute dtype of the gathered parameters (FSDP2 mixed
            precision: e.g. ``bfloat16`` on GPU, gradients reduced in float32, sharded master weights stay float32);
            None keeps the parameters' dtype.
        shard_cpu_offload: under ``ModelParallelStrategy``: keep sharded parameters, gradients and optimizer state
            on the CPU (FSDP2 ``CPUOffloadPolicy``; the optimizer step then runs on the CPU). Needs a GPU: FSDP2
            refuses it on a CPU-only machine.
        chunked_logits: ``"auto"`` (default), ``"on"`` or ``"off"``: compute the per-token log-probabilities (and
            entropies) of the loss and of validation from the last hidden states a chunk of tokens at a time, so the
            ``batch x length x vocabulary`` logits never exist at once, forward or backward
            (:mod:`lit_trainer.modules.base._logits`). ``"auto"`` does so for vocabularies of 32,000 tokens or more
            when the model's head allows it; ``"on"`` raises for a model whose head does not; results equal the
            full-logits path to float rounding.
        logits_chunk_size: tokens per chunk of the chunked path (default: about 64 MiB of float32 logits per chunk).

    Raises:
        ValueError: on a negative learning rate, warmup or ``max_grad_norm``, a scheduler option that does not fit
            (see :func:`~lit_trainer.modules.base._schedules.check_schedule`), or a ``peft_config``/``adapter_path``
            of another task type than the module's (``CAUSAL_LM``; ``SEQ_CLS`` for the reward module); at setup, a
            data row longer than a learned position table (:mod:`~lit_trainer.modules.base._positions`).
    """

    def __init__(
        self,
        model: str | PreTrainedModel = "tiny",
        *,
        tokenizer: Any = None,
        trust_remote_code: bool = False,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        optim: OptimName = "adamw_torch_fused",
        learning_rate: float = 5e-5,
        weight_decay: float = 0.0,
        warmup_steps: int | float = 0,
        scheduler: SchedulerName = "linear",
        scheduler_kwargs: dict[str, Any] | None = None,
        max_grad_norm: float | None = 1.0,
        peft_config: Any = None,
        adapter_path: str | None = None,
        train_vision_tower: bool = False,
        quantization: Any = None,
        gradient_checkpointing: bool = False,
        shard_blocks: list[str] | None = None,
        shard_param_dtype: _sharding.ParamDtype | None = None,
        shard_cpu_offload: bool = False,
        chunked_logits: ChunkedLogits = "auto",
        logits_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        task_type = _peft.TASK_TYPES[self.model_task]  # CAUSAL_LM, SEQ_CLS for the reward module
        self._peft_hparam = _peft.config_hparam(peft_config, task_type)
        self._quantization_hparam = quantized.hparam(quantization)
        if quantization is not None:
            quantized.as_bnb_config(quantization)  # a bad value fails here, before anything is loaded
        check_optim(optim, optimizer)
        for name, value in (("learning_rate", learning_rate), ("weight_decay", weight_decay)):
            if value < 0:
                raise ValueError(f"`{name}={value}` is invalid: it must be >= 0.")
        if max_grad_norm is not None and max_grad_norm < 0:
            raise ValueError(f"`max_grad_norm={max_grad_norm}` is invalid: use a positive norm, or 0/None to disable.")
        check_schedule(scheduler, warmup_steps, scheduler_kwargs)
        if chunked_logits not in get_args(ChunkedLogits) or (logits_chunk_size is not None and logits_chunk_size < 1):
            raise ValueError(
                f"`chunked_logits={chunked_logits!r}, logits_chunk_size={logits_chunk_size!r}` is invalid: choose "
                f"chunked_logits from {get_args(ChunkedLogits)} and a chunk size >= 1 tokens (or None)."
            )
        _sharding.fsdp_policies(shard_param_dtype, False)  # validates the dtype name at construction
        self.save_hyperparameters(ignore=["model", "tokenizer", "optimizer", "lr_scheduler"])
        self.model_name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        by_name = isinstance(model, str)
        if not by_name and quantization is not None:
            raise ValueError(
                f"`quantization={quantization!r}` applies to a model given by name or path; a {type(model).__name__} "
                "object is used as it was loaded. Quantize it when you load it: "
                "`from_pretrained(path, quantization_config=BitsAndBytesConfig(...))`, or pass the path."
            )
        self.model = (
            load_model(model, task=self.model_task, trust_remote_code=trust_remote_code, quantization=quantization)
            if by_name
            else model
        )
        # from_pretrained returns eval-mode models and Lightning 2.6 keeps each submodule's mode: train the policy in
        # train mode (dropout on), as the HF Trainer does
        self.model.train()
        if quantized.is_quantized(self.model) and not _peft.is_peft_model(self.model):  # (a PeftModel given as an
            # object already has its adapter and was prepared by whoever wrapped it)
            _check_quantized_has_adapter(self.model, peft_config, adapter_path, by_us=quantization is not None)
            self.model = quantized.prepare_for_training(self.model, gradient_checkpointing)
            rank_zero_info(f"[lit_trainer] quantized base: {quantized.describe(self.model)}")
        if gradient_checkpointing:
            _peft.enable_gradient_checkpointing(self.model)
        self._vision = _vision_tower.check_option(self.model, train_vision_tower)
        if self._vision and peft_config is not None and not _peft.is_peft_model(self.model):
            config = _peft.as_peft_config(peft_config, task_type)
            peft_config = _vision_tower.adapt_peft_config(self.model, config, train_vision_tower)
        if peft_config is not None or adapter_path is not None:
            self.model = _peft.wrap_model(self.model, peft_config, adapter_path, self.uses_reference_adapter, task_type)
            self.strict_loading = False  # checkpoints hold only the trainable weights (_adapter_checkpoint)
        if self._vision and not train_vision_tower:
            _vision_tower.freeze_tower(self.model)
        elif self._vision and self.is_peft:
            _vision_tower.check_tower_trains(self.model)
        self._frozen_fingerprint: dict[str, Any] | None = None
        self.parameter_counts: tuple[int, int] | None = None
        if tokenizer is None and by_name:
            tokenizer = load_tokenizer(model, trust_remote_code=trust_remote_code)
        self.tokenizer = tokenizer
        self._optimizer_fn = optimizer
        self._shard_options = (shard_blocks, shard_param_dtype, shard_cpu_offload)
        self._scheduler_fn = lr_scheduler
        self._window_items: Tensor | None = None
        self._window_key: tuple[int, int] | None = None
        self._step_loss: Tensor | float = 0.0
        self._pending_rescale: Tensor | None = None
        self._warned_no_items = False
        self._last_global_step = 0
        self._step_lr: float | None = None
        self._reset_log_window()
        self.val_metrics = ValidationMetrics()

    #: DPO/GRPO: load ``adapter_path`` a second time as the frozen reference adapter
    uses_reference_adapter = False

    def score_tokens(self, model: Any, targets: Tensor, **options: Any) -> _logits.TokenScores:
        """Per-token scores of ``model`` for ``targets`` (:func:`~lit_trainer.modules.base._logits.score_tokens`),
        chunked or not as ``chunked_logits`` says for this model; ``options`` are the scores asked and the model
        inputs."""
        chunked = _logits.wants_chunked(model, self.hparams.get("chunked_logits", "auto"))
        size = self.hparams.get("logits_chunk_size")
        return _logits.score_tokens(model, targets, chunked=chunked, chunk_size=size, **options)

    #: what a model name or path is loaded as (:func:`~lit_trainer.models.load_model`'s ``task``)
    model_task: Task = "causal_lm"

    @override
    def save_hyperparameters(self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True) -> None:
        """Lightning's, with ``peft_config`` stored as a plain mapping (a config object would make checkpoints
        unloadable with ``weights_only=True``)."""
        ignore = [ignore] if isinstance(ignore, str) else list(ignore or [])
        frame = frame or inspect.currentframe().f_back
        plain = {"peft_config": getattr(self, "_peft_hparam", None)}
        plain["quantization"] = getattr(self, "_quantization_hparam", None)
        super().save_hyperparameters(*args, ignore=[*ignore, *plain], frame=frame, logger=logger)
        for name, value in plain.items():
            if value is not None:
                self._hparams[name] = value
                self._hparams_initial[name] = copy.deepcopy(value)  # what loggers record

    @property
    def is_quantized(self) -> bool:
        """Whether the base model's weights are bitsandbytes-quantized (``quantization``, or a quantized model)."""
        return quantized.is_quantized(self.model)

    @property
    def is_peft(self) -> bool:
        """Whether ``self.model`` is wrapped by peft (``peft_config`` or ``adapter_path``)."""
        return _peft.is_peft_model(self.model)

    def default_reference(self) -> Any:
        """The reference model DPO/GRPO use when none is given: the policy with its adapters disabled under peft
        (:class:`~lit_trainer.modules.base._peft.AdapterReference`, no copy), else a frozen in-memory copy."""
        return _peft.reference_or_copy(self.model, frozen_copy)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.is_peft:  # adapter-only checkpoints
            self._frozen_fingerprint = _adapter_checkpoint.drop_frozen(self, checkpoint, self._frozen_fingerprint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.is_peft:
            _adapter_checkpoint.check_frozen(self, checkpoint)

    # --------------------------------------------------------------------------------------------- subclass API
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Return ``(loss, metrics)`` for one micro-batch.

        ``loss`` must be ``sum of item losses / num_items_in_batch`` when the count is given (the global count of the
        optimizer step's micro-batches over all ranks: a 0-dim tensor, or one entry per count when the data module's
        ``count_items`` returns several), or the micro-batch mean when it is None. ``metrics`` are detached 0-dim
        tensors, averaged over the micro-steps of the logging window and over ranks.
        """
        raise NotImplementedError

    def finalize_val_metrics(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        """Turn the computed validation values (``{"val_<name>": value}``, already reduced over ranks) into the logged
        ones: add derived values, drop helper entries. Default: unchanged."""
        return values

    @override
    def on_validation_epoch_end(self) -> None:
        """The one validation-metrics path: compute ``self.val_metrics`` (each metric updated since the last reset,
        reduced over ranks by torchmetrics), :meth:`finalize_val_metrics`, reset, log."""
        values = self.finalize_val_metrics(self.val_metrics.compute())
        self.val_metrics.reset()
        if values:
            self.log_dict(values, prog_bar=False)

    # ---------------------------------------------------------------------------------------- accumulation core
    def step_window(self, batch_idx: int) -> tuple[int, int]:
        """``(start, stop)`` epoch indices of the micro-batches of ``batch_idx``'s optimizer step (see
        :mod:`lit_trainer.data.windows`)."""
        return step_windows(self.trainer).bounds(batch_idx)

    def _enter_window(self, batch_idx: int) -> bool:
        """True on the first micro-batch this run trains of an optimizer step; resets the per-step state."""
        key = (self.trainer.current_epoch, self.step_window(batch_idx)[0])
        if key == self._window_key:
            return False
        self._window_key, self._step_loss = key, 0.0
        return True

    def _global_num_items(self, local: Tensor | None, new_window: bool) -> Tensor | None:
        if local is None:
            if not self._warned_no_items and self.trainer.accumulate_grad_batches * self.trainer.world_size > 1:
                rank_zero_warn(
                    "[lit_trainer] The training batches carry no `num_items_in_batch`: each micro-batch is "
                    "normalised by its own size, which is NOT token-exact under gradient accumulation or "
                    "DDP. Train with a lit_trainer data module, or wrap your dataset in "
                    "`lit_trainer.data.loader.TrainLoader(..., count_items=...)`."
                )
                self._warned_no_items = True
            return None
        if new_window or self._window_items is None:
            count = local.to(self.device, torch.float32)
            self._window_items = (
                self.trainer.strategy.reduce(count, reduce_op="sum") if self.trainer.world_size > 1 else count
            )
        return self._window_items

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        new_window = self._enter_window(batch_idx)
        num_items = self._global_num_items(batch.pop(NUM_ITEMS_KEY, None), new_window)
        image_free = self._vision and not image_inputs(batch) and not any("pixel_values" in k for k in batch)
        loss, metrics = self.compute_loss(batch, num_items)
        scale = self.trainer.accumulate_grad_batches * self.trainer.world_size
        contribution = loss if num_items is not None else loss / scale
        self._track(contribution.detach(), metrics, batch)
        if image_free and (zero := _vision_tower.image_free_term(self.model)) is not None:
            contribution = contribution + zero  # exactly 0: every rank runs the vision path (_vision_tower)
        return contribution * scale

    def rescale_step_gradients(self, factor: Tensor) -> None:
        """Multiply the optimizer step's accumulated gradients by ``factor`` right after this micro-batch's backward.

        For a normaliser only known at a step's last micro-batch: its micro-batches divide by a provisional count
        ``P``, and the last one calls this with ``P / exact count`` (the same factor on every rank). Gradients are
        linear in the normaliser, so the step's gradient is then exact; hooks and clipping see the rescaled
        gradients, and the logged step loss is rescaled the same way. Single-device, DDP and ``ModelParallelStrategy``
        (FSDP2 keeps the reduced gradient shards as DTensors in ``param.grad``) only; DeepSpeed keeps them elsewhere.
        """
        strategy = type(self.trainer.strategy).__name__
        if not _sharding.has_local_grads(self.trainer.strategy):
            raise ValueError(
                f"A step normaliser known only at the step's end needs the gradients in `param.grad`; "
                f"{strategy} keeps them elsewhere. Use one of {_sharding.LOCAL_GRAD_STRATEGIES}."
            )
        self._pending_rescale = factor.detach()
        self._log_loss = self._log_loss + (factor.detach() - 1.0) * self._step_loss

    @override
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        super().backward(loss, *args, **kwargs)
        if self._pending_rescale is not None:
            factor, self._pending_rescale = self._pending_rescale, None
            grads = [_sharding.local(p.grad) for p in self.parameters() if p.grad is not None]
            if grads:  # FSDP2: every rank scales its own shards (the factor is the same on every rank)
                torch._foreach_mul_(grads, factor.to(grads[0].device, grads[0].dtype))

    # ------------------------------------------------------------------------------------------- training start
    @override
    def on_fit_start(self) -> None:
        # ``trainer.validate()`` runs under ``torch.inference_mode``: the metric states it reset are inference tensors,
        # which validation during ``fit`` (under ``no_grad``) cannot update in place. Fresh states, made here.
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.reset()

    @override
    def on_train_start(self) -> None:
        # the step counter may start above 0 (resume): a change of it marks an optimizer step
        self._last_global_step = self.trainer.global_step
        if self.is_peft:
            _peft.check_strategy(self.trainer.strategy)
        self.parameter_counts = _peft.log_parameter_counts(self.model)
        if self._vision:
            _vision_tower.log_vision_parts(self.model)
        self._reset_log_window()
        self._bind_train_loaders()

    def _bind_train_loaders(self) -> None:
        """Give a ``TrainLoader`` built without a window source (passed directly to ``fit``) the trainer's windows."""

        def bind(loader: TrainLoader) -> None:
            if loader.windows is None:
                loader.windows = partial(step_windows, self.trainer)

        apply_to_collection(self.trainer.train_dataloader, TrainLoader, bind)

    # ------------------------------------------------------------------------------------------------- sharding
    @override
    def setup(self, stage: str) -> None:
        """Refuse strategies under which a feature would be silently dropped (see :func:`_sharding.check_strategy`);
        name sequences longer than the model's positions (:mod:`~lit_trainer.modules.base._positions`)."""
        _sharding.check_strategy(self.trainer, self.hparams.max_grad_norm)
        self.check_low_bit_strategy()
        _positions.check_module_positions(self)

    def check_low_bit_strategy(self) -> None:
        """Refuse a quantized base or a bitsandbytes optimizer under sharding (``ModelParallelStrategy``): FSDP2 would
        shard the packed 4-bit weights as plain uint8 tensors, losing the quantization constants that live beside them,
        and bitsandbytes' optimizers update whole local tensors, not DTensor shards (docs/sharding.md says what sharded
        QLoRA needs). One device and DDP are tested.

        Raises:
            ValueError: naming the strategy and the fix.
        """
        if not _sharding.strategy_is(self.trainer.strategy, ("ModelParallelStrategy",)):
            return
        what = []
        if self.is_quantized:
            what.append("a quantized base (`quantization`)")
        if self.hparams.get("optim", "adamw_torch_fused") not in TORCH_OPTIMS:
            what.append(f"a bitsandbytes optimizer (`optim={self.hparams.optim!r}`)")
        if what:
            raise ValueError(
                f"{' and '.join(what)} cannot be sharded with ModelParallelStrategy (FSDP2): FSDP2 would split the "
                "packed quantized weights without their quantization constants, and bitsandbytes updates whole "
                "tensors, not shards. Use one device or strategy='ddp' (each rank holds the quantized base, which "
                "is what makes QLoRA small), or shard an unquantized base with optim='adamw_torch_fused'."
            )

    def sequence_budget(self, longest_row: int, positions: int) -> tuple[int, str, str]:
        """``(tokens, what, fix)``: the longest sequence the model sees when the data's longest row has
        ``longest_row`` tokens, a sentence naming it, and the fix (GRPO adds its completions)."""
        return _positions.row_budget(longest_row, positions)

    @override
    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (``self.device_mesh`` set): FSDP2-shard :meth:`networks_to_shard` over the
        data-parallel ranks (:mod:`lit_trainer.core.sharding`); nothing otherwise."""
        if self.device_mesh is None:
            return
        mesh = _sharding.data_parallel_mesh(self.device_mesh)
        blocks, dtype, offload = self._shard_options
        policies = _sharding.fsdp_policies(dtype, offload)
        for network in self.networks_to_shard():
            if not _sharding.is_sharded(network):
                names = _sharding.block_class_names(network, blocks)
                if blocks is None and _vision_tower.is_vision_model(network):  # the tower goes with the root group
                    names = names - _vision_tower.tower_block_classes(network) or names
                _sharding.shard_model(network, mesh, names, **policies)
        # peft: the distributed checkpoint holds the adapters only (see :meth:`state_dict`)
        self._adapter_only_state = self.is_peft

    #: set by ``configure_model`` for a sharded peft model: :meth:`state_dict` leaves the frozen parameters out
    _adapter_only_state = False

    @override
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """``nn.Module.state_dict``; for a sharded peft model without the frozen parameters (the base, a frozen
        reference adapter). ``ModelParallelStrategy`` saves and loads distributed checkpoints through this state dict
        (torch's ``get_model_state_dict``), so its checkpoints hold the adapters only, as one-device and DDP ones do
        (:mod:`lit_trainer.modules.base._adapter_checkpoint`). The full weights stay reachable through
        ``self.model``."""
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self._adapter_only_state:
            state = _adapter_checkpoint.trainable_state(self, state, prefix)
        return state

    def networks_to_shard(self) -> list[torch.nn.Module]:
        """The networks ``configure_model`` shards: the policy and a reference network (DPO/GRPO ``ref_model``)."""
        reference = getattr(self, "ref_model", None)
        return [m for m in (self.model, reference) if isinstance(m, torch.nn.Module)]
