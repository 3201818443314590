"""Fixtures shared with the training tests."""

from tests.training.conftest import tiny_data  # noqa: F401  (the tiny indexed dataset)
