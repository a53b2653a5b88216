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
        head_node_args={"num_cpus": 3, "resources": {"fake_gpu": 2}, "node_ip_address": "127.0.0.1",
                        "include_dashboard": False},
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


def test_gateway_replicas_spread_over_the_frontend_cpu_nodes_and_never_on_a_gpu_node():
    """A separate three-node cluster: a GPU-like head without the frontend resource, two CPU frontend nodes."""
    from ray import serve
    from ray.cluster_utils import Cluster

    from router.serve import FRONTEND_RESOURCE, frontend_actor_options

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"fake_gpu": 2}, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    front = [cluster.add_node(num_cpus=2, resources={FRONTEND_RESOURCE: 10}, node_ip_address="127.0.0.1")
             for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()

        @serve.deployment
        class Where:
            def __call__(self, _request=None) -> str:
                return ray.get_runtime_context().get_node_id()

        from harness import free_port

        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        app = Where.options(num_replicas=2, ray_actor_options=frontend_actor_options()).bind()
        handle = serve.run(app, name="where", route_prefix="/where")
        replicas: set[str] = set()
        for _ in range(40):  # requests go to either replica
            replicas |= {r.result() for r in [handle.remote() for _ in range(4)]}
        assert replicas == {n.node_id for n in front}  # one replica on each frontend node, none on the head
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
