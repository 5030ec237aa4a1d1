"""JAX across the nodes of a cluster: jax.distributed from the jax plugin.

    python examples/python-api/jax_allgather.py

Each node is one JAX process (CPU here: jax's gloo collectives); the plugin
points them at a coordinator on the head and calls jax.distributed.initialize
before the function runs. Each node fits a line to its shard of the data, and
the nodes average their estimates with an all-gather.
"""

import gpuctl


@gpuctl.function
def fit(xs: list, ys: list) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    x, y = gpuctl.shard(xs, ys, shuffle=True, seed=0)  # this node's part, still aligned
    x, y = jnp.asarray(x), jnp.asarray(y)
    slope = jnp.sum((x - x.mean()) * (y - y.mean())) / jnp.sum((x - x.mean()) ** 2)
    every = multihost_utils.process_allgather(jnp.array([slope]))  # one estimate per node, on every node
    return {"node": jax.process_index(), "nodes": jax.process_count(), "samples": int(x.shape[0]),
            "slope": float(slope), "mean_slope": float(every.mean())}


if __name__ == "__main__":
    xs = [i / 100 for i in range(400)]
    ys = [3.0 * x + 1.0 + ((i * 37) % 11 - 5) / 50 for i, x in enumerate(xs)]
    with gpuctl.Cluster(infra="local", num_nodes=2, plugins=[gpuctl.plugins.jax()]) as cluster:
        results = fit(xs, ys) @ cluster
    for r in results:
        print(f"node {r['node']} of {r['nodes']}: {r['samples']} samples, slope {r['slope']:.3f}, "
              f"mean over nodes {r['mean_slope']:.3f}")
