"""BEMA overhead next to a plain torch training loop of a ~0.5M-parameter Llama (hidden 128, 2 layers, vocab 384).

Measures, in one run and on the same model:
  * the plain training step (forward, backward, AdamW step), batch 64 x 12 tokens;
  * the BEMA hook on a step without an update (the schedule check) and on an update step (copy + 4 foreach ops);
  * side by side, step by step in turn: plain step, step + BEMA(update_freq=1), step + BEMA(update_freq=400)
    (the hook is the callback's own ``on_train_batch_end``), ``--steps`` steps each.
The "derived" overhead is (update cost + (f-1) * check cost) / f / step time; the "measured" one is the difference
of the per-setting means, which carries the timing noise of the training steps themselves (about +-1% here).

Usage: python benchmarks/bema_overhead.py [--steps 400] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_trainer.callbacks.bema import BEMA


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=384,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Loop:
    """A plain torch training loop that cycles through variants step by step (so machine load hits all alike).

    A variant is ``None`` (plain) or a BEMA whose ``on_train_batch_end`` runs after the optimizer step, with its
    own step counter as ``global_step``: it sees every step it is given as consecutive, as under a Trainer.
    """

    def __init__(self, model: LlamaForCausalLM, batch: torch.Tensor) -> None:
        self.model, self.batch = model, batch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(self) -> None:
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, steps_per_variant: int, variants: list[BEMA | None]) -> list[list[float]]:
        """Per-step seconds (training step + hook) of each variant, ``steps_per_variant`` steps each."""
        times: list[list[float]] = [[] for _ in variants]
        for _ in range(steps_per_variant):
            for i, bema in enumerate(variants):
                start = time.perf_counter()
                self.train_step()
                if bema is not None:
                    bema.on_train_batch_end(SimpleNamespace(global_step=bema._step + 1), self.model, None, None, 0)
                times[i].append(time.perf_counter() - start)
        return times


def attach(bema: BEMA, model: LlamaForCausalLM) -> BEMA:
    bema._attach(SimpleNamespace(global_step=0), model)  # what on_train_start does, without a Trainer
    return bema


def hook_cost(bema: BEMA, model: LlamaForCausalLM, first_step: int, repeats: int) -> float:
    """Mean seconds of one ``on_train_batch_end`` call at steps first_step, first_step + update_freq, ..."""
    start = time.perf_counter()
    for i in range(repeats):
        step = first_step + i * bema.update_freq
        bema._step = step - 1
        bema.on_train_batch_end(SimpleNamespace(global_step=step), model, None, None, 0)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per setting (a multiple of 400)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="BEMA buffer device")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model()
    batch = torch.randint(3, 259, (64, 12), generator=torch.Generator().manual_seed(0))
    loop = Loop(model, batch)
    num_params = sum(p.numel() for p in model.parameters())
    loop.run(20, [None])  # warm-up

    probe = attach(BEMA(update_freq=400, device=args.device), model)
    update_s = hook_cost(probe, model, 400, 200)  # steps 400, 800, ...: all update steps
    check_s = hook_cost(probe, model, 401, 2000)  # steps 401, 801, ...: no update
    names, freqs = ["plain", "update_freq=1", "update_freq=400"], [None, 1, 400]
    variants = [None] + [attach(BEMA(update_freq=f, device=args.device), model) for f in freqs[1:]]
    times = loop.run(args.steps, variants)  # each BEMA sees steps 1..steps: steps // 400 default updates

    step_s = statistics.mean(times[0])
    print(
        f"model: Llama hidden 128, 2 layers, vocab 384, {num_params:,} parameters; batch 64 x 12; "
        f"{args.threads} thread(s); BEMA buffers on {args.device}; {args.steps} steps per setting, interleaved"
    )
    print(f"plain training step: mean {step_s * 1e3:.2f} ms, median {statistics.median(times[0]) * 1e3:.2f} ms")
    print(f"BEMA hook: update step {update_s * 1e3:.3f} ms, other steps {check_s * 1e6:.2f} us\n")
    print(f"| {'setting':<16} | {'mean step (ms)':>14} | {'measured overhead':>17} | {'derived overhead':>16} |")
    print(f"|{'-' * 18}|{'-' * 16}|{'-' * 19}|{'-' * 18}|")
    for name, freq, samples in zip(names, freqs, times):
        mean = statistics.mean(samples)
        measured = "" if freq is None else f"{(mean - step_s) / step_s:+.2%}"
        derived = "" if freq is None else f"{(update_s + (freq - 1) * check_s) / freq / step_s:.3%}"
        print(f"| {name:<16} | {mean * 1e3:>14.2f} | {measured:>17} | {derived:>16} |")
    print("\ncommand: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
