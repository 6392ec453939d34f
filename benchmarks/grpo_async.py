"""Asynchronous vs synchronous GRPO on 2 CPU cores: wall time per optimizer step and the reward curve, side by side.

Usage::

    python benchmarks/grpo_async.py [--quick] [--settings recipe balanced generation]
        [--runs sync async sync1 async_lean] [--steps 20] [--skip 2] [--sft-steps 300] [--model PATH] [--seed 1234]

Each setting trains the same GRPO run several times from the same starting weights, on the same prompts with the same
seeds (``--runs``; the first is the baseline the ratios divide by):

* ``sync``: ``max_staleness=None`` (generation, then training, in one process) with torch's default threads (the
  whole machine);
* ``async``: ``max_staleness=1``: a rollout worker process samples round ``r + 1`` (with the weights of round ``r``)
  while the trainer trains on round ``r``; the worker has one thread (``rollout_worker_threads=1``) and the trainer
  is set to one thread for the run, so each has one core;
* ``sync1`` (diagnosis): ``sync`` on one thread: what the second thread buys the synchronous run;
* ``async_lean`` (diagnosis): ``async`` without the trainer's extra log-prob forwards (no importance-sampling
  correction, ``sampler_check_threshold=None``): the cost an asynchronous round would have if those forwards were
  free; ``async_nocheck`` drops only the sampler check; ``async_t2`` leaves the trainer torch's default threads
  (three threads on two cores).

Settings (the built-in GRPO recipe's numerics: ``loss_type="dapo"``, ``beta=0``, lr 1e-4 constant, temperature 0.7,
``accumulate_grad_batches=2`` = one round per optimizer step, 8 completions per prompt):

* ``recipe``: configs/grpo.yaml's shape at half its batch, from a short SFT start (``--sft-steps`` of the SFT recipe's
  optimizer, timed; or ``--model``, an export such as ``runs/sft/version_0/hf_model``): completions stop
  after 3.6 tokens on average whatever ``max_completion_length``, generation is about a quarter of a synchronous
  step, and the reward curves are meaningful;
* ``balanced``: generation about as long as the rest of a synchronous step (40-60%): every completion is held at
  ``max_completion_length`` tokens (``generation_kwargs={"min_new_tokens": ...}``, a stand-in for a task with long
  answers) on fewer rows; the forced tokens make every answer wrong, so its reward is 0 throughout;
* ``generation``: generation-dominated (>= 80% of a synchronous step at one thread): a smaller model (``tiny-64``,
  from its initial weights) with 160 forced tokens on 16 rows per step; reward 0 as well.

Per optimizer step: the time between the ends of completed optimizer steps (Lightning's ``on_train_batch_end`` after
the step), counted after the first ``--skip`` steps, so the worker's one-off start-up (a ``forkserver`` that imports
torch and Lightning once per training process, then one forked worker per fit) is left out; it shows as the first
step's extra time. Also per measured step: the sync runs' time inside the module's sampling (``_generate_rows``,
its share of the baseline's step is printed), the async runs' ``async/wait_seconds`` (the trainer blocked on the
worker) and extra log-prob forwards (``off_policy_terms``: old log-probs for the importance-sampling correction and
the sampler check), and the CPU seconds of the training process and of the worker (``/proc``): on a machine shared
with other jobs the wall-clock ratio also measures how much of the second core was free. The reward (mean correctness
of the round's completions) of every run is printed as a table over the same steps.

The top-level code is under ``__main__``: the worker's process imports this file's module again.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from _machine import cpu_model

#: the settings: model preset, completions per micro-batch, max_completion_length, extra GRPOModule options
SETTINGS: dict[str, dict[str, Any]] = {
    "recipe": {"preset": "tiny", "batch_size": 128, "max_completion_length": 8, "extra": {}},
    "balanced": {
        "preset": "tiny",
        "batch_size": 32,
        "max_completion_length": 16,
        "extra": {"generation_kwargs": {"min_new_tokens": 16}},
    },
    "generation": {
        "preset": "tiny-64",
        "batch_size": 8,
        "max_completion_length": 160,
        "extra": {"generation_kwargs": {"min_new_tokens": 160}},
        "warm_start": False,  # every forced answer is wrong whatever the weights: no SFT needed
    },
}
QUICK = {"steps": 5, "skip": 2, "sft_steps": 60, "runs": ["sync", "async"]}
#: the runs: (asynchronous (max_staleness), trainer threads (None: torch's default), extra GRPOModule options)
VARIANTS: dict[str, tuple[bool, int | None, dict[str, Any]]] = {
    "sync": (False, None, {}),
    "async": (True, 1, {}),
    "sync1": (False, 1, {}),  # diagnosis: what the second thread buys the synchronous run
    "async_nocheck": (True, 1, {"sampler_check_threshold": None}),
    "async_lean": (True, 1, {"sampler_check_threshold": None, "rollout_importance_sampling_correction": False}),
    "async_t2": (True, None, {}),  # the trainer keeps torch's default threads beside the one-thread worker
}


@dataclass
class RunResult:
    """What one GRPO run measured."""

    mode: str
    threads: str
    step_ends: list[float]
    cpu: list[tuple[float, float]]
    fit_start: float
    rewards: list[float]
    waits: list[float]
    lengths: list[tuple[float, float]]  # (mean, max) completion length per step
    generate_s: list[float] = field(default_factory=list)
    off_policy_s: list[float] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)

    def per_step(self, skip: int) -> float:
        ends = self.step_ends
        return (ends[-1] - ends[skip - 1]) / (len(ends) - skip) if skip else (ends[-1] - self.fit_start) / len(ends)

    def cpu_per_step(self, skip: int) -> tuple[float, float]:
        """CPU seconds per measured step of the training process and of the worker."""
        (t0, w0), (t1, w1) = self.cpu[skip - 1], self.cpu[-1]
        n = len(self.cpu) - skip
        return (t1 - t0) / n, (w1 - w0) / n

    def first_step(self) -> float:
        return self.step_ends[0] - self.fit_start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a ~1-minute smoke run: {QUICK}")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the per-step time (start-up)")
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT steps of the starting point (0: the preset)")
    parser.add_argument("--model", default=None, help="start from this export instead of the SFT warm start")
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=list(VARIANTS),
        default=["sync", "async", "sync1", "async_lean"],
        help="the first is the baseline (--quick: sync async)",
    )
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if not 1 <= args.skip < args.steps:
        parser.error(f"--skip {args.skip} must be >= 1 and below --steps {args.steps}.")
    return args


def make_callbacks() -> tuple[Any, Any]:
    """A step clock (time at the end of every completed optimizer step) and an in-memory logger."""
    import lightning as L
    from lightning.pytorch.loggers.logger import Logger

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.fit_start = 0.0
            self.ends: list[float] = []
            self.cpu: list[tuple[float, float]] = []  # (this process, the rollout worker) CPU seconds at each end
            self.last = 0

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.fit_start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step != self.last:
                self.last = trainer.global_step
                self.ends.append(time.perf_counter())
                worker = args[0].async_rollouts.worker
                self.cpu.append((time.process_time(), process_cpu(worker.pid) if worker is not None else 0.0))

    class MemoryLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: dict[int, dict[str, float]] = {}

        @property
        def name(self) -> str:
            return "memory"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.setdefault(int(step or 0), {}).update({k: float(v) for k, v in metrics.items()})

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    return StepClock(), MemoryLogger()


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``; 0.0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def quiet_trainer(**kwargs: Any) -> Any:
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


def warm_start(preset: str, steps: int, seed: int) -> tuple[dict[str, Any], float]:
    """The preset after ``steps`` SFT steps of the SFT recipe's optimizer (lr 3e-3, 50 warm-up steps, cosine, batch
    64) on the built-in addition task: ``(state dict, seconds)``."""
    import lightning as L

    from lit_trainer import CausalLMModule
    from lit_trainer.data import SFTDataModule
    from lit_trainer.models import load_model, load_tokenizer

    L.seed_everything(seed, verbose=False)
    model = load_model(preset)
    if steps == 0:
        return {k: v.clone() for k, v in model.state_dict().items()}, 0.0
    module = CausalLMModule(
        model,
        tokenizer=load_tokenizer(preset),
        learning_rate=3e-3,
        weight_decay=0.0,
        warmup_steps=min(50, steps // 4),
        scheduler="cosine",
    )
    data = SFTDataModule(tokenizer=preset, batch_size=64, max_length=32, val_size=0, seed=seed)
    start = time.perf_counter()
    quiet_trainer(max_steps=steps, logger=False, gradient_clip_val=1.0).fit(module, datamodule=data)
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}, time.perf_counter() - start


def _timed(fn: Any, sink: list[float]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        return out

    return wrapper


def run(mode: str, setting: dict[str, Any], start: Any, args: argparse.Namespace, default_threads: int) -> RunResult:
    """One GRPO run (a :data:`VARIANTS` name) from ``start`` (a state dict, or an export path)."""
    import lightning as L
    import torch

    from lit_trainer.data import PromptDataModule
    from lit_trainer.models import load_model, load_tokenizer
    from lit_trainer.modules.grpo import GRPOModule

    asynchronous, trainer_threads, variant_options = VARIANTS[mode]
    threads = trainer_threads or default_threads
    torch.set_num_threads(threads)
    L.seed_everything(args.seed, verbose=False)
    source = start if isinstance(start, str) else setting["preset"]
    model = load_model(source)
    if not isinstance(start, str):
        model.load_state_dict(start)
    options = {
        "reward_funcs": ["lit_trainer.rewards.arithmetic_reward"],
        "num_generations": 8,
        "max_completion_length": setting["max_completion_length"],
        "temperature": 0.7,
        "loss_type": "dapo",
        "beta": 0.0,
        "learning_rate": 1e-4,
        "warmup_steps": 0,
        "scheduler": "constant",
        "generation_seed": args.seed,
        "max_staleness": args.max_staleness if asynchronous else None,
        "rollout_worker_threads": 1 if asynchronous else None,
        **setting["extra"],
        **variant_options,
    }
    module = GRPOModule(model, tokenizer=load_tokenizer(source), **options)
    generate_s: list[float] = []
    off_policy_s: list[float] = []
    module._generate_rows = _timed(module._generate_rows, generate_s)
    if asynchronous:
        module.async_rollouts.off_policy_terms = _timed(module.async_rollouts.off_policy_terms, off_policy_s)
    data = PromptDataModule(
        tokenizer=source, batch_size=setting["batch_size"], max_length=16, val_size=0, seed=args.seed
    )
    clock, logger = make_callbacks()
    trainer = quiet_trainer(
        max_steps=args.steps,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[clock],
    )
    load_before = os.getloadavg()[0]
    trainer.fit(module, datamodule=data)
    torch.set_num_threads(default_threads)
    rows = [logger.rows[s] for s in sorted(logger.rows)]
    described = f"trainer {threads} + worker 1" if asynchronous else f"{threads}"
    if trainer_threads is None:
        described += " (torch default)"
    return RunResult(
        mode=mode,
        threads=described,
        step_ends=clock.ends,
        cpu=clock.cpu,
        fit_start=clock.fit_start,
        rewards=[r.get("reward", float("nan")) for r in rows],
        waits=[r.get("async/wait_seconds", float("nan")) for r in rows],
        lengths=[(r.get("completions/mean_length", 0.0), r.get("completions/max_length", 0.0)) for r in rows],
        generate_s=generate_s,
        off_policy_s=off_policy_s,
        load=(load_before, os.getloadavg()[0]),
    )


def report(
    name: str, setting: dict[str, Any], results: list[RunResult], args: argparse.Namespace
) -> tuple[float, tuple[float, float]]:
    """Print one setting's table, generation share, async waits and reward curves.

    Returns the first async run's ratio to the baseline and the 1-minute load average range over the runs compared
    (the lowest and highest of the values read before and after each run's fit)."""
    skip, steps = args.skip, args.steps
    sync = results[0]
    rows = 2 * setting["batch_size"]
    print(
        f"\n== setting '{name}': preset={setting['preset']}, {rows} completions/step ({rows // 8} prompts x 8), "
        f"max_completion_length={setting['max_completion_length']}, options={setting['extra'] or '-'}, "
        f"{steps} steps, per-step time over steps {skip + 1}-{steps}"
    )
    header = (
        f"{'run':<14} {'threads':<38} {'s/step':>7} {'vs sync':>8} {'first step s':>13} {'gen s/step':>11} "
        f"{'wait s/step':>12} {'extra fwd s/step':>17} {'CPU s/step trainer+worker':>26} {'load avg':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        gen = statistics.mean(r.generate_s[skip:]) if len(r.generate_s) > skip else float("nan")
        wait = statistics.mean(r.waits[skip:]) if r.off_policy_s else float("nan")
        off = statistics.mean(r.off_policy_s[skip:]) if len(r.off_policy_s) > skip else float("nan")
        cpu_trainer, cpu_worker = r.cpu_per_step(skip)
        cpu = f"{cpu_trainer:.3f} + {cpu_worker:.3f}"
        print(
            f"{r.mode:<14} {r.threads:<38} {r.per_step(skip):>7.3f} {r.per_step(skip) / sync.per_step(skip):>7.2f}x "
            f"{r.first_step():>13.2f} {gen:>11.3f} {wait:>12.3f} {off:>17.3f} {cpu:>26} "
            f"{r.load[0]:>4.1f}-{r.load[1]:<5.1f}"
        )
    window = sync.step_ends[-1] - sync.step_ends[skip - 1]
    longest = max(m for _, m in sync.lengths)
    mean = statistics.mean(m for m, _ in sync.lengths)
    print(
        f"{sync.mode}: generation share {sum(sync.generate_s[skip:]) / window:.0%} of its step time; completions "
        f"{mean:.1f} tokens on average, {longest:.0f} at most"
    )
    asynchronous = [r for r in results if r.off_policy_s]
    for r in asynchronous:
        print(
            f"{r.mode}: round 0 waited {r.waits[0]:.2f} s for the worker; worker start-up + round 0: first step "
            f"{r.first_step() - sync.first_step():+.2f} s vs sync (not in s/step)"
        )
    print(f"\nreward per step (mean correctness of the round's completions), same seeds and prompts: '{name}'")
    print("| run | " + " | ".join(str(s) for s in range(1, steps + 1)) + " | mean |")
    print("|---" * (steps + 2) + "|")
    for r in results:
        cells = " | ".join(f"{v:.3f}" for v in r.rewards)
        print(f"| {r.mode} | {cells} | {statistics.mean(r.rewards):.3f} |")
    first = asynchronous[0] if asynchronous else sync
    loads = [value for r in (sync, first) for value in r.load]
    return first.per_step(skip) / sync.per_step(skip), (min(loads), max(loads))


def main() -> None:
    args = parse_args()
    from lit_trainer.cli.openmp import apply_openmp_defaults

    chosen = apply_openmp_defaults()  # how OpenMP threads wait, chosen from the load as `lit-trainer` does
    import logging
    import warnings

    import datasets
    import torch

    datasets.disable_progress_bars()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    default_threads = torch.get_num_threads()
    print(
        f"CPU: {cpu_model()}, cores: {os.cpu_count()}, torch default threads: {default_threads}, "
        f"OpenMP waits: {chosen or 'as set'}, load average (1/5/15 min): "
        + " / ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    starts: dict[str, Any] = {}
    ratios: dict[str, tuple[float, tuple[float, float]]] = {}
    for name in args.settings:
        setting = SETTINGS[name]
        sft_steps = args.sft_steps if setting.get("warm_start", True) else 0
        key = (setting["preset"], sft_steps)
        if args.model and setting.get("warm_start", True):
            start = args.model
        else:
            if key not in starts:
                state, seconds = warm_start(setting["preset"], sft_steps, args.seed)
                print(f"start: {setting['preset']} after {sft_steps} SFT steps ({seconds:.1f} s)")
                starts[key] = state
            start = starts[key]
        results = [run(mode, setting, start, args, default_threads) for mode in args.runs]
        ratios[name] = report(name, setting, results, args)
    first_async = next((m for m in args.runs if VARIANTS[m][0]), args.runs[0])
    ratio = ", ".join(f"{k} {v:.2f}x (load {lo:.1f}-{hi:.1f})" for k, (v, (lo, hi)) in ratios.items())
    print(f"\n{first_async}/{args.runs[0]} wall time per optimizer step: {ratio} (target <= 0.65x)")
    print(
        f"on {cpu_model()}, {os.cpu_count()} cores, torch default threads {default_threads}; load: the 1-minute load "
        "average before and after the two runs compared. Above 1.00x the asynchronous run is slower. On a shared "
        "machine the ratio depends on the load: the async runs need the second core to themselves."
    )
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")


if __name__ == "__main__":
    main()
