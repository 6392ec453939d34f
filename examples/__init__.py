"""Runnable examples from the documentation (``docs/customizing.md``, ``CONTRIBUTING.md``); tests import them."""
