"""2-process DDP (gloo) vision-language SFT on ``tiny-vl``: the step gradients equal the one-process full-batch ones.

Usage: python ddp_vision.py OUT_DIR. 16 chat rows with 0, 1 or 2 images each (so the ranks' micro-batches hold
different numbers of images, and one rank's micro-batch holds none: the blank-image path that keeps DDP's reduction
in step); per-device batch 2, accumulate 2, 2 optimizer steps at learning rate 0 (the weights stay the initial ones,
so each step's gradient is comparable with a full-batch gradient of the same weights). Each rank writes
``rank<k>.pt``: the gradient before each optimizer step, the input ids of every micro-batch and its image count.

Also the shared builders of the vision runs (the rows, the data module, the model, the FSDP2 case), imported by
``tests/test_vision_training.py``, ``tests/scripts/fsdp_train.py`` and ``tests/test_fsdp.py``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# images per row. Under 2-rank DDP with per-device batch 2, rank r's micro-batch m holds rows 4m+2r and 4m+2r+1: its
# images are rank 0: 3, 2 | 0, 1 and rank 1: 1, 0 | 3, 3 (optimizer step 1 | step 2): an image-free micro-batch ends
# rank 1's first window (the one whose backward all-reduces) and starts rank 0's second
IMAGE_COUNTS = [1, 2, 0, 1, 2, 0, 0, 0, 0, 0, 2, 1, 0, 1, 1, 2]


def vision_rows(count: int = 16) -> Any:
    """``count`` chat rows ``{"images", "messages"}``: a question whose text length varies, the answer a digit."""
    from datasets import Dataset

    from lit_trainer.data.builtin_shapes import draw

    rows = []
    for i in range(count):
        images = [draw([((i * 3 + k * 5) % 16, "red"), ((i + 7 * k) % 16, "blue")]) for k in range(IMAGE_COUNTS[i])]
        question = "How many red squares?" + " Count them." * (i % 3)
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": str(i % 5)}]
        rows.append({"images": images, "messages": messages})
    return Dataset.from_list(rows)


def vision_datamodule(batch_size: int, count: int = 16, **kwargs: Any) -> Any:
    from lit_trainer.data.sft import SFTDataModule

    options = {"val_size": 0, "sampling": "sequential", "max_length": 96, **kwargs}
    return SFTDataModule(tokenizer="tiny-vl", dataset=vision_rows(count), batch_size=batch_size, **options)


def vision_model(seed: int = 0) -> Any:
    """``tiny-vl`` with the weights of ``seed``."""
    import torch

    from lit_trainer.models import build_vision_preset

    torch.manual_seed(seed)
    return build_vision_preset()


def fsdp_run(strategy: Any, devices: int, batch_size: int, precision: str = "32-true") -> dict[str, Any]:
    """LoRA vision SFT for 2 optimizer steps of 2 micro-batches (the tower frozen, the projector fully trained, with
    gradient checkpointing), for ``tests/scripts/fsdp_train.py`` (2 ranks, ``ModelParallelStrategy``) and its
    one-process references in ``tests/test_fsdp.py``. Returns the trainable weights after the fit and before it, and
    the parameter types of the tower's encoder layers."""
    import _fsdp_common as common  # tests/scripts

    from lit_trainer.modules.causal_lm import CausalLMModule

    lora = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    module = CausalLMModule(vision_model(), peft_config=lora, learning_rate=1e-2, gradient_checkpointing=True)
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters() if n in trainable}
    common.trainer(strategy, devices, 2, [], precision=precision).fit(module, datamodule=vision_datamodule(batch_size))
    weights = common.full_weights(module)
    layers = [p for n, p in module.model.named_parameters() if "vision_tower.encoder.layers" in n]
    return {
        "weights": {n: w for n, w in weights.items() if n in trainable},
        "initial": initial,
        "tower_types": {type(p).__name__ for p in layers},
    }


if __name__ == "__main__":
    import lightning.pytorch as pl
    import torch

    from helpers.accumulation import GradCapture
    from lit_trainer.modules.causal_lm import CausalLMModule

    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    module = CausalLMModule(vision_model(), learning_rate=0.0, max_grad_norm=None)
    capture, seen = GradCapture(), []

    class Recorder(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            images = batch["pixel_values"].shape[0] if "pixel_values" in batch else 0
            seen.append((batch["input_ids"].clone(), images))

    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=2,
        accumulate_grad_batches=2,
        callbacks=[capture, Recorder()],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=vision_datamodule(2))
    torch.save({"grads": capture.grads, "seen": seen}, os.path.join(out_dir, f"rank{trainer.global_rank}.pt"))
