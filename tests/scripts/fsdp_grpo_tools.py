"""GRPO with a tool on 2 CPU ranks under ``ModelParallelStrategy`` (FSDP2), for ``tests/test_ddp_grpo_tools.py``.

Run as ``python fsdp_grpo_tools.py OUT_DIR``. Under sharded weights every ``generate`` is a collective, so the ranks
must run the same number of them even when their rollouts take different numbers of turns. Geometry: 2 prompts,
G = 3, per-device batch 3; rank 0 gets prompt 0, whose three rollouts all call ``add`` (two turns), rank 1 prompt 1,
whose rollouts answer directly (one turn). The policy is the tiny model's own ``generate`` with the replies forced by
a logits processor (``helpers.tool_policy.ForcedGenerate``): the forwards and their collectives are real. Per rank
``r`` it writes ``rank{r}.pt``: the step-0 full gradient, the round's metrics, the batch size of each ``generate`` call
and the buffered slices.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

PROBLEMS = [(1234, 4321), (5555, 1111)]
G = 3


def choose(context: str, occurrence: int) -> str:
    """Prompt 0 calls ``add`` (correctly, with a wrong operand, correctly), then copies the result; prompt 1 answers
    directly (right, wrong, wrong)."""
    from helpers.tool_policy import call, reply

    if context.rstrip().endswith("<|assistant|>") and "<|tool|>" in context:
        return reply(context, occurrence)  # after a tool result: copy it
    (a, b), (c, d) = PROBLEMS
    if f"{a}+{b}=?" in context:
        return call({"a": a, "b": b + (occurrence % 3 == 1)})
    return f"{c + d + (occurrence % 3 != 0)}</s>"


def first_step(devices: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One optimizer step on ``devices`` CPU processes (sharded when 2); this rank's record (module docstring)."""
    import lightning as L
    from _fsdp_common import model_parallel
    from datasets import Dataset

    from helpers.tool_policy import ForcedGenerate, add
    from lit_trainer.core import sharding as _sharding
    from lit_trainer.data import PromptDataModule
    from lit_trainer.models import build_preset_model, build_tokenizer
    from lit_trainer.modules.grpo import GRPOModule
    from lit_trainer.rewards import arithmetic_reward

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    module = GRPOModule(
        build_preset_model("tiny-64").to(dtype), tokenizer=tokenizer, reward_funcs=[arithmetic_reward], tools=[add],
        num_generations=G, max_completion_length=160, learning_rate=1e-3, scheduler="constant", max_grad_norm=0.0,
        generation_seed=0,
    )  # fmt: skip
    policy = ForcedGenerate(module.model, tokenizer, choose)
    rows = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{a}+{b}=?"}] for a, b in PROBLEMS],
            "answer": [str(a + b) for a, b in PROBLEMS],
        }
    )
    data = PromptDataModule(
        tokenizer=tokenizer, dataset=rows, batch_size=len(PROBLEMS) * G // devices, max_length=64, val_size=0,
        sampling="sequential",
    )  # fmt: skip
    record: dict[str, Any] = {}

    class Recorder(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            record["grads"] = {
                n: _sharding.full(p.grad.detach()).clone().cpu() for n, p in pl_module.model.named_parameters()
            }
            record["slices"] = [{k: v.cpu() for k, v in s.items()} for s in pl_module._buffer.slices]
            record["metrics"] = {k: float(v) for k, v in pl_module._buffer.metrics.items()}

    L.Trainer(
        accelerator="cpu", strategy=model_parallel(devices) if devices > 1 else "auto", devices=devices, max_steps=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[Recorder()], num_sanity_val_steps=0, limit_val_batches=0,
    ).fit(module, datamodule=data)  # fmt: skip
    record["rank"], record["generate_calls"] = module.global_rank, list(policy.calls)
    record["sharded"] = _sharding.is_sharded(module.model)
    return record


if __name__ == "__main__":
    from datasets import disable_progress_bars

    disable_progress_bars()
    out = first_step(2)
    torch.save(out, os.path.join(sys.argv[1], f"rank{out['rank']}.pt"))
