"""Shared test code: tiny models, plain LightningModules, data and subprocess launchers (no fixtures: those live in
``tests/conftest.py``).

How it is found: ``tests/`` and ``tests/scripts/`` are on ``sys.path`` of the pytest process through
``pythonpath = [".", "tests", "tests/scripts"]`` in ``pyproject.toml``'s ``[tool.pytest.ini_options]`` (``.``, the
repository root, for ``import examples``), so a test writes
``from helpers.models import tiny_llama`` (and may import a script's functions, ``from ddp_grpo import ...``). A
script under ``tests/scripts/`` runs in its own process; start it with :func:`helpers.ddp.run_script` or
:func:`helpers.ddp.launch_script`, whose environment (:func:`helpers.ddp.script_env`) puts ``tests/`` on
``PYTHONPATH``, so the script imports ``helpers`` the same way (Lightning's DDP launcher passes the environment on to
the other ranks). By hand: ``PYTHONPATH=tests python tests/scripts/<script>.py OUT``.

Modules, one concept each: ``models`` (tiny Llama builders), ``modules`` (plain LightningModules for callback
tests), ``data`` (small datasets), ``ddp`` (running the multi-process scripts).
"""
