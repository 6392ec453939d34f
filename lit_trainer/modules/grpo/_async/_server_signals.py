"""Imported only by the rollout workers' forkserver (first in its preload list, :func:`worker_context`): the server,
and every worker forked from it, ignore SIGTERM.

A scheduler that signals every process of a job (Slurm at the time limit, ``scancel``) must stop the training process
only: its ``JITCheckpoint`` saves, then the worker is stopped. A worker or forkserver killed first would make the
trainer see its worker dead (exit code 255) and fail without the checkpoint. The server exits with the training
process, and a worker exits as soon as it does. Never import this module in a training process.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
