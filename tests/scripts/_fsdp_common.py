"""Shared by the sharded (FSDP2) scripts and tests: data, trainers and recorders, identical in 1 and 2 processes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from datasets import Dataset

from helpers.models import tiny_llama
from lit_trainer.core import sharding as _sharding

# 16 rows of uneven length: per-device batch 2 x 2 ranks x accumulate 2 = 8 rows per optimizer step (2 per epoch)
TEXTS = [
    ("short " if i % 3 else "a much longer row of text with many more tokens in it ") * (1 + i % 4) for i in range(16)
]
STEPS, ACCUMULATE, MAX_GRAD_NORM = 20, 2, 0.05
DPO_STEPS = 10


def sft_datamodule(tokenizer: Any, batch_size: int, val_size: int = 0) -> Any:
    from lit_trainer.data.sft import SFTDataModule

    return SFTDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict({"text": TEXTS}),
        val_size=val_size,
        batch_size=batch_size,
        max_length=64,
        sampling="sequential",
    )


def dpo_datamodule(tokenizer: Any, batch_size: int) -> Any:
    from lit_trainer.data import builtin
    from lit_trainer.data.preference import PreferenceDataModule

    return PreferenceDataModule(
        tokenizer=tokenizer,
        dataset=builtin.preference_rows("train").select(range(16)),
        val_size=0,
        batch_size=batch_size,
        max_length=32,
        sampling="sequential",
    )


def model_parallel(devices: int = 2) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)


def trainer(strategy: Any, devices: int, max_steps: int, callbacks: list, **kwargs: Any) -> pl.Trainer:
    options = {"limit_val_batches": 0, "enable_checkpointing": False, "accumulate_grad_batches": ACCUMULATE, **kwargs}
    return pl.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **options,
    )


def full_weights(module: pl.LightningModule, attribute: str = "model") -> dict[str, torch.Tensor]:
    """The policy's (or another network's) full weights on every rank (a collective under sharding)."""
    network = getattr(module, attribute)
    return {n: _sharding.full(p.detach()).clone().cpu() for n, p in network.named_parameters()}


class ClipRecorder(pl.Callback):
    """Records, per optimizer step, the module's pre-clipping norm and the norm of the gradients the optimizer stepped
    with (read at the step's end, before the next window zeroes them), and that norm computed in float64: how far a
    float32 norm of these gradients lands from the exact one (the clipping check's calibration)."""

    def __init__(self) -> None:
        self.pre: list[float] = []
        self.post: list[float] = []
        self.post64: list[float] = []
        self._step = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == self._step:
            return
        self._step = trainer.global_step
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.post.append(float(_sharding.full(torch.nn.utils.get_total_norm(grads))))
        self.post64.append(float(_sharding.full(torch.nn.utils.get_total_norm([g.double() for g in grads]))))
        self.pre.append(float(pl_module._grad_norm))


def kto_datamodule(tokenizer: Any, batch_size: int) -> Any:
    """16 thumbs-up/down rows: 8 addition problems, each with its correct sum and a near miss."""
    from lit_trainer.data import builtin
    from lit_trainer.data.unpaired import UnpairedPreferenceDataModule, unpair_rows

    rows = unpair_rows(builtin.preference_rows("train").select(range(8))).shuffle(seed=0)
    return UnpairedPreferenceDataModule(
        tokenizer=tokenizer, dataset=rows, val_size=0, batch_size=batch_size, max_length=32, sampling="sequential"
    )


def kto_module(tokenizer: Any) -> Any:
    """KTO with ``apo_zero_unpaired``: no KL estimate, whose mismatched partners are chunked by the per-rank batch size
    (so a one-process run with the same global batch pairs other rows); the sharded policy and reference are what is
    compared here (the KL estimate over ranks is tested under DDP)."""
    from lit_trainer.modules.kto import KTOModule

    return KTOModule(
        tiny_llama(seed=2, layers=2),
        tokenizer=tokenizer,
        loss_type="apo_zero_unpaired",
        learning_rate=1e-3,
        beta=0.5,
        max_grad_norm=1.0,
    )


def orpo_module(tokenizer: Any) -> Any:
    from lit_trainer.modules.orpo import ORPOModule

    return ORPOModule(tiny_llama(seed=2, layers=2), tokenizer=tokenizer, learning_rate=1e-3, max_grad_norm=1.0)


def dpo_module(tokenizer: Any) -> Any:
    from lit_trainer.modules.dpo import DPOModule

    return DPOModule(
        tiny_llama(seed=2, layers=2),
        tokenizer=tokenizer,
        loss_type=["sigmoid", "sft"],
        learning_rate=1e-3,
        beta=0.1,
        max_grad_norm=1.0,
    )


def grpo_run(
    strategy: Any,
    precision: str = "32-true",
    steps: int = 4,
    accumulate: int = ACCUMULATE,
    module_class: str = "GRPOModule",
    **module_kwargs: Any,
) -> tuple[Any, list[int], ClipRecorder, dict[str, torch.Tensor]]:
    """GRPO, 2 ranks, ``steps`` optimizer steps; steps_per_generation 3 with accumulate 2 (a step spans two rounds,
    so the step's token count is only known at its end: the gradient-rescale path), by default with ``sync_ref_model``
    and ``top_entropy_quantile`` (the synced sharded reference and the entropy pool gathered over ranks). Returns the
    module and, per round, the longest completion this rank kept (they differ between ranks), the clipping record and
    the initial trainable weights. ``precision="64-true"``: the same run in float64, the calibration of the float32
    comparisons (``tests/helpers/rounding.py``). ``accumulate``: micro-batches per optimizer step. ``module_class``:
    ``"GRPOModule"`` or ``"RLOOModule"`` (the same rollouts, RLOO's advantages and loss; it has no entropy pool).
    ``module_kwargs`` go to the module (e.g. ``peft_config``)."""
    import transformers
    from ddp_grpo import build_model, length_reward, prompt_texts

    import lit_trainer
    from lit_trainer.data.prompt import PromptDataModule

    tokenizer = transformers.ByT5Tokenizer()
    model = build_model()
    with torch.no_grad():
        model.lm_head.bias[1] = 7.0  # EOS likely: each rank's longest completion varies round by round
    grpo = module_class == "GRPOModule"
    module = getattr(lit_trainer, module_class)(
        model,
        tokenizer=tokenizer,
        reward_funcs=[length_reward],
        num_generations=6,
        steps_per_generation=3,
        max_completion_length=12,
        learning_rate=1e-2,
        scheduler="constant",
        beta=0.04,
        max_grad_norm=1.0,
        generation_seed=0,
        **{
            "sync_ref_model": "peft_config" not in module_kwargs,  # TR-DPO on the sharded reference (not under LoRA:
            "ref_model_sync_steps": 2,  # its reference is the base); mixed after step 2, used by round 3's KL
            **({"top_entropy_quantile": 0.5} if grpo else {}),  # GRPO's entropy pool is gathered over ranks (RLOO
            # has no entropy options)
            **module_kwargs,
        },
    )
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    longest: list[int] = []
    inner = module._score

    def score(batch: dict, completions: Any, *args: Any, **kwargs: Any) -> Any:
        longest.append(int(completions.mask.sum(1).max()))
        return inner(batch, completions, *args, **kwargs)

    module._score = score
    dm = PromptDataModule(
        tokenizer=tokenizer,
        batch_size=3,
        max_length=16,
        val_size=0,
        sampling="sequential",
        dataset=Dataset.from_dict({"prompt": prompt_texts(), "answer": ["0"] * len(prompt_texts())}),
    )
    clip = ClipRecorder()
    fitter = trainer(strategy, 2, steps, [clip], precision=precision, accumulate_grad_batches=accumulate)
    fitter.fit(module, datamodule=dm)
    return module, longest, clip, initial


BEMA_STEPS = 3


class ValLosses(pl.Callback):
    """The ``val_loss`` of every validation during fit."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.state.fn == "fit":
            self.values.append(float(trainer.callback_metrics["val_loss"]))


def dpo_bema() -> Any:
    """BEMA refreshing the DPO reference model (shard by shard under FSDP2)."""
    from lit_trainer.callbacks import BEMA

    return BEMA(update_freq=2, update_ref_model=True, ref_model_update_freq=3, export_hf=False)


def bema_best_run(
    strategy: Callable[[], Any], devices: int, batch_size: int, out: str, precision: str = "32-true"
) -> dict[str, Any]:
    """SFT, one optimizer step per epoch, validated after each with the BEMA weights (``evaluate_with_bema``), and
    ``BestCheckpoint(load_best_at_end=True)`` keeping the scored weights. Returns (on every rank): the full BEMA
    weights, the BEMA export's folder, the validation losses, the best score and path, the module's full weights
    after fit, ``val_loss`` of a validation after fit, the BEMA weights after a state_dict round trip into a fresh
    callback (full tensors in, this rank's shards cut out, gathered again), and the BEMA weights of a fit resumed
    from the step-2 checkpoint. ``strategy`` makes a new strategy (one per Trainer); ``precision="64-true"``: the
    same run in float64 (the calibration of the float32 comparisons, ``tests/helpers/rounding.py``)."""
    from transformers import ByT5Tokenizer

    from lit_trainer.callbacks import BEMA, BestCheckpoint
    from lit_trainer.modules.causal_lm import CausalLMModule

    tokenizer = ByT5Tokenizer()
    module = CausalLMModule(tiny_llama(seed=4, layers=2), tokenizer=tokenizer, learning_rate=1e-2)
    bema = BEMA(
        update_freq=1, update_after=1, lag=1.0, evaluate_with_bema=True, export_dir=os.path.join(out, "bema_export")
    )
    best, losses = BestCheckpoint(dirpath=os.path.join(out, "bema_best"), load_best_at_end=True), ValLosses()
    dm = sft_datamodule(tokenizer, batch_size, val_size=8)
    fitter = trainer(
        strategy(),
        devices,
        BEMA_STEPS,
        [bema, best, losses],
        enable_checkpointing=True,
        limit_val_batches=None,
        precision=precision,
    )
    fitter.fit(module, datamodule=dm)
    weights = {k: v.clone().cpu() for k, v in bema.bema_state_dict().items()}
    after_fit = {"model." + k: v for k, v in full_weights(module).items()}
    validated = fitter.validate(module, datamodule=dm, verbose=False)[0]["val_loss"]
    again = BEMA(update_freq=1, update_after=1, lag=1.0, evaluate_with_bema=True)
    again.load_state_dict(bema.state_dict())
    again._attach(fitter, module)
    resumed = BEMA(update_freq=1, update_after=1, lag=1.0, evaluate_with_bema=True, export_hf=False)
    step2 = next(path for path in best.best_k_models if "step=2" in path)
    trainer(strategy(), devices, BEMA_STEPS, [resumed], precision=precision).fit(
        CausalLMModule(tiny_llama(seed=4, layers=2), tokenizer=tokenizer, learning_rate=1e-2),
        datamodule=sft_datamodule(tokenizer, batch_size, val_size=8),
        ckpt_path=step2,
    )
    return {
        "bema": weights,
        "export": bema.export_dir,
        "val_losses": losses.values,
        "best_score": float(best.best_model_score),
        "best_path": best.best_model_path,
        "after_fit": after_fit,
        "validated": float(validated),
        "round_trip": {k: v.clone().cpu() for k, v in again.bema_state_dict().items()},
        "resumed": {k: v.clone().cpu() for k, v in resumed.bema_state_dict().items()},
    }
