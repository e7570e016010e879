"""tessera.etcdproc.EtcdProcess: the single-member etcd's raft timing flags."""

from __future__ import annotations

import aetcd
import pytest

from tessera.etcdproc import EtcdNotFound, EtcdProcess, find_etcd


def test_the_election_timeout_and_heartbeat_are_passed_and_none_leaves_etcds_own(tmp_path):
    cmd = EtcdProcess(tmp_path / "d", binary="etcd").command()
    assert cmd[cmd.index("--heartbeat-interval") + 1] == "10"
    assert cmd[cmd.index("--election-timeout") + 1] == "100"
    cmd = EtcdProcess(tmp_path / "d", binary="etcd", heartbeat_ms=None, election_ms=None).command()
    assert "--heartbeat-interval" not in cmd and "--election-timeout" not in cmd


async def test_a_real_etcd_started_so_grants_a_one_second_lease(tmp_path):
    """etcd raises a lease below 1.5 election timeouts (rounded up to a second) to that
    floor: 2 s with its default 1000 ms, 1 s with this class's 100 ms."""
    try:
        find_etcd()
    except EtcdNotFound as e:
        pytest.skip(str(e))
    with EtcdProcess(tmp_path / "d", unsafe_no_fsync=True) as etcd:
        host, port = etcd.endpoint.rsplit(":", 1)
        c = aetcd.Client(host=host, port=int(port))
        await c.connect()
        try:
            lease = await c.lease(1)
            assert lease.ttl == 1
        finally:
            await c.close()
