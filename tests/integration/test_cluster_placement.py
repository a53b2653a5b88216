"""Placement on a simulated two-node Ray cluster (ray.cluster_utils; a custom resource stands in for GPUs)."""

from __future__ import annotations

import pytest
import ray

from worker.engine import EngineConfig


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 3,
            "resources": {"fake_gpu": 2},
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=3, resources={"fake_gpu": 2}, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def nodes_of(group) -> set[str]:
    from ray.util.placement_group import placement_group_table

    return set(placement_group_table(group._pg)["bundles_to_node_id"].values())


def test_tp2_groups_land_whole_on_one_node_and_spread_over_nodes(two_nodes, demo_path):
    from worker.group import GroupConfig, WorkerGroup

    engine = EngineConfig(model=str(demo_path), device="cpu", num_blocks=64)
    a = WorkerGroup(GroupConfig("place-a", engine, tp=2, accelerator="fake_gpu"))
    b = WorkerGroup(GroupConfig("place-b", engine, tp=2, accelerator="fake_gpu"))
    try:
        assert len(nodes_of(a)) == 1 and len(nodes_of(b)) == 1
        assert nodes_of(a) != nodes_of(b)
        assert len(b.generate([1, 2, 3], None).token_ids) >= 1
        with pytest.raises(RuntimeError, match="needs 2 x fake_gpu on one node"):
            WorkerGroup(GroupConfig("place-c", engine, tp=2, accelerator="fake_gpu"))
    finally:
        a.shutdown()
        b.shutdown()
