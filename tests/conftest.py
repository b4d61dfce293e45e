"""Shared fixtures of the unit tests: the real default model's checkpoint (loaded in-process)."""

from model_fixtures import model_path  # noqa: F401 - the session fixture
