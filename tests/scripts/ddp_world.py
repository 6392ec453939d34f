"""Several 2-rank scripts of ``tests/scripts`` run one after the other in ONE pair of processes (a "world").

Starting a 2-rank run costs two interpreters that import torch, Lightning and transformers: ~20 s of CPU before the
first step, more than most of the scripts' own work. The tests share one world instead (``helpers.ddp.World``, the
session fixture ``ddp_world``): each part is the unchanged script, run as ``__main__`` with ``sys.argv`` set to
``[script, OUT_DIR/PART, *args]``, exactly as if started on its own, so it writes the same files.

Started once per rank by ``helpers.ddp.run_world`` with ``LOCAL_RANK``, ``WORLD_SIZE``, ``NODE_RANK`` and
``MASTER_ADDR``/``MASTER_PORT`` set, as torchrun starts a run: Lightning then starts no process itself, and the
process group made by the first fit is reused by every later fit (Lightning skips an initialised one).

Usage: ``python ddp_world.py OUT_DIR PART [PART ...]`` with PART a key of ``helpers.ddp.WORLD``. After each part
both ranks write ``OUT_DIR/PART/done_rank<r>``; a part that raises writes its traceback to
``OUT_DIR/PART/error_rank<r>.txt`` and the process exits 1 at once (the launcher then stops the other rank, which
would wait in a collective), so the parts after it do not run: their tests run their scripts alone instead.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

if __name__ == "__main__":
    from helpers.ddp import SCRIPTS, WORLD

    root, rank = Path(sys.argv[1]), os.environ["LOCAL_RANK"]
    for name in sys.argv[2:]:
        script, args = WORLD[name].script, WORLD[name].args
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        sys.argv = [str(SCRIPTS / script), str(out), *args]
        print(f"[ddp_world] rank {rank}: {name} = {script} {' '.join(args)}", flush=True)
        try:
            try:
                runpy.run_path(str(SCRIPTS / script), run_name="__main__")
            except SystemExit as stop:  # the end of a script, as when it runs alone, unless with an error status
                if stop.code not in (None, 0):
                    raise
        except BaseException:
            (out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        (out / f"done_rank{rank}").touch()
