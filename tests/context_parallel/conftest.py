"""The training tests' tiny indexed dataset, shared with the context-parallel tests."""

from tests.training.conftest import tiny_data  # noqa: F401
