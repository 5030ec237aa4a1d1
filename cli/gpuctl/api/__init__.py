"""gpuctl's Python API: broadcast a function to every node of a cluster.

    import gpuctl

    @gpuctl.function
    def train(data):
        info = gpuctl.instance_info()
        return fit(gpuctl.shard(data))

    with gpuctl.Cluster("cluster.yaml", plugins=[gpuctl.plugins.torch()]) as cluster:
        results = train(data) @ cluster

Modules, each one job: cluster (the controller's Cluster and broadcasts as
gpuctl jobs), function (the decorator and its pending calls), wire (the call
file out, marker lines back), remote (what the node runs), runtime
(instance_info, shard, output control: stdlib only, imported on the nodes),
plugins (torch, jax, keras, huggingface).
"""
