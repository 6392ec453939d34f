"""Fixtures and session settings only; shared test code (tiny models, modules, launchers) is in ``tests/helpers``."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# trackio picks its store when it is imported: the tests' runs go to a temporary one, never the user's
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="lit_trainer_trackio_")
torch.set_num_threads(max(1, int(os.environ.get("LIT_TRAINER_TEST_THREADS", "1"))))


@pytest.fixture
def tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


# The longest tests (minutes each on one core) run first: pytest-xdist hands tests out in collection order, and
# started last they made a tail of a few minutes with one worker idle. Only the order changes.
LONGEST_FIRST = ("test_sft_learns.py", "test_real_model.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every multi-process test (``ddp``) is also ``slow``, so ``-m "not slow"`` leaves it out; the longest tests
    are collected first (:data:`LONGEST_FIRST`)."""
    for item in items:
        if item.get_closest_marker("ddp") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def ddp_world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The shared 2-rank world (``helpers.ddp.World``): the parts used by this session's selected tests, run once
    for all pytest-xdist workers (their common temporary root holds the outputs)."""
    from helpers.ddp import WORLD, World

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers
    users = {item.path.name for item in request.session.items if "ddp_world" in item.fixturenames}
    return World(root, [name for name, part in WORLD.items() if users.intersection(part.users)])
