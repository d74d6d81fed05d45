"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest

from tests.zoo_runs import ZooRuns


@pytest.fixture(scope="session")
def zoo_runs(tmp_path_factory: pytest.TempPathFactory) -> ZooRuns:
    return ZooRuns(tmp_path_factory.mktemp("zoo-runs"))
