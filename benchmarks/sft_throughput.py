"""SFT throughput side by side: CausalLMModule in lightning.Trainer, transformers.Trainer and a plain torch loop.

Every runner trains the same "tiny" preset (same initial weights) on the same rows of the built-in addition task,
tokenized once by ``SFTDataModule``, in the same order: seeded permutations of the training rows are materialised into
one dataset of exactly ``warmup + steps`` batches that each runner reads sequentially (ours: ``sampling="sequential"``;
HF: ``train_sampling_strategy="sequential"``; loops: ``DataLoader(shuffle=False)``). Shared settings: AdamW (lr 1e-3,
betas (0.9, 0.999), eps 1e-8, no weight decay), constant learning rate with a scheduler stepped per optimizer step,
clipping at global norm 1.0, batch 64, max_length 32, no evaluation or checkpointing, logging every 50 steps, no
DataLoader workers, ``torch.set_num_threads(1)``.

Timing runs from the end of optimizer step ``warmup`` to the end of step ``warmup + steps``, so it includes data
loading, collation, hooks and logging. Tokens/s counts real (non-padding) tokens, the same for every runner; wall
time and process CPU time are both reported (CPU time is far less sensitive to other jobs on a shared machine).
Runners are interleaved over ``--rounds`` rounds and medians reported. A sanity check prints the per-step loss gap to
the torch loop (0 with the same AdamW implementation) and each runner's logged losses.

Runners (``name@forloop|foreach|fused`` forces that AdamW implementation; without it ``--adamw``, whose ``default``
keeps each runner's own: ours -> the module's default, HF -> ``adamw_torch_fused``, loops -> ``torch.optim.AdamW()``):
  ours           CausalLMModule + SFTDataModule in lightning.Trainer, CSV logger, no progress bar
  ours+bar       the same with Lightning's default progress bar (Rich when installed, else TQDM)
  ours+tqdm      the same with TQDMProgressBar
  lightning-min  a minimal LightningModule (forward + cross entropy, Lightning's clipping) on the loops' DataLoader
  hf             transformers.Trainer (needs ``accelerate``), no tqdm bar, report_to="none"
  torch          a hand-written loop: forward, causal-LM loss, backward, clip, AdamW step, scheduler step

Usage: OMP_NUM_THREADS=1 python benchmarks/sft_throughput.py [--steps 300] [--warmup 20] [--rounds 3]
       [--runners ours,ours@forloop,lightning-min,hf,torch,torch@fused] [--adamw default] [--profile RUNNER]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import csv
import importlib.util
import io
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import transformers
from datasets import Dataset
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_trainer.data.sft import SFTDataModule
from lit_trainer.models import load_model, load_tokenizer
from lit_trainer.modules.causal_lm import CausalLMModule

LR, BETAS, EPS, CLIP, LOG_EVERY = 1e-3, (0.9, 0.999), 1e-8, 1.0, 50


@dataclass
class Setup:
    """Everything the runners share."""

    args: argparse.Namespace
    tokenizer: Any
    dataset: Dataset  # tokenized rows in training order: batch k = rows [k*B, (k+1)*B)
    weights: dict[str, torch.Tensor]
    real_tokens: int  # non-padding tokens of the timed steps
    padded_tokens: int
    bars: dict[str, str] = field(default_factory=dict)  # progress bar class per ours runner


@dataclass
class Result:
    seconds: float  # wall-clock seconds of the timed steps
    cpu: float  # process CPU seconds of the timed steps (less sensitive to other jobs on a shared machine)
    optimizer: str  # the optimizer class and AdamW implementation the runner really used
    losses: list[float] = field(default_factory=list)  # per-step losses when the runner exposes them
    logged: list[float] = field(default_factory=list)  # the runner's own logged training losses (every 50 steps)


class Clock:
    """Wall and CPU time between the end of the warm-up step and the last tick."""

    def __init__(self) -> None:
        self.start = self.stop = (0.0, 0.0)

    def tick(self, is_start: bool) -> None:
        now = (time.perf_counter(), time.process_time())
        if is_start:
            self.start = now
        self.stop = now

    def result(self, losses: list[Any] | None, logged: list[float] | None, optimizer: torch.optim.Optimizer) -> Result:
        return Result(
            self.stop[0] - self.start[0],
            self.stop[1] - self.start[1],
            adamw_kind(optimizer),
            [float(x) for x in losses or []],
            logged or [],
        )


def adamw_kind(optimizer: torch.optim.Optimizer) -> str:
    """``fused``, ``foreach`` or ``for-loop``: the AdamW implementation an optimizer runs (on CPU, where torch's
    default for ``foreach=None`` is the for-loop)."""
    group = optimizer.param_groups[0]
    kind = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    return f"{type(optimizer).__name__} {kind}"


# ------------------------------------------------------------------------------------------------------------- setup
def build_setup(args: argparse.Namespace) -> Setup:
    tokenizer = load_tokenizer("tiny")
    dm = SFTDataModule(
        tokenizer=tokenizer, dataset="builtin:addition", batch_size=args.batch_size, max_length=args.max_length
    )
    dm.setup("fit")
    rows = dm.train_dataset
    total = (args.warmup + args.steps) * args.batch_size
    generator = torch.Generator().manual_seed(args.seed)
    order: list[int] = []
    while len(order) < total:  # whole seeded permutations of the rows, as epochs would give
        order += torch.randperm(len(rows), generator=generator).tolist()
    dataset = rows.select(order[:total]).flatten_indices()
    timed = dataset.select(range(args.warmup * args.batch_size, total))["length"]
    torch.manual_seed(args.seed)
    weights = copy.deepcopy(load_model("tiny").state_dict())
    return Setup(args, tokenizer, dataset, weights, sum(timed), padded_tokens(timed, args.batch_size))


def padded_tokens(lengths: list[int], batch_size: int) -> int:
    """Tokens of ``lengths`` taken ``batch_size`` rows at a time, each batch padded to its longest row."""
    return sum(
        max(lengths[i : i + batch_size]) * len(lengths[i : i + batch_size]) for i in range(0, len(lengths), batch_size)
    )


def fresh_model(setup: Setup) -> torch.nn.Module:
    model = load_model("tiny")
    model.load_state_dict(setup.weights)
    return model.train()


def make_adamw(impl: str) -> Callable[[Any], torch.optim.Optimizer]:
    """AdamW with the shared settings; ``impl`` is default/forloop/foreach/fused."""
    flags = {"default": {}, "forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    return lambda params: torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, **flags)


def pad_collate(pad_id: int) -> Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]:
    """A minimal right-padding collator (labels -100 on padding and on the prompt), independent of ours."""

    def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.tensor([r["input_ids"] + [pad_id] * (width - len(r["input_ids"])) for r in rows])
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
        labels = ids.masked_fill(mask == 0, -100)
        for i, r in enumerate(rows):
            labels[i, : r["prompt_length"]] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def plain_loader(setup: Setup) -> DataLoader:
    return DataLoader(
        setup.dataset,
        batch_size=setup.args.batch_size,
        shuffle=False,
        collate_fn=pad_collate(setup.tokenizer.pad_token_id),
        num_workers=0,
    )


def shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean next-token cross entropy (the loop's own, not lit_trainer's)."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )


# ------------------------------------------------------------------------------------------------------- the runners
class LightningTimer(pl.Callback):
    """Times optimizer steps ``warmup+1 .. warmup+steps`` and keeps the per-step losses (as tensors, no sync)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.clock, self.losses = warmup, Clock(), []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(outputs["loss"].detach())
        self.clock.tick(trainer.global_step == self.warmup)


