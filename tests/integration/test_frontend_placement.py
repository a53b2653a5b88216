"""kvgrid's Serve deployments on a simulated three-node Ray cluster: gateway replicas go to the CPU nodes marked
with the ``kvgrid_frontend`` resource, spread over them, and never to a GPU node; a deployment that fails to start
says why."""

from __future__ import annotations

import pytest
import ray


@pytest.fixture(scope="module")
def front_nodes():
    """A separate three-node cluster: a GPU-like head without the frontend resource, two CPU frontend nodes."""
    from ray import serve
    from ray.cluster_utils import Cluster

    from harness import free_port
    from router.control.serve import FRONTEND_RESOURCE

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "resources": {"fake_gpu": 2},
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    front = [
        cluster.add_node(num_cpus=2, resources={FRONTEND_RESOURCE: 10}, node_ip_address="127.0.0.1") for _ in range(2)
    ]
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        yield front
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_gateway_replicas_spread_over_the_frontend_cpu_nodes_and_never_on_a_gpu_node(front_nodes):
    from ray import serve

    from router.control.serve import frontend_actor_options

    @serve.deployment
    class Where:
        def __call__(self, _request=None) -> str:
            return ray.get_runtime_context().get_node_id()

    app = Where.options(num_replicas=2, ray_actor_options=frontend_actor_options()).bind()
    handle = serve.run(app, name="where", route_prefix="/where")
    replicas: set[str] = set()
    for _ in range(40):  # requests go to either replica
        replicas |= {r.result() for r in [handle.remote() for _ in range(4)]}
    assert replicas == {n.node_id for n in front_nodes}  # one replica on each frontend node, none on the head


def test_a_deployment_that_fails_to_start_says_why(front_nodes):
    """Serve's own error names only the failed deployment; kvgrid serve's (run_app) carries the reason, here
    the replica constructor's exception (in production e.g. http.port taken, or the tokenizer folder missing)."""
    from ray import serve

    from router.control.serve import frontend_actor_options, run_app

    @serve.deployment
    class Broken:
        def __init__(self) -> None:
            raise ValueError("tokenizer folder /nowhere is missing")

    with pytest.raises(RuntimeError) as exc:
        run_app(Broken.options(ray_actor_options=frontend_actor_options()).bind(), "broken")
    assert "'broken' did not start" in str(exc.value)
    assert "tokenizer folder /nowhere is missing" in str(exc.value)  # from Serve's status
