"""Fixtures the engine test modules share."""

from __future__ import annotations

import pytest

from engine_util import Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A module's kvtier cluster: one master, a shared dir, per-node indexes and nvme dirs."""
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()
