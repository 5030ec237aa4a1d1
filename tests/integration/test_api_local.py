"""The Python API on real local nodes, through gpuctl's public names only.

One 3-node cluster, brought up by a `with gpuctl.Cluster(..., keep=True)` block
in the module's fixture and used by later `with` blocks that name it (reused:
no Terraform change, no prepare); one 1-node cluster of its own for keep=False:

- results come back in rank order, `>>` runs on the head alone, instance_info()
  says where each rank is, and the broadcast is a job in `gpuctl queue`;
- shard(): parts disjoint and covering, several arrays aligned, the same
  shuffle on every node, the types kept (list, numpy, torch);
- @gpuctl.stdout(only="head") prints once, a predicate picks ranks, @gpuctl.silent none;
- an exception on rank 1 raises on the controller with its traceback, and no
  other rank survives (fail-fast);
- a node that cannot load the function is one error naming the nodes and the module;
- huggingface(token=...) reaches the function as HF_TOKEN and is in no file
  on the controller or the nodes, nor in the output;
- the torch plugin's all_reduce gives the same value on every rank (gloo), and
  the DDP example (examples/python-api/ddp.py) trains the same model on every rank;
- the jax plugin's collectives across processes (when jax is installed);
- a second `with` on the kept cluster reuses it; keep=False leaves nothing behind.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import gpuctlfork
import pytest

import gpuctl
from e2e import Cluster as Local
from e2e import files_containing, gpuctl_env, needs_local_nodes, running

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "api3"
MOD = f"api{uuid.uuid4().hex[:10]}"
SHARED = Path(f"/tmp/{MOD}")  # every netns node sees this machine's /tmp


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory):
    """The 3-node cluster: made by a kept `with` block, torn down at the end of the module."""
    state = tmp_path_factory.mktemp("api") / "state"
    old = os.environ.get("GPUCTL_STATE_DIR")
    os.environ["GPUCTL_STATE_DIR"] = str(state)
    SHARED.mkdir()
    try:
        with gpuctl.Cluster(name=NAME, infra="local", num_nodes=3, keep=True) as cluster:
            assert cluster.created
        yield Local(NAME, state)
    finally:
        try:
            if (state / "clusters" / NAME).exists():
                gpuctl.Cluster(name=NAME).down()
        finally:
            subprocess.run(["rm", "-rf", str(SHARED)], check=False)
            if old is None:
                os.environ.pop("GPUCTL_STATE_DIR", None)
            else:
                os.environ["GPUCTL_STATE_DIR"] = old


@pytest.fixture(autouse=True)
def _state(kept: Local, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(kept.state_dir))  # over conftest's per-test state dir


@gpuctl.function
def where(x: int, y: int = 1) -> dict:
    info = gpuctl.instance_info()
    return {"rank": info.node, "total": info.total_nodes, "head": info.is_head, "head_addr": info.head_addr,
            "addr": info.addr, "peers": [p.addr for p in info.peers], "sum": x + y}


def test_results_in_rank_order_head_only_and_in_the_queue(kept: Local):
    nodes = kept.nodes()
    with gpuctl.Cluster(name=NAME) as cluster:
        results = where(2, y=3) @ cluster
        head = where(5) >> cluster
    addrs = [n.address for n in nodes]
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["addr"] for r in results] == addrs
    assert all(r["total"] == 3 and r["sum"] == 5 and r["head_addr"] == addrs[0] and r["peers"] == addrs
               for r in results), results
    assert [r["head"] for r in results] == [True, False, False]
    assert head == {**results[0], "total": 1, "sum": 6, "peers": addrs[:1]}
    queue = gpuctlfork.run(["queue", NAME], env=gpuctl_env(kept.state_dir),
                           timeout=60)
    rows = [line.split() for line in queue.stdout.splitlines() if " where " in line]
    assert [(r[1], r[2]) for r in rows[-2:]] == [("where", "SUCCEEDED")] * 2, queue.stdout
    assert rows[-1][-1] == "0" and rows[-2][-1] == "0,0,0", queue.stdout


def test_shards_disjoint_covering_aligned_and_shuffled_alike():
    import numpy as np
    import torch

    @gpuctl.function
    def parts(xs, ys, arr, ten):
        a, b = gpuctl.shard(xs, ys, shuffle=True, seed=7)
        plain = gpuctl.shard(xs)
        return {"a": a, "b": b, "plain": plain, "arr": gpuctl.shard(arr, drop_last=True),
                "ten": gpuctl.shard(ten, shuffle=True, seed=7)}

    xs = list(range(23))
    ys = [x * 10 for x in xs]
    with gpuctl.Cluster(name=NAME) as cluster:
        got = parts(xs, ys, np.arange(23), torch.arange(23)) @ cluster
    shuffled = [v for g in got for v in g["a"]]
    assert sorted(shuffled) == xs and len(set(shuffled)) == 23  # disjoint and covering
    assert all(g["b"] == [x * 10 for x in g["a"]] for g in got)  # aligned
    assert shuffled != [v for g in got for v in g["plain"]]  # shuffled ...
    assert all(g["ten"].tolist() == g["a"] for g in got)  # ... alike on every node (the same seed)
    assert [g["plain"] for g in got] == [xs[0::3], xs[1::3], xs[2::3]]  # modulo striding
    assert [type(g["arr"]).__name__ for g in got] == ["ndarray"] * 3 and {len(g["arr"]) for g in got} == {7}
    assert all(isinstance(g["ten"], torch.Tensor) for g in got)


def test_output_control(capsys: pytest.CaptureFixture[str]):
    tag = uuid.uuid4().hex[:8]

    @gpuctl.function
    @gpuctl.stdout(only="head")
    def head_talks():
        print(f"head-only-{tag} from {gpuctl.instance_info().node}")

    @gpuctl.function
    @gpuctl.stdout(only=lambda info: info.node >= 1)
    def workers_talk():
        print(f"picked-{tag} from {gpuctl.instance_info().node}")

    @gpuctl.function
    @gpuctl.silent
    def quiet():
        print(f"silent-{tag}")
        print(f"silent-err-{tag}", file=sys.stderr)
        return 7

    with gpuctl.Cluster(name=NAME) as cluster:
        head_talks() @ cluster
        workers_talk() @ cluster
        assert quiet() @ cluster == [7, 7, 7]
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line for line in lines if f"head-only-{tag}" in line] == [f"(head, rank=0) head-only-{tag} from 0"], out
    assert sorted(line for line in lines if f"picked-{tag}" in line) == [
        f"(worker1, rank=1) picked-{tag} from 1", f"(worker2, rank=2) picked-{tag} from 2"], out
    assert f"silent-{tag}" not in out and f"silent-err-{tag}" not in out
    assert "__GPUCTL_CALL__" not in out  # the results' marker lines are taken out
    # a call's own file is gpuctl's plumbing: neither its copy nor its path is shown
    assert ".pkl" not in out and "file_mounts" not in out and "Copying" not in out, out


def test_exception_on_rank_1_raises_with_traceback_and_stops_the_others():
    pids = SHARED / "pids"
    pids.mkdir()
    pids.chmod(0o1777)  # the nodes' login user (not root) writes there, as users do in /tmp

    @gpuctl.function
    def fails_on_one(folder):
        import os
        import time

        rank = gpuctl.instance_info().node
        (folder / f"rank{rank}").write_text(str(os.getpid()))
        if rank == 1:
            while len(list(folder.iterdir())) < 3:  # the others are up and sleeping
                time.sleep(0.05)
            raise ValueError(f"bad shard on rank {rank}")
        time.sleep(120)

    started = time.monotonic()
    with gpuctl.Cluster(name=NAME) as cluster, pytest.raises(gpuctl.RemoteError) as caught:
        fails_on_one(pids) @ cluster
    assert time.monotonic() - started < 60
    err = caught.value
    assert (err.rank, err.node, err.type_name) == (1, "worker1", "ValueError"), str(err)
    assert isinstance(err.exception, ValueError) and str(err.exception) == "bad shard on rank 1"
    assert "rank 1 (worker1" in str(err) and "raised ValueError: bad shard on rank 1" in str(err)
    assert 'raise ValueError(f"bad shard on rank {rank}")' in err.remote_traceback
    assert "in fails_on_one" in str(err)
    assert isinstance(err, gpuctl.JobFailed)
    left = [int(p.read_text()) for p in pids.iterdir()]
    assert len(left) == 3
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in left) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in left if running(pid)], "a rank survived the failure"


def test_missing_module_on_the_nodes_is_one_error(tmp_path: Path):
    mod = f"{MOD}_only_here"
    (tmp_path / f"{mod}.py").write_text("class Thing:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        spec = importlib.util.spec_from_file_location(mod, tmp_path / f"{mod}.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[mod] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]

        @gpuctl.function
        def uses(thing):
            return type(thing).__name__

        with gpuctl.Cluster(name=NAME) as cluster, pytest.raises(gpuctl.RemoteError) as caught:
            uses(module.Thing()) @ cluster
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(mod, None)
    message = str(caught.value)
    assert caught.value.missing_module == mod
    assert message.startswith("the function cannot be loaded on "), message
    assert f"No module named '{mod}'" in message and "(rank " in message and "packages=" in message
    assert "\n" not in message  # one line


def test_torch_plugin_all_reduce_is_the_same_on_every_rank():
    @gpuctl.function
    def reduce():
        import os

        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                                          "LOCAL_WORLD_SIZE", "NODE_RANK")}
        return t.item(), dist.get_backend(), env

    with gpuctl.Cluster(name=NAME, plugins=[gpuctl.plugins.torch()]) as cluster:
        got = reduce() @ cluster
        again = reduce() @ cluster  # the process group was destroyed and made again
    assert [g[0] for g in got] == [6.0, 6.0, 6.0] and [g[0] for g in again] == [6.0] * 3
    assert {g[1] for g in got} == {"gloo"}
    head = got[0][2]["MASTER_ADDR"]
    assert [g[2] for g in got] == [{"MASTER_ADDR": head, "MASTER_PORT": "29500", "WORLD_SIZE": "3", "RANK": str(r),
                                    "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": str(r)}
                                   for r in range(3)]


def test_the_ddp_example_trains_in_step(capsys: pytest.CaptureFixture[str]):
    """examples/python-api/ddp.py (Skyward's DDP example with gpuctl in place of skyward)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "python-api" / "ddp.py"
    spec = importlib.util.spec_from_file_location(f"{MOD}_ddp", path)
    example = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(example)  # type: ignore[union-attr]
    with gpuctl.Cluster(name=NAME, plugins=[gpuctl.plugins.torch()]) as cluster:
        results = example.train() @ cluster
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert len({round(r["checksum"], 4) for r in results}) == 1  # DDP kept the models equal
    epochs = [line for line in capsys.readouterr().out.splitlines() if "Epoch " in line]
    assert len(epochs) == 10 and all(line.startswith("(head, rank=0) Epoch ") for line in epochs)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed (make test installs it)")
def test_jax_plugin_collectives_across_nodes():
    @gpuctl.function
    def gather():
        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils

        mine = jnp.array([float(jax.process_index() + 1)])
        return jax.process_count(), multihost_utils.process_allgather(mine).ravel().tolist()

    with gpuctl.Cluster(name=NAME, plugins=[gpuctl.plugins.jax()]) as cluster:
        got = gather() @ cluster
    assert got == [(3, [1.0, 2.0, 3.0])] * 3


def test_huggingface_token_reaches_the_function_and_nothing_else(kept: Local, capsys: pytest.CaptureFixture[str]):
    token = f"hf_{uuid.uuid4().hex}"

    @gpuctl.function
    def sees_token(expected_len):
        import os

        return len(os.environ.get("HF_TOKEN", "")) == expected_len

    with gpuctl.Cluster(name=NAME, plugins=[gpuctl.plugins.huggingface(token=token)]) as cluster:
        assert sees_token(len(token)) @ cluster == [True, True, True]
    out = capsys.readouterr()
    assert token not in out.out + out.err
    assert files_containing(kept.state_dir, token, skip=[kept.cdir / "nodes"]) == []
    for node in kept.nodes():  # the call file has no token, and the job's secrets.sh is gone
        assert kept.ssh(node, f"grep -rlF {token} ~/.gpuctl || true").stdout.split() == [], node.name


def test_second_with_reuses_the_kept_cluster(kept: Local):
    ids = [n.name for n in kept.nodes()]
    before = (kept.cdir / "inventory.yml").read_text()
    with gpuctl.Cluster(name=NAME, infra="local", num_nodes=3) as cluster:  # same shape: Terraform changes nothing
        assert not cluster.created
        assert [r["rank"] for r in where(1) @ cluster] == [0, 1, 2]
    assert (kept.cdir / "inventory.yml").read_text() == before and [n.name for n in kept.nodes()] == ids
    assert kept.cdir.is_dir()  # it existed before the block: still there


def test_keep_false_leaves_nothing_behind(kept: Local, capsys: pytest.CaptureFixture[str]):
    script = textwrap.dedent("""\
        @gpuctl.function
        def hi():
            return gpuctl.instance_info().total_nodes
    """)
    namespace: dict = {"gpuctl": gpuctl}
    exec(compile(script, "<api-test>", "exec"), namespace)  # noqa: S102 - a function from no module, as in a notebook
    with gpuctl.Cluster(infra="local", num_nodes=1) as cluster:
        local = Local(cluster.name, kept.state_dir)
        footprint = local.footprint()
        footprint.assert_present(1)
        assert namespace["hi"]() @ cluster == [1]
    footprint.assert_gone()
    assert f"Cluster '{local.name}' is gone." in capsys.readouterr().out