def lightning_trainer(setup: Setup, timer: LightningTimer, logdir: str, bar: str | None, **kw: Any) -> pl.Trainer:
    """``bar``: None (no progress bar), "default" (Lightning's choice: Rich when installed) or "tqdm"."""
    callbacks: list[pl.Callback] = [timer] + ([TQDMProgressBar()] if bar == "tqdm" else [])
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=setup.args.warmup + setup.args.steps,
        log_every_n_steps=LOG_EVERY,
        logger=CSVLogger(logdir),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=bar is not None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kw,
    )


def ours_module(setup: Setup, model: torch.nn.Module, **kw: Any) -> CausalLMModule:
    """CausalLMModule with the shared settings (AdamW lr/decay, constant schedule, clipping)."""
    return CausalLMModule(
        model,
        tokenizer=setup.tokenizer,
        learning_rate=LR,
        weight_decay=0.0,
        scheduler="constant",
        warmup_steps=0,
        max_grad_norm=CLIP,
        **kw,
    )


def ours_datamodule(setup: Setup, **kw: Any) -> SFTDataModule:
    """SFTDataModule reading ``setup.dataset`` in order: already tokenized and ordered, so ``setup()`` is skipped."""
    dm = SFTDataModule(
        tokenizer=setup.tokenizer,
        batch_size=setup.args.batch_size,
        max_length=setup.args.max_length,
        sampling="sequential",
        val_size=0,
        **kw,
    )
    dm.train_dataset, dm.val_dataset = setup.dataset, None
    return dm


