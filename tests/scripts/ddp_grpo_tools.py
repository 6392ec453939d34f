"""A 2-process DDP GRPO round with tools and environments on CPU (gloo), for ``tests/test_ddp_grpo_tools.py``.

Run as ``python ddp_grpo_tools.py OUT_DIR``; Lightning re-executes this file for rank 1, so everything runs under
``if __name__ == "__main__"``. Geometry: 2 prompts, G = 3, per-device batch 3: one round of 6 rollouts, rank 0 has
prompt 0's three, rank 1 prompt 1's. The scripted policy (``helpers.tool_policy``) calls the environment's ``add``
correctly, answers directly, or calls it wrongly. Per rank ``r`` it writes ``rank{r}.pt``: the step-0 synced gradient,
the round's buffered slices and metrics, and the process id each of the rank's environment instances was made in.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from helpers.tool_policy import AddEnv

PROBLEMS = [(1234, 4321), (5555, 1111)]
G = 3


class PidEnv(AddEnv):
    """Records the process it lives in; ``add`` is its tool, ``get_reward`` rewards a correct call; no hint."""

    hint = ""

    def reset(self, **row: Any) -> str:
        self.pid = os.getpid()
        return super().reset(**row)


def build(devices_batch: int, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The module (seeded tiny-64, scripted generate) and the data module of one run."""
    from datasets import Dataset

    from helpers.tool_policy import ScriptedGenerate
    from lit_trainer.data import PromptDataModule
    from lit_trainer.models import build_preset_model, build_tokenizer
    from lit_trainer.modules.grpo import GRPOModule
    from lit_trainer.rewards import arithmetic_reward

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    module = GRPOModule(
        build_preset_model("tiny-64").to(dtype), tokenizer=tokenizer, reward_funcs=[arithmetic_reward],
        environment_factory=PidEnv, num_generations=G, max_completion_length=160, learning_rate=1e-3,
        scheduler="constant", max_grad_norm=0.0, generation_seed=0,
    )  # fmt: skip
    ScriptedGenerate(module.model, tokenizer)
    rows = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{a}+{b}=?"}] for a, b in PROBLEMS],
            "answer": [str(a + b) for a, b in PROBLEMS],
        }
    )
    data = PromptDataModule(
        tokenizer=tokenizer, dataset=rows, batch_size=devices_batch, max_length=64, val_size=0, sampling="sequential"
    )
    return module, data


def first_step(devices: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One optimizer step on ``devices`` CPU processes; this rank's record (see the module docstring)."""
    import lightning as L

    module, data = build(len(PROBLEMS) * G // devices, dtype)
    record: dict[str, Any] = {}

    class Recorder(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            record["grads"] = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}
            record["slices"] = [dict(s) for s in pl_module._buffer.slices]
            record["metrics"] = dict(pl_module._buffer.metrics)
            record["env_pids"] = [e.pid for e in pl_module.environments.pools[None] if hasattr(e, "pid")]
            record["pid"] = os.getpid()

    L.Trainer(
        accelerator="cpu", strategy="ddp" if devices > 1 else "auto", devices=devices, max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[Recorder()],
        num_sanity_val_steps=0, limit_val_batches=0,
    ).fit(module, datamodule=data)  # fmt: skip
    record["rank"] = module.global_rank
    return record


if __name__ == "__main__":
    from datasets import disable_progress_bars

    disable_progress_bars()
    out = first_step(2)
    torch.save(out, os.path.join(sys.argv[1], f"rank{out['rank']}.pt"))
