"""Packed SFT throughput: real (non-padding) tokens/s of padding-free packing vs padded training, same model and rows.

Corpus: random byte-token rows whose lengths are drawn uniformly from each ``--spreads`` range (e.g. ``32-512``), so
the padding of a padded micro-batch grows with the spread. Every runner trains the ``--model`` preset from the same
initial weights on the same rows in the same order (sequential sampling), with the harness of
``benchmarks/sft_throughput.py`` (shared AdamW settings, clipping 1.0, constant learning rate, logging every 50
steps, no evaluation or checkpointing, ``torch.set_num_threads(1)``, timing from the end of the warm-up steps).

Runners:
  ours-padded    CausalLMModule + SFTDataModule(packing="none"): micro-batches of ``--batch-size`` rows, padded
  ours-pf        the same with packing="padding_free": each micro-batch's rows flattened into one row
  ours-bfd       packing="bfd": rows in best-fit-decreasing bins of ``--max-length`` tokens, each bin one row;
                 ``round(batch_size * mean_length / max_length)`` bins per micro-batch (about the same tokens per step)
  hf             transformers.Trainer, the same rows right-padded by a minimal collator
  hf-flat        transformers.Trainer with its own DataCollatorWithFlattening (one flattened row per micro-batch;
                 ``use_cache=False`` on the model, else transformers does not detect the packed rows)

Real tokens/s counts the tokens of the timed steps' rows (no padding), the same count for every runner but bfd,
whose steps hold other rows (its own rows' tokens are counted). CPU time per real token is reported too (less
sensitive to other jobs on a shared machine).

Usage: OMP_NUM_THREADS=1 python benchmarks/packing_throughput.py [--spreads 32-512,192-352,256-288] [--steps 20]
       [--warmup 3] [--rounds 1] [--batch-size 8] [--max-length 512] [--runners ours-pf,ours-bfd,ours-padded,hf,...]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from collections.abc import Callable

import torch
import transformers
from datasets import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sft_throughput as harness

from lit_trainer.data.packing import pack_dataset
from lit_trainer.models import load_model, load_tokenizer

FIRST_BYTE_ID, LAST_BYTE_ID = 3, 258


def corpus(low: int, high: int, rows: int, seed: int) -> Dataset:
    """``rows`` token rows, lengths uniform in ``[low, high]``, random byte ids (trained on every token)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (rows,), generator=generator).tolist()
    ids = [torch.randint(FIRST_BYTE_ID, LAST_BYTE_ID + 1, (n,), generator=generator).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": ids, "prompt_length": [0] * rows, "length": lengths})


def make_setup(args: argparse.Namespace, rows: Dataset, batch_size: int) -> harness.Setup:
    step_args = argparse.Namespace(**{**vars(args), "batch_size": batch_size})
    timed = rows.select(range(args.warmup * batch_size, (args.warmup + args.steps) * batch_size))["length"]
    torch.manual_seed(args.seed)
    weights = {k: v.clone() for k, v in load_model(args.model).state_dict().items()}
    padded = harness.padded_tokens(timed, batch_size)
    return harness.Setup(step_args, load_tokenizer("tiny"), rows, weights, sum(timed), padded)


def fresh_model(setup: harness.Setup) -> torch.nn.Module:
    model = load_model(setup.args.model)
    model.load_state_dict(setup.weights)
    return model.train()


def run_ours(setup: harness.Setup, packing: str) -> harness.Result:
    module = harness.ours_module(setup, fresh_model(setup))
    dm = harness.ours_datamodule(setup, packing=packing)  # rows already tokenized (and binned), in order
    timer = harness.LightningTimer(setup.args.warmup)
    with tempfile.TemporaryDirectory() as logdir:
        trainer = harness.lightning_trainer(setup, timer, logdir, None)
        trainer.fit(module, datamodule=dm)
    return timer.clock.result(timer.losses, None, trainer.optimizers[0])


def run_hf(setup: harness.Setup, flatten: bool) -> harness.Result:
    model = fresh_model(setup)
    collator = (
        transformers.DataCollatorWithFlattening() if flatten else harness.pad_collate(setup.tokenizer.pad_token_id)
    )
    if flatten:
        model.config.use_cache = False
    timer = harness.HFTimer(setup.args.warmup)
    with tempfile.TemporaryDirectory() as out:
        training_args = harness.hf_training_args(setup, out)
        dataset = setup.dataset.remove_columns(["prompt_length", "length"]) if flatten else setup.dataset
        trainer = transformers.Trainer(
            model=model, args=training_args, train_dataset=dataset, data_collator=collator, callbacks=[timer]
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()
    return timer.clock.result(None, None, getattr(trainer.optimizer, "optimizer", trainer.optimizer))


RUNNERS: dict[str, Callable[[harness.Setup], harness.Result]] = {
    "ours-padded": lambda setup: run_ours(setup, "none"),
    "ours-pf": lambda setup: run_ours(setup, "padding_free"),
    "ours-bfd": lambda setup: run_ours(setup, "bfd"),
    "hf": lambda setup: run_hf(setup, flatten=False),
    "hf-flat": lambda setup: run_hf(setup, flatten=True),
}


def measure_spread(args: argparse.Namespace, low: int, high: int, names: list[str]) -> dict[str, tuple[float, float]]:
    """``{runner: (median real tokens/s wall, median real tokens per CPU-second)}`` for one length spread."""
    rows = corpus(low, high, 2 * (args.warmup + args.steps) * args.batch_size, args.seed)
    setups = {"rows": make_setup(args, rows, args.batch_size)}
    if "ours-bfd" in names:
        bins = pack_dataset(rows, args.max_length)
        per_step = max(1, round(args.batch_size * (low + high) / 2 / args.max_length))
        setups["bins"] = make_setup(args, bins, per_step)
    results: dict[str, list[harness.Result]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            results[name].append(RUNNERS[name](setups["bins" if name == "ours-bfd" else "rows"]))
    out = {}
    for name, rs in results.items():
        real = setups["bins" if name == "ours-bfd" else "rows"].real_tokens
        out[name] = (statistics.median(real / r.seconds for r in rs), statistics.median(real / r.cpu for r in rs))
        print(f"  {low}-{high} {name}: {out[name][0]:,.0f} real tokens/s", file=sys.stderr)
    padding = 1 - setups["rows"].real_tokens / setups["rows"].padded_tokens
    out["_padding"] = (padding, padding)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spreads", default="32-512,192-352,256-288", help="comma-separated low-high row lengths")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps before them")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians are reported)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--model", default="tiny", help="a preset: tiny, tiny-64 or tiny-256")
    parser.add_argument("--runners", default="ours-pf,ours-bfd,ours-padded,hf,hf-flat")
    args = parser.parse_args()
    names = args.runners.split(",")
    if any(n.startswith("hf") for n in names) and importlib.util.find_spec("accelerate") is None:
        sys.exit("transformers.Trainer needs `accelerate`: `pip install accelerate`, or leave hf* out of --runners.")
    torch.set_num_threads(1)
    harness.quiet()
    table = {}
    for spread in args.spreads.split(","):
        low, high = (int(x) for x in spread.split("-"))
        table[spread] = measure_spread(args, low, high, names)
    command = " ".join(["OMP_NUM_THREADS=1 python benchmarks/packing_throughput.py", *sys.argv[1:]])
    print(
        f"\nCommand: `{command}`\n\ntorch {torch.__version__}, transformers {transformers.__version__}; "
        f"model {args.model}; torch.set_num_threads(1); {os.cpu_count()} cores shared with other jobs; "
        f"{args.rounds} round(s); {args.steps} timed steps after {args.warmup}; batch {args.batch_size} rows; "
        f"max_length {args.max_length}.\n"
    )
    print(
        "| lengths | padding (padded batches) | "
        + " | ".join(f"{n} tok/s" for n in names)
        + " | "
        + " | ".join(f"{n} / hf" for n in names if n != "hf")
        + " |"
    )
    print("|---|---:|" + "---:|" * (2 * len(names) - ("hf" in names)))
    for spread, out in table.items():
        cells = [f"{out[n][0]:,.0f}" for n in names]
        ratios = [
            f"{out[n][0] / out['hf'][0]:.2f}x (CPU {out[n][1] / out['hf'][1]:.2f}x)" if "hf" in out else "-"
            for n in names
            if n != "hf"
        ]
        print(f"| {spread} | {out['_padding'][0]:.0%} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
