"""The suite's order under xdist and its durations record: tests/suite_order.py."""
from tests.suite_order import (  # noqa: F401 (pytest hooks)
    pytest_addoption, pytest_collection_modifyitems, pytest_configure, pytest_runtest_logreport,
    pytest_sessionfinish,
)