def run_ours(setup: Setup, adamw: str, bar: str | None = None) -> Result:
    optimizer = None if adamw == "default" else make_adamw(adamw)
    module = ours_module(setup, fresh_model(setup), optimizer=optimizer)
    dm = ours_datamodule(setup)
    timer = LightningTimer(setup.args.warmup)
    with tempfile.TemporaryDirectory() as logdir:
        trainer = lightning_trainer(setup, timer, logdir, bar)
        trainer.fit(module, datamodule=dm)
        setup.bars[bar or "none"] = type(trainer.progress_bar_callback).__name__
        logged = [float(r["train_loss"]) for r in _csv_rows(trainer) if r.get("train_loss")]
    return timer.clock.result(timer.losses, logged, trainer.optimizers[0])


def _csv_rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    trainer.logger.save()
    path = os.path.join(trainer.logger.log_dir, "metrics.csv")
    if not os.path.exists(path):  # nothing logged (fewer steps than the logging interval)
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


class MinimalModule(pl.LightningModule):
    """The least a LightningModule needs for this job: forward + cross entropy, AdamW + LambdaLR."""

    def __init__(self, model: torch.nn.Module, adamw: str) -> None:
        super().__init__()
        self.model, self.adamw = model, adamw

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
        return shifted_ce(logits, batch["labels"])

    def configure_optimizers(self) -> Any:
        optimizer = make_adamw(self.adamw)(self.model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def run_lightning_min(setup: Setup, adamw: str) -> Result:
    timer = LightningTimer(setup.args.warmup)
    with tempfile.TemporaryDirectory() as logdir:
        trainer = lightning_trainer(setup, timer, logdir, None, gradient_clip_val=CLIP)
        trainer.fit(MinimalModule(fresh_model(setup), adamw), train_dataloaders=plain_loader(setup))
    return timer.clock.result(timer.losses, None, trainer.optimizers[0])


def run_torch(setup: Setup, adamw: str) -> Result:
    model = fresh_model(setup)
    optimizer = make_adamw(adamw)(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    losses: list[torch.Tensor] = []
    clock = Clock()
    window, logged = torch.zeros(()), []
    for step, batch in enumerate(plain_loader(setup), start=1):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        loss = shifted_ce(logits, batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        window += loss.detach()
        if step % LOG_EVERY == 0:  # a loop logs too: the window mean, one host sync every 50 steps
            logged.append(float(window) / LOG_EVERY)
            window.zero_()
        clock.tick(step == setup.args.warmup)
    return clock.result(losses, logged, optimizer)


class HFTimer(transformers.TrainerCallback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.clock = warmup, Clock()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.tick(state.global_step == self.warmup)


def hf_training_args(setup: Setup, output_dir: str, **kw: Any) -> transformers.TrainingArguments:
    """TrainingArguments with the shared settings: the same AdamW, schedule, clipping, logging and order as ours."""
    args = setup.args
    return transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps,
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=CLIP,
        logging_steps=LOG_EVERY,
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        save_strategy="no",
        eval_strategy="no",
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        seed=args.seed,
        **kw,
    )


def run_hf(setup: Setup, adamw: str) -> Result:
    """transformers.Trainer; AdamW: its default ``adamw_torch_fused``, ``adamw_torch`` (for-loop on CPU), or (foreach,
    which has no ``optim`` name) an AdamW passed through ``optimizers=`` (the Trainer still builds the scheduler)."""
    args, model = setup.args, fresh_model(setup)
    optim = {
        "default": "adamw_torch_fused",
        "fused": "adamw_torch_fused",
        "forloop": "adamw_torch",
        "foreach": "adamw_torch",
    }[adamw]
    given = (make_adamw("foreach")(model.parameters()), None) if adamw == "foreach" else (None, None)
    timer = HFTimer(args.warmup)
    with tempfile.TemporaryDirectory() as out:
        training_args = hf_training_args(setup, out, optim=optim)
        trainer = transformers.Trainer(
            model=model,
            args=training_args,
            train_dataset=setup.dataset,
            data_collator=pad_collate(setup.tokenizer.pad_token_id),
            callbacks=[timer],
            optimizers=given,
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return timer.clock.result(None, logged, getattr(trainer.optimizer, "optimizer", trainer.optimizer))


RUNNERS: dict[str, Callable[..., Result]] = {
    "ours": run_ours,
    "ours+bar": lambda setup, adamw: run_ours(setup, adamw, bar="default"),
    "ours+tqdm": lambda setup, adamw: run_ours(setup, adamw, bar="tqdm"),
    "lightning-min": run_lightning_min,
    "hf": run_hf,
    "torch": run_torch,
}


def run(setup: Setup, name: str) -> Result:
    """Run ``name`` = ``runner`` or ``runner@adamw`` (e.g. ``torch@fused``: that runner with that AdamW)."""
    base, _, adamw = name.partition("@")
    return RUNNERS[base](setup, adamw or setup.args.adamw)


# -------------------------------------------------------------------------------------------------------- reporting
def lightning_overhead(steps: int) -> tuple[float, float]:
    """CPU seconds per step of a 1-parameter job: (Lightning loop, plain loop); the difference is Lightning's cost."""

    class Trivial(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return (self.w * batch).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = DataLoader(torch.ones(steps, 1), batch_size=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.process_time()
    trainer.fit(Trivial(), train_dataloaders=data)
    lightning_s = (time.process_time() - start) / steps
    module = Trivial()
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    start = time.process_time()
    for batch in data:
        module.training_step(batch, 0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return lightning_s, (time.process_time() - start) / steps


def profile(setup: Setup, name: str, limit: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    run(setup, name)
    profiler.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(limit)
        print(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=20, help="untimed optimizer steps before them")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--adamw",
        choices=("default", "forloop", "foreach", "fused"),
        default="default",
        help="AdamW implementation of runners named without @impl",
    )
    parser.add_argument(
        "--runners",
        default="ours,ours@forloop,lightning-min,hf,torch,torch@fused",
        help=f"comma-separated, from {sorted(RUNNERS)}, each optionally @forloop/@foreach/@fused",
    )
    parser.add_argument("--profile", default=None, metavar="RUNNER", help="cProfile one runner and exit")
    parser.add_argument("--overhead-steps", type=int, default=2000, help="steps of the trivial-module measure (0=off)")
    args = parser.parse_args()
    names = args.runners.split(",")
    if any(n.startswith("hf") for n in names) and importlib.util.find_spec("accelerate") is None:
        sys.exit("transformers.Trainer needs `accelerate`: `pip install accelerate`, or leave hf out of --runners.")
    torch.set_num_threads(1)
    quiet()
    setup = build_setup(args)
    if args.profile:
        profile(setup, args.profile, 40)
        return
    results: dict[str, list[Result]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            results[name].append(run(setup, name))
            print(f"  {name}: {setup.real_tokens / results[name][-1].seconds:,.0f} tokens/s", file=sys.stderr)
    report(setup, results)
    if args.overhead_steps:
        light, plain = lightning_overhead(args.overhead_steps)
        print(
            f"\nLightning's own per-step cost (trivial 1-parameter module, {args.overhead_steps} steps, CPU time, "
            f"fit() start-up included): {light * 1e6:.0f} us/step in lightning.Trainer vs {plain * 1e6:.0f} us/step "
            f"in a plain loop (+{(light - plain) * 1e6:.0f} us/step)."
        )


def report(setup: Setup, results: dict[str, list[Result]]) -> None:
    args = setup.args
    wall = {n: statistics.median(setup.real_tokens / r.seconds for r in rs) for n, rs in results.items()}
    cpu = {n: statistics.median(setup.real_tokens / r.cpu for r in rs) for n, rs in results.items()}
    command = " ".join(["OMP_NUM_THREADS=1 python benchmarks/sft_throughput.py", *sys.argv[1:]])
    print(f"\nCommand: `{command}`\n")
    print(
        f"torch {torch.__version__}, lightning {pl.__version__}, transformers {transformers.__version__}; "
        f"torch.set_num_threads(1); {os.cpu_count()} cores shared with other jobs; {args.rounds} interleaved rounds, "
        f"medians; {args.steps} timed steps after {args.warmup} warm-up steps; batch {args.batch_size}; "
        f"{setup.real_tokens:,} real tokens timed (padding {1 - setup.real_tokens / setup.padded_tokens:.1%}).\n"
    )
    print(
        "| runner | optimizer | real tokens/s, wall: median (best) | wall, per round | real tokens per CPU-second: "
        "median (best) | CPU ms/step | ours / runner, wall | ours / runner, CPU |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for name, rs in results.items():
        rounds = ", ".join(f"{setup.real_tokens / r.seconds:,.0f}" for r in rs)
        best_wall = setup.real_tokens / min(r.seconds for r in rs)
        best_cpu = setup.real_tokens / min(r.cpu for r in rs)
        ms = statistics.median(r.cpu for r in rs) / args.steps * 1e3
        vs_wall = f"{wall['ours'] / wall[name]:.3f}" if "ours" in wall else "-"
        vs_cpu = f"{cpu['ours'] / cpu[name]:.3f}" if "ours" in cpu else "-"
        print(
            f"| {name} | {rs[0].optimizer} | {wall[name]:,.0f} ({best_wall:,.0f}) | {rounds} | {cpu[name]:,.0f} "
            f"({best_cpu:,.0f}) | {ms:.1f} | {vs_wall} | {vs_cpu} |"
        )
    if setup.bars:
        print(f"\nprogress bar callbacks: {setup.bars}")
    sanity(results)


def sanity(results: dict[str, list[Result]]) -> None:
    """Same model, batches and order: per-step losses agree with the torch loop's (to float rounding, more apart
    with another AdamW implementation), and so do the losses each runner logged every 50 steps."""
    reference = next((rs[0] for n, rs in results.items() if n.startswith("torch") and rs[0].losses), None)
    if reference is None:
        return
    print()
    for name, rs in results.items():
        if rs[0].losses and rs[0] is not reference:
            gap = max(abs(a - b) for a, b in zip(rs[0].losses, reference.losses))
            print(
                f"sanity: max |loss({name}) - loss(torch loop, {reference.optimizer})| over {len(reference.losses)} "
                f"steps = {gap:.1e} (loss {reference.losses[0]:.3f} at step 1, {reference.losses[-1]:.3f} at the end)"
            )
    for name, rs in results.items():
        if rs[0].logged:
            print(
                f"sanity: {name} logged train loss every {LOG_EVERY} steps: "
                + ", ".join(f"{x:.4f}" for x in rs[0].logged)
            )


def quiet() -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        import datasets

        datasets.disable_progress_bars()


if __name__ == "__main__":
    main()
