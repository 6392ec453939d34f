"""An asynchronous GRPO fit (``max_staleness=1``) that runs until it is stopped from outside, for the shutdown tests
of ``tests/test_grpo_async_shutdown.py``.

Run as ``python grpo_async_fit.py OUT_DIR [slow] [record] [steps=N] [ckpt=PATH] [k=K] [every=E]``: a tiny Llama, 8
prompts, ``max_staleness=K`` (default 1), up to 10,000 optimizer steps (hours; ``steps=N``: N), resumed from ``PATH``
with ``ckpt=PATH``, a checkpoint every ``E`` steps with ``every=E`` (``OUT_DIR/checkpoints/step=S.ckpt``), with
:class:`~lit_trainer.callbacks.JITCheckpoint` handling SIGTERM and SIGINT as the recipes configure it (the default
``kill_wait`` of 3 s for SIGTERM). With ``slow`` the worker samples with :class:`SlowGenerate`, so the trainer spends
nearly all its time waiting for the worker. Once the worker has delivered a round (after the first optimizer step) the
script writes ``OUT_DIR/started.json``: ``{"pid": this process, "worker": the worker's pid}``. Checkpoints go to
``OUT_DIR/checkpoints``. A fit that ends writes ``OUT_DIR/done.json``: ``{"global_step": ...}``. With ``record``
(for ``tests/test_grpo_async_resume.py``) the reward is :func:`token_sum_reward`, ``ExactResume`` joins the callbacks
(as in the recipes: a checkpoint saved inside a step resumes at that step's batch), every optimizer step rewrites
``OUT_DIR/staleness.json`` (``{step: async/staleness}`` of the steps this process trained), and the end writes the
trainable weights to ``OUT_DIR/trainable.pt``. The worker is forked from a server process that imports this file
again, so everything runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from helpers.signals import distinct_tokens_reward
from lit_trainer.modules.grpo import GenerateEngine

PROMPTS = [f"{10 + i}+11=" for i in range(8)]


def token_sum_reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    """With ``record``: a reward that differs within nearly every group (the sum of the ids modulo 7), so that every
    round's advantages, and with them the weights that sampled it, count in the final weights."""
    return [float(sum(ids) % 7) for ids in completion_ids]


class SlowGenerate(GenerateEngine):
    """``generate`` that first sleeps a second: the trainer then spends nearly all its time waiting for the worker."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return super().generate(*args, **kwargs)


if __name__ == "__main__":
    import lightning as L
    import torch
    import transformers
    from datasets import Dataset, disable_progress_bars
    from lightning.pytorch.callbacks import ModelCheckpoint

    from helpers.models import tiny_llama
    from lit_trainer.callbacks import ExactResume, JITCheckpoint
    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.modules.grpo import GRPOModule

    disable_progress_bars()
    out, flags = sys.argv[1], sys.argv[2:]
    options = dict(flag.split("=", 1) for flag in flags if "=" in flag)

    class Started(L.Callback):
        """Writes ``started.json`` once, after the first optimizer step (the worker has delivered round 0)."""

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int):
            if trainer.global_step >= 1 and not os.path.exists(os.path.join(out, "started.json")):
                path = os.path.join(out, "started.json")
                with open(path + ".tmp", "w") as f:
                    json.dump({"pid": os.getpid(), "worker": pl_module.async_rollouts.worker.pid}, f)
                os.replace(path + ".tmp", path)  # a reader never sees half a file

    class Record(L.Callback):
        """With ``record``: each optimizer step's ``async/staleness``, in ``staleness.json``."""

        def __init__(self) -> None:
            self.staleness: dict[int, float] = {}

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int):
            self.staleness[trainer.global_step - 1] = float(pl_module._buffer.metrics["async/staleness"])
            path = os.path.join(out, "staleness.json")
            with open(path + ".tmp", "w") as f:
                json.dump(self.staleness, f)
            os.replace(path + ".tmp", path)

    tokenizer = transformers.ByT5Tokenizer()
    module = GRPOModule(
        tiny_llama(0, eos_bias=3.0), tokenizer=tokenizer, num_generations=4,
        reward_funcs=[token_sum_reward if "record" in flags else distinct_tokens_reward],
        max_completion_length=4, learning_rate=1e-2, scheduler="constant", max_grad_norm=0.0, generation_seed=0,
        max_staleness=int(options.get("k", 1)),
        rollout_engine="grpo_async_fit.SlowGenerate" if "slow" in flags else None,
    )  # fmt: skip
    data = PromptDataModule(
        tokenizer=tokenizer, dataset=Dataset.from_dict({"prompt": PROMPTS}), batch_size=4, max_length=16, val_size=0,
        sampling="sequential",
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", max_steps=int(options.get("steps", 10_000)), logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing="every" in options, num_sanity_val_steps=0,
        limit_val_batches=0, default_root_dir=out,
        callbacks=[
            Started(), JITCheckpoint(signals=["SIGTERM", "SIGINT"]),
            *([Record(), ExactResume()] if "record" in flags else []),
            *([ModelCheckpoint(os.path.join(out, "checkpoints"), "{step}", every_n_train_steps=int(options["every"]),
                               save_top_k=-1)] if "every" in options else []),
        ],
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=options.get("ckpt"))
    if "record" in flags:
        trainable = {n: p.detach() for n, p in module.model.named_parameters() if p.requires_grad}
        torch.save(trainable, os.path.join(out, "trainable.pt"))
    with open(os.path.join(out, "done.json"), "w") as f:
        json.dump({"global_step": trainer.global_step}, f)
