"""Shared pytest fixtures for the e2e suite (see e2e/README.md).

Fixtures:
  e2e_bin_dir   (session) bin dir with the cluster binaries; skips if Go is missing
  kwok_cluster  (session) a running KwokCluster (deleted at the end of the session)
  pod_runner    (function) a started PodRunner for kwok_cluster's GPU node(s);
                python3 in pod commands is this interpreter
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from e2e.cluster import GoMissing, KwokCluster, build_binaries, find_go
from e2e.podrunner import PodRunner

# A cold build of the binaries can take a while on a small CI box; e2e tests
# get a generous pytest-timeout unless they set their own marker.
E2E_TEST_TIMEOUT = int(os.environ.get("NAIAD_E2E_TEST_TIMEOUT", str(90 * 60)))


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("pytest_timeout") is None:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here + os.sep) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TEST_TIMEOUT))


@pytest.fixture(scope="session")
def e2e_bin_dir():
    if find_go() is None and not os.environ.get("NAIAD_E2E_BIN"):
        pytest.skip("Go toolchain missing: cannot build the e2e cluster binaries (see e2e/README.md)")
    try:
        return build_binaries()
    except GoMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def kwok_cluster(e2e_bin_dir):
    c = KwokCluster(bin_dir=e2e_bin_dir)
    c.create()
    try:
        yield c
    finally:
        c.delete()


@pytest.fixture
def pod_runner(kwok_cluster):
    r = PodRunner(
        kwok_cluster.kubeconfig,
        kwok_cluster.runner_node_names,
        executables={"python3": sys.executable},
        max_probe_period=1.0,
    )
    r.start()
    try:
        yield r
    finally:
        r.stop()
