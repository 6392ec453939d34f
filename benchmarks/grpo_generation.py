"""GRPO generation backends side by side: plain ``generate`` (dynamic KV cache), ``cache_implementation="static"``
and transformers' continuous batching (``generate_batch``, paged cache), on the same prompts and seeds.

Usage::

    python benchmarks/grpo_generation.py [--preset tiny] [--rows 64] [--num-generations 8]
        [--max-completion-length 8] [--repeats 5] [--threads 1] [--num-blocks 64] [--device cpu]

Each backend samples the completions of one GRPO generation batch (``--rows`` rows: ``rows / num_generations``
built-in addition prompts, each ``num_generations`` times) through the module's own functions
(``_completions.generate_completions`` / ``generate_completions_continuous``) under the seeded RNG of a round. The
backends run interleaved, ``--repeats`` rounds after one warm-up round, and the medians are reported with the ratio
to plain ``generate`` (> 1 = faster). Continuous batching runs twice: with the engine's default cache size (half the
free memory, allocated on every call, as the reference configures it) and with a small paged cache of
``--num-blocks`` blocks.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def prompt_batch(preset: str, rows: int, num_generations: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Left-padded prompt ids and mask of ``rows / num_generations`` built-in prompts, each repeated."""
    from lit_trainer.data import builtin
    from lit_trainer.models import load_tokenizer

    tokenizer = load_tokenizer(preset)
    prompts = builtin.prompt_rows("train")["prompt"][: rows // num_generations]
    prompts = [p for p in prompts for _ in range(num_generations)]
    enc = tokenizer(prompts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"], tokenizer


def backends(args: argparse.Namespace, model: Any, tokenizer: Any) -> dict[str, Callable[..., Any]]:
    from lit_trainer.generation import engines as rollout

    eos = rollout.eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]

    def config(cache: str | None) -> Any:
        return rollout.sampling_config(
            pad, eos, max_completion_length=args.max_completion_length, temperature=0.7, top_p=1.0, top_k=0,
            min_p=None, repetition_penalty=1.0, cache_implementation=cache,
        )  # fmt: skip

    small = {"num_blocks": args.num_blocks, "max_batch_tokens": args.num_blocks * 16}
    dynamic, static = config(None), config("static")
    return {
        "generate (dynamic cache)": lambda ids, mask: rollout.generate_completions(model, ids, mask, dynamic, eos),
        "generate (static cache)": lambda ids, mask: rollout.generate_completions(model, ids, mask, static, eos),
        "continuous batching (default cache size)": lambda ids, mask: rollout.generate_completions_continuous(
            model, ids, mask, dynamic, eos
        ),
        f"continuous batching ({args.num_blocks} blocks)": lambda ids, mask: rollout.generate_completions_continuous(
            model, ids, mask, dynamic, eos, small
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rows", type=int, default=64, help="completions per generation batch")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=64, help="paged-cache blocks of the small-cache run")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from lit_trainer.generation import engines as rollout
    from lit_trainer.models import load_model

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = load_model(args.preset).to(device)
    model.train()  # as during training (the module does not switch to eval mode for generation)
    ids, mask, tokenizer = prompt_batch(args.preset, args.rows, args.num_generations)
    ids, mask = ids.to(device), mask.to(device)
    runs = backends(args, model, tokenizer)
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, int] = {}
    for repeat in range(args.repeats + 1):  # round 0 warms up every backend
        for name, generate in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            with rollout.seeded_rng(rollout.rollout_seed(args.seed, repeat, 0), device):
                completions = generate(ids, mask)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if repeat:
                times[name].append(time.perf_counter() - start)
                tokens[name] = tokens.get(name, 0) + int(completions.mask.sum())
    base = statistics.median(times["generate (dynamic cache)"])
    print(
        f"\nGRPO generation: preset={args.preset}, {args.rows} completions ({args.rows // args.num_generations} "
        f"prompts x {args.num_generations}), max_completion_length={args.max_completion_length}, "
        f"device={args.device}, threads={args.threads}, median of {args.repeats}"
    )
    header = f"{'backend':<42} {'s/batch':>9} {'tokens/s':>9} {'speed vs generate':>18}"
    print(header)
    print("-" * len(header))
    for name, values in times.items():
        median = statistics.median(values)
        rate = tokens[name] / sum(values)
        print(f"{name:<42} {median:>9.3f} {rate:>9.0f} {base / median:>17.3g}x")
    print(f"\ncommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")


if __name__ == "__main__":
    main()
