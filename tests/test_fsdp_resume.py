"""``configs/sft_fsdp.yaml`` through the ``lit-trainer`` command on 2 CPU ranks (ModelParallelStrategy, gloo):
SIGTERM to one rank -> both ranks save one complete (distributed, directory) checkpoint and the job exits 143; the
SAME command line run again resumes from it (the config's ``ckpt_path: last``) and ends bit-exact with an
uninterrupted sharded run.

The same config as two nodes on this machine: two ``torchrun --nnodes 2 --nproc-per-node 1`` launchers (static
rendezvous on 127.0.0.1), one rank each; SIGTERM to node 1's launcher -> both nodes' ranks save one checkpoint and exit
143; the same two commands resume and end bit for bit with the uninterrupted run of two ranks on one node (Lightning's
own launcher). What this proves and what it does not: ``docs/cluster.md``.

And with LoRA over the sharded base: the JIT checkpoint holds the adapters only, and the same command resumes it.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.ddp import script_env

pytestmark = pytest.mark.ddp


ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "sft_fsdp.yaml"
STEPS = 6


def _tool(name: str) -> Path | str:
    """A console script installed next to this interpreter (the venv's), else the one on ``PATH``."""
    beside = Path(sys.executable).with_name(name)
    return beside if beside.exists() else shutil.which(name) or name


def _command(out: Path, *extra: str) -> list[str]:
    data = out / "rows.jsonl"  # small data: the test is about the checkpoint, not the task
    data.write_text("".join(f'{{"text": "{i} plus {i} is {2 * i}"}}\n' for i in range(48)))
    return [
        str(_tool("lit-trainer")),
        "fit",
        "--config",
        str(CONFIG),
        f"--data.dataset={data}",
        "--data.val_size=0",
        "--model.eval_exact_match=false",
        f"--trainer.max_steps={STEPS}",
        "--trainer.accumulate_grad_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--model.warmup_steps=2",
        "--model.model=tiny-64",
        "--data.batch_size=4",
        "--data.eval_batch_size=4",
        "--trainer.callbacks+=fsdp_sigterm_probe.SigtermOneRank",
        f"--trainer.callbacks.out={out}",
        *extra,
    ]


def _env(sigterm_at: int | None, **extra: str) -> dict[str, str]:
    env = script_env(**extra)  # tests/scripts on PYTHONPATH: the command line names fsdp_sigterm_probe.SigtermOneRank
    env.pop("FSDP_TEST_SIGTERM_STEP", None)
    if sigterm_at is not None:
        env["FSDP_TEST_SIGTERM_STEP"] = str(sigterm_at)
    return env


def _run(cwd: Path, command: list[str], sigterm_at: int | None) -> subprocess.CompletedProcess:
    env = _env(sigterm_at)
    return subprocess.run(command, check=False, cwd=cwd, env=env, timeout=600, capture_output=True, text=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of two ranks on one node (Lightning's launcher): the reference of both resumes."""
    reference = tmp_path_factory.mktemp("reference")
    proc = _run(reference, _command(reference), sigterm_at=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return reference


def _assert_resumed_equals_uninterrupted(resumed_dir: Path, reference: Path) -> None:
    for rank in (0, 1):
        resumed = torch.load(resumed_dir / f"final_resumed_rank{rank}.pt")
        fresh = torch.load(reference / f"final_fresh_rank{rank}.pt")
        assert resumed["step"] == fresh["step"] == STEPS
        assert all(torch.equal(resumed["weights"][k], fresh["weights"][k]) for k in fresh["weights"])


def test_sigterm_to_one_rank_saves_once_and_the_same_command_resumes_bit_exact(tmp_path: Path, uninterrupted: Path):
    command = _command(tmp_path)
    first = _run(tmp_path, command, sigterm_at=3)
    assert first.returncode == 143, first.stderr[-3000:]
    jit_dir = tmp_path / "runs" / "sft_fsdp" / "jit"
    saved = sorted(p.name for p in jit_dir.iterdir())
    assert saved == ["last-jit-epoch=0-step=3.ckpt"], saved  # one checkpoint, no partial left, no sentinel
    assert (jit_dir / saved[0]).is_dir() and (jit_dir / saved[0] / "meta.pt").is_file()  # sharded: a directory
    assert not list(tmp_path.glob("final_*"))  # no rank finished

    second = _run(tmp_path, command, sigterm_at=3)  # the requeued job: the very same command line
    assert second.returncode == 0, second.stderr[-3000:]
    assert "last-jit-epoch=0-step=3.ckpt" in second.stdout + second.stderr  # resumed from the JIT checkpoint
    _assert_resumed_equals_uninterrupted(tmp_path, uninterrupted)


def test_lora_on_the_sharded_base_resumes_from_its_adapter_only_jit_checkpoint(tmp_path: Path):
    """The same, with LoRA adapters over the sharded, frozen base: the JIT checkpoint folder holds the adapters only,
    and the same command line resumes bit-exact with an uninterrupted LoRA run."""
    from torch.distributed.checkpoint import FileSystemReader

    lora = "--model.peft_config={r: 4, lora_alpha: 8, target_modules: all-linear}"
    interrupted, reference = tmp_path / "interrupted", tmp_path / "reference"
    interrupted.mkdir()
    reference.mkdir()
    command = _command(interrupted, lora)
    first = _run(interrupted, command, sigterm_at=3)
    assert first.returncode == 143, first.stderr[-3000:]
    folder = interrupted / "runs" / "sft_fsdp" / "jit" / "last-jit-epoch=0-step=3.ckpt"
    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("state_dict.")]
    assert weights and all(".lora_" in k for k in weights), weights  # adapter shards only, no frozen base

    second = _run(interrupted, command, sigterm_at=3)  # the requeued job: the very same command line
    assert second.returncode == 0, second.stderr[-3000:]
    assert folder.name in second.stdout + second.stderr  # resumed from the JIT checkpoint
    fresh = _run(reference, _command(reference, lora), sigterm_at=None)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    _assert_resumed_equals_uninterrupted(interrupted, reference)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_nodes(out: Path, port: int, sigterm_at: int | None) -> list[tuple[int, str]]:
    """The config on two "nodes": one torchrun launcher per node, one rank each, static rendezvous on 127.0.0.1 (the
    docs/cluster.md command with ``--nnodes 2``). Returns each node's (launcher exit status, output)."""
    # --shutdown-timeout: how long a signalled launcher lets its worker finish the JIT save before SIGKILL (default
    # 30 s, which a heavily loaded test machine could exceed)
    torchrun = [str(_tool("torchrun")), "--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1"]
    torchrun.append("--shutdown-timeout=300")
    lit_trainer = [*_command(out), "--trainer.num_nodes=2", "--trainer.devices=1"]
    env = _env(sigterm_at, FSDP_TEST_SIGTERM_TARGET="launcher")
    procs = []
    for node in (0, 1):
        with open(out / f"node{node}.log", "w") as log:
            command = [*torchrun, f"--node-rank={node}", f"--master-port={port}", *lit_trainer]
            procs.append(subprocess.Popen(command, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [proc.wait(timeout=600) for proc in procs]
    finally:
        for proc in procs:  # a hang guard, not a speed requirement: never leave a launcher behind
            if proc.poll() is None:
                proc.kill()
    return [(code, (out / f"node{node}.log").read_text()) for node, code in enumerate(codes)]


def test_two_nodes_sigterm_to_one_node_saves_once_and_the_same_commands_resume(tmp_path: Path, uninterrupted: Path):
    port = _free_port()
    first = _two_nodes(tmp_path, port, sigterm_at=3)  # rank 1 sends SIGTERM to its node's launcher after step 3
    jit_dir = tmp_path / "runs" / "sft_fsdp" / "jit"
    saved = sorted(p.name for p in jit_dir.iterdir())
    # one complete checkpoint, written by both nodes at the step they agreed on (the launcher forwards the signal
    # asynchronously, so that may be step 3 or a later one); no partial folder, no sentinel
    assert len(saved) == 1 and saved[0].startswith("last-jit-epoch="), (saved, first[0][1][-3000:], first[1][1][-3000:])
    assert (jit_dir / saved[0] / "meta.pt").is_file() and len(list((jit_dir / saved[0]).glob("*.distcp"))) == 2
    for rank in (0, 1):  # each rank left with JITCheckpoint's status, on the node its rank maps to
        assert json.loads((tmp_path / f"exit_rank{rank}.json").read_text()) == {"code": 143, "node": str(rank)}
    # node 0's launcher saw its worker exit 143 (node 1's launcher was itself signalled, and reports no status)
    assert re.search(r"exitcode\s*:\s*143", first[0][1]), first[0][1][-3000:]
    assert all(code != 0 for code, _ in first)  # torchrun reports a failed (preempted) job on both nodes
    assert not list(tmp_path.glob("final_*"))  # no rank finished

    second = _two_nodes(tmp_path, port, sigterm_at=3)  # the requeued job: the very same two commands
    assert [code for code, _ in second] == [0, 0], (second[0][1][-3000:], second[1][1][-3000:])
    assert saved[0] in second[0][1] + second[1][1]  # resumed from the JIT checkpoint
    for rank in (0, 1):
        final = torch.load(tmp_path / f"final_resumed_rank{rank}.pt")
        assert (final["node"], final["world_size"]) == (str(rank), 2)  # node rank r holds global rank r
    _assert_resumed_equals_uninterrupted(tmp_path, uninterrupted)
