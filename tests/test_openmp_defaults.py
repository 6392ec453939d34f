"""The ``lit-trainer`` command's OpenMP default (``lit_trainer.cli.openmp``): waiting threads spin briefly, then sleep;
the user's choice wins.

The effective setting is read from libgomp itself: ``OMP_DISPLAY_ENV=VERBOSE`` makes it print, when torch loads it,
the spin count it will use (0 = passive, 300000 = libgomp's default, 30000000000 = ``OMP_WAIT_POLICY=ACTIVE``).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lit_trainer.cli.cpu_threads import oversubscription_warning, waits_passively
from lit_trainer.cli.openmp import WAIT_VARIABLES, apply_openmp_defaults, openmp_defaults

ROOT = Path(__file__).resolve().parents[1]
OPENMP = (*WAIT_VARIABLES, "OMP_NUM_THREADS", "OMP_DISPLAY_ENV")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP}
    return {**env, "OMP_DISPLAY_ENV": "VERBOSE", **extra}


def libgomp_settings(stderr: str) -> dict[str, str]:
    """``{name: value}`` of the block libgomp printed to stderr."""
    return dict(re.findall(r"^\s+([A-Z_]+) = '([^']*)'", stderr, flags=re.MULTILINE))


def test_default_is_a_short_spin_on_free_cores_passive_on_busy_ones_and_leaves_the_thread_count():
    assert openmp_defaults({}, load=1.5, cores=2) == {"GOMP_SPINCOUNT": "10000"}
    assert openmp_defaults({}, load=2.5, cores=2) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_defaults({"OMP_NUM_THREADS": "4"}, load=0, cores=2) == {"GOMP_SPINCOUNT": "10000"}  # count untouched
    assert openmp_defaults({"OMP_WAIT_POLICY": ""}, load=0, cores=2) == {"GOMP_SPINCOUNT": "10000"}  # empty = unset


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "5"}, {"KMP_BLOCKTIME": "200"}])
def test_a_wait_variable_the_user_set_wins(user):
    assert openmp_defaults(user, load=0, cores=2) == {} and openmp_defaults(user, load=9, cores=2) == {}
    environ = dict(user)
    assert apply_openmp_defaults(environ) == {} and environ == user


def test_apply_sets_only_the_spin_count():
    environ = {"OMP_NUM_THREADS": "2", "PATH": "/bin"}
    assert apply_openmp_defaults(environ, load=0.5, cores=2) == {"GOMP_SPINCOUNT": "10000"}
    assert environ == {"OMP_NUM_THREADS": "2", "PATH": "/bin", "GOMP_SPINCOUNT": "10000"}


def test_warning_is_for_spinning_waits_only():
    assert waits_passively({"OMP_WAIT_POLICY": " Passive "}) and waits_passively({"GOMP_SPINCOUNT": "0"})
    assert waits_passively({"GOMP_SPINCOUNT": "10000"}) and not waits_passively({"GOMP_SPINCOUNT": "300000"})
    assert not waits_passively({}) and not waits_passively({"OMP_WAIT_POLICY": "ACTIVE"})
    assert oversubscription_warning(2, 2, 9.0, 1.0, passive=True) is None
    message = oversubscription_warning(2, 2, 9.0, 1.0, passive=False)
    assert message and "GOMP_SPINCOUNT=10000" in message and "OMP_NUM_THREADS=1" in message


def test_importing_the_library_changes_nothing():
    code = "import os, lit_trainer, torch; torch.ones(1); print(os.environ.get('OMP_WAIT_POLICY'))"
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "None"
    assert libgomp_settings(proc.stderr)["GOMP_SPINCOUNT"] == "300000"  # libgomp's own default: spin, then sleep


def lit_trainer_help(**extra: str) -> dict[str, str]:
    exe = Path(sys.executable).with_name("lit-trainer")
    proc = subprocess.run([str(exe), "fit", "--help"], env=clean_env(**extra), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return libgomp_settings(proc.stderr)


@pytest.mark.slow
def test_console_script_sets_libgomps_waits_from_the_load():
    settings = lit_trainer_help()
    # the load may change between the two readings around the run: accept the choice for either side of the cores
    assert settings["GOMP_SPINCOUNT"] in {"10000", "0"}  # the short spin, or passive (0) on busy cores


@pytest.mark.slow
def test_console_script_keeps_the_users_openmp_settings():
    settings = lit_trainer_help(OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1")
    assert settings["OMP_WAIT_POLICY"] == "ACTIVE" and settings["GOMP_SPINCOUNT"] == "30000000000"
    assert settings["OMP_NUM_THREADS"] == "1"
    assert lit_trainer_help(GOMP_SPINCOUNT="1000")["GOMP_SPINCOUNT"] == "1000"
