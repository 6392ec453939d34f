"""An asynchronous GRPO fit (``max_staleness=1``) that runs until it is stopped from outside, for the shutdown tests
of ``tests/test_grpo_async_shutdown.py``.

Run as ``python grpo_async_fit.py OUT_DIR [slow] [steps=N] [ckpt=PATH]``: a tiny Llama, 8 prompts, up to 10,000
optimizer steps (hours; ``steps=N``: N), resumed from ``PATH`` with ``ckpt=PATH``, with
:class:`~lit_trainer.callbacks.JITCheckpoint` handling SIGTERM and SIGINT as the recipes configure it (the default
``kill_wait`` of 3 s for SIGTERM). With ``slow`` the worker samples with :class:`SlowGenerate`, so the trainer spends
nearly all its time waiting for the worker. Once the worker has delivered a round (after the first optimizer step) the
script writes ``OUT_DIR/started.json``: ``{"pid": this process, "worker": the worker's pid}``. Checkpoints go to
``OUT_DIR/checkpoints``. A fit that ends writes ``OUT_DIR/done.json``: ``{"global_step": ...}``. The worker is
forked from a server process that imports this file again, so everything runs under ``if __name__ == "__main__"``.
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


class SlowGenerate(GenerateEngine):
    """``generate`` that first sleeps a second: the trainer then spends nearly all its time waiting for the worker."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return super().generate(*args, **kwargs)


if __name__ == "__main__":
    import lightning as L
    import transformers
    from datasets import Dataset, disable_progress_bars

    from helpers.models import tiny_llama
    from lit_trainer.callbacks import JITCheckpoint
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

    tokenizer = transformers.ByT5Tokenizer()
    module = GRPOModule(
        tiny_llama(0, eos_bias=3.0), tokenizer=tokenizer, reward_funcs=[distinct_tokens_reward], num_generations=4,
        max_completion_length=4, learning_rate=1e-2, scheduler="constant", max_grad_norm=0.0, generation_seed=0,
        max_staleness=1, rollout_engine="grpo_async_fit.SlowGenerate" if "slow" in flags else None,
    )  # fmt: skip
    data = PromptDataModule(
        tokenizer=tokenizer, dataset=Dataset.from_dict({"prompt": PROMPTS}), batch_size=4, max_length=16, val_size=0,
        sampling="sequential",
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", max_steps=int(options.get("steps", 10_000)), logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=out,
        callbacks=[Started(), JITCheckpoint(signals=["SIGTERM", "SIGINT"])],
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=options.get("ckpt"))
    with open(os.path.join(out, "done.json"), "w") as f:
        json.dump({"global_step": trainer.global_step}, f)
