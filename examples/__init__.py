"""Runnable examples (python examples/<name>.py); tests import their models and helpers from here."""
