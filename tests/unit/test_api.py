"""The Python API's parts without nodes: shard, instance_info, output control,
plugins' environment, the call file and marker lines, the node-side runner,
the nodes' venv record, and that `import gpuctl` stays cheap."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import gpuctl
from gpuctl.api import plugins, runtime, wire
from gpuctl.api.cluster import Cluster, _by_value_modules, dumps_call, run_script
from gpuctl.common.errors import UserError
from gpuctl.configplane import prepare

INFO = json.dumps({"cluster_name": "c", "cloud": "local", "region": None, "zone": None, "num_nodes": 3,
                   "ips": ["10.0.0.1", "10.0.0.2", "10.0.0.3"]})


def job_env(rank: int, **extra: str) -> dict[str, str]:
    return {"GPUCTL_NODE_RANK": str(rank), "GPUCTL_CLUSTER_INFO": INFO, "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500", "GPUCTL_NUM_GPUS_PER_NODE": "0", "GPUCTL_TASK_ID": "t-1", **extra}


@pytest.fixture
def on_rank(monkeypatch: pytest.MonkeyPatch):
    def set_rank(rank: int) -> None:
        for key, value in job_env(rank).items():
            monkeypatch.setenv(key, value)
    return set_rank


# -- instance_info -------------------------------------------------------------------


def test_instance_info_from_a_jobs_environment():
    info = runtime.instance_info(job_env(2, GPUCTL_NUM_GPUS_PER_NODE="8"))
    assert (info.node, info.total_nodes, info.is_head, info.head_addr, info.head_port, info.accelerators) == \
        (2, 3, False, "10.0.0.1", 29500, 8)
    assert [(p.node, p.addr) for p in info.peers] == [(0, "10.0.0.1"), (1, "10.0.0.2"), (2, "10.0.0.3")]
    assert info.addr == "10.0.0.3" and info.cluster == "c" and info.task_id == "t-1"
    assert runtime.instance_info(job_env(0)).is_head


def test_instance_info_outside_a_job_says_so():
    with pytest.raises(RuntimeError, match="not inside a gpuctl job"):
        runtime.instance_info({})


# -- shard -------------------------------------------------------------------------


@pytest.mark.parametrize("n,nodes", [(10, 3), (3, 5), (0, 2), (7, 1)])
def test_shard_indices_disjoint_and_covering(n: int, nodes: int):
    parts = [runtime.shard_indices(n, k, nodes) for k in range(nodes)]
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert parts[0] == list(range(0, n, nodes))  # modulo striding
    shuffled = [runtime.shard_indices(n, k, nodes, shuffle=True, seed=3) for k in range(nodes)]
    assert sorted(i for p in shuffled for i in p) == list(range(n))
    assert shuffled == [runtime.shard_indices(n, k, nodes, shuffle=True, seed=3) for k in range(nodes)]


def test_shard_drop_last_evens_out():
    parts = [runtime.shard_indices(10, k, 3, drop_last=True) for k in range(3)]
    assert [len(p) for p in parts] == [3, 3, 3]


def test_shard_keeps_types_and_alignment():
    import torch  # here, not at the top: at collection it would cost every test worker 3 s

    xs, ys = list(range(10)), tuple(range(100, 110))
    a, b = gpuctl.shard(xs, ys, node=1, total_nodes=3)
    assert a == [1, 4, 7] and b == (101, 104, 107)
    arr = gpuctl.shard(np.arange(10), node=2, total_nodes=3)
    assert isinstance(arr, np.ndarray) and arr.tolist() == [2, 5, 8]
    ten, lst = gpuctl.shard(torch.arange(10) * 2, xs, shuffle=True, seed=9, node=0, total_nodes=2)
    assert isinstance(ten, torch.Tensor) and ten.tolist() == [2 * v for v in lst]
    assert gpuctl.shard("abcdef", node=0, total_nodes=2) == "ace"
    assert gpuctl.shard(np.arange(2), node=2, total_nodes=3).tolist() == []


def test_shard_seed_changes_the_order_and_reads_instance_info(on_rank):
    on_rank(1)
    one = gpuctl.shard(list(range(30)), shuffle=True, seed=1)
    assert one == gpuctl.shard(list(range(30)), shuffle=True, seed=1)
    assert one != gpuctl.shard(list(range(30)), shuffle=True, seed=2)
    assert len(one) == 10


def test_shard_refuses_misaligned_arrays():
    with pytest.raises(ValueError, match="differ in length"):
        gpuctl.shard([1, 2], [1, 2, 3], node=0, total_nodes=2)


# -- output control ------------------------------------------------------------------


def test_stdout_only_head_and_predicates(on_rank, capsys: pytest.CaptureFixture[str]):
    @gpuctl.stdout(only="head")
    def talk(x):
        print("hello", x)
        print("err", x, file=sys.stderr)
        return x * 2

    @gpuctl.stdout(only=lambda info: info.node == 2)
    def picked():
        print("picked")

    for rank in range(3):
        on_rank(rank)
        assert talk(rank) == rank * 2
        picked()
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["hello 0", "picked"]
    assert captured.err.splitlines() == ["err 0", "err 1", "err 2"]  # stdout only
    assert talk.__name__ == "talk"


def test_silent_and_stderr(on_rank, capsys: pytest.CaptureFixture[str]):
    @gpuctl.silent
    def quiet():
        print("out")
        print("err", file=sys.stderr)
        return 1

    @gpuctl.stderr(only="head")
    def errs():
        print("err", file=sys.stderr)

    on_rank(0)
    assert quiet() == 1
    errs()
    on_rank(1)
    errs()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "err\n"
    assert sys.stdout is not None and not isinstance(sys.stdout, io.StringIO)


def test_output_control_pickles_with_the_function(on_rank, capsys: pytest.CaptureFixture[str]):
    wrapped = cloudpickle.loads(cloudpickle.dumps(gpuctl.stdout(only="head")(lambda: print("x"))))
    on_rank(1)
    wrapped()
    assert capsys.readouterr().out == ""


def test_bad_only_is_refused():
    with pytest.raises(ValueError, match="only='workers'"):
        gpuctl.stdout(only="workers")


# -- plugins ----------------------------------------------------------------------------


def test_torch_plugin_env_and_packages():
    info = runtime.instance_info(job_env(1))
    plugin = gpuctl.plugins.torch()
    assert plugin.env(info) == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "3", "RANK": "1",
                                "NODE_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert plugin.packages() == ["torch"] and gpuctl.plugins.torch(version="2.13.0").packages() == ["torch==2.13.0"]
    with pytest.raises(ValueError, match="backend"):
        gpuctl.plugins.torch(backend="tcp")


def test_torch_plugin_initializes_and_destroys_a_process_group(monkeypatch: pytest.MonkeyPatch):
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    info = runtime.instance_info({**job_env(0), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                  "GPUCTL_CLUSTER_INFO": json.dumps({"num_nodes": 1, "ips": ["127.0.0.1"]})})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with gpuctl.plugins.torch().around(info):
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert os.environ["WORLD_SIZE"] == "1"
    assert not dist.is_initialized() and "WORLD_SIZE" not in os.environ


def test_jax_keras_and_environment_restored(monkeypatch: pytest.MonkeyPatch):
    info = runtime.instance_info(job_env(2))
    assert gpuctl.plugins.jax().env(info) == {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:29501", "JAX_NUM_PROCESSES": "3",
                                              "JAX_PROCESS_ID": "2", "JAX_LOCAL_DEVICE_COUNT": "1"}
    assert gpuctl.plugins.jax().packages(gpus_per_node=8) == ["jax[cuda12]"]
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    keras = gpuctl.plugins.keras(backend="jax")
    assert keras.packages() == ["keras", "jax"]
    with plugins.around_all([keras], info):
        assert os.environ["KERAS_BACKEND"] == "jax"
    assert os.environ["KERAS_BACKEND"] == "torch"
    with pytest.raises(ValueError, match="backend"):
        gpuctl.plugins.keras(backend="theano")


def test_huggingface_token_is_a_secret_that_never_pickles():
    token = "hf_" + "x" * 20
    plugin = gpuctl.plugins.huggingface(token=token)
    assert plugin.secrets() == {"HF_TOKEN": token}
    assert token not in repr(plugin) and token.encode() not in cloudpickle.dumps([plugin])
    assert token.encode() not in pickle.dumps(plugin)
    assert plugin.packages() == ["transformers", "datasets", "tokenizers"]
    assert gpuctl.plugins.huggingface().secrets() == {}


# -- the call file and marker lines --------------------------------------------------------


def test_call_file_round_trip():
    header = wire.CallHeader("abc123", "3.11", "train", "3.1.2")
    data = wire.encode_call(header, b"\x00body\nwith newline")
    assert wire.decode_call(data) == (header, b"\x00body\nwith newline")
    with pytest.raises(ValueError):
        wire.decode_call(b"something else")


def test_markers_round_trip_in_chunks_and_after_unterminated_output():
    payload = os.urandom(3 * wire.CHUNK + 5)
    lines = list(wire.marker_lines("n1", wire.RESULT, payload))
    assert len(lines) == 4 and all(len(line) < 70 * 1024 for line in lines)
    collector = wire.Collector("n1")
    assert collector.take(0, "plain output") == "plain output"
    assert collector.take(0, "no newline yet" + lines[0]) == "no newline yet"
    assert [collector.take(0, line) for line in lines[1:]] == [None] * 3
    assert collector.result(0) == payload
    assert collector.take(1, lines[0].replace("n1", "other")).startswith(wire.MARK)  # another call's: shown
    assert collector.result(1) is None
    empty = wire.Collector("e")
    for line in wire.marker_lines("e", wire.RESULT, b""):
        empty.take(2, line)
    assert empty.result(2) == b""


def run_call(tmp_path: Path, fn, *args, env: dict[str, str], plugins_=(), python: str | None = None, **kwargs):
    """The node-side runner on a call file, in a subprocess; (exit code, collector, stdout)."""
    nonce = "feed" + os.urandom(4).hex()
    body = dumps_call(fn, {"fn": fn, "args": args, "kwargs": kwargs, "plugins": list(plugins_)})
    path = tmp_path / f"{nonce}.pkl"
    path.write_bytes(wire.encode_call(wire.CallHeader(nonce, python or wire.python_version(), "f"), body))
    root = str(Path(gpuctl.__file__).resolve().parent.parent)
    proc = subprocess.run([sys.executable, "-m", "gpuctl.api.remote", "--", str(path)], capture_output=True,
                          text=True, env={**os.environ, **env, "PYTHONPATH": root}, timeout=120)
    collector = wire.Collector(nonce)
    shown = [collector.take(0, line) for line in proc.stdout.splitlines()]
    return proc.returncode, collector, [s for s in shown if s is not None]


def test_remote_runs_the_function_and_returns_its_value(tmp_path: Path):
    def work(a, b=1):
        print("working", gpuctl.instance_info().node)
        return {"sum": a + b, "arr": np.arange(3)}

    code, collector, shown = run_call(tmp_path, work, 2, b=5, env=job_env(1))
    assert code == 0 and shown == ["working 1"]
    value = cloudpickle.loads(collector.result(0))
    assert value["sum"] == 7 and value["arr"].tolist() == [0, 1, 2]


def test_remote_sends_the_exception_with_its_traceback(tmp_path: Path):
    def broken():
        raise KeyError("nope")

    code, collector, _ = run_call(tmp_path, broken, env=job_env(0))
    record = collector.error(0)
    assert code == 1 and record["stage"] == "call" and record["type"] == "KeyError"
    assert 'raise KeyError("nope")' in record["traceback"] and "remote.py" not in record["traceback"]
    assert isinstance(cloudpickle.loads(base64.b64decode(record["exception"])), KeyError)


def test_remote_names_a_missing_module_and_another_python(tmp_path: Path):
    module = tmp_path / "mod_only_on_controller.py"
    module.write_text("class Thing:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import mod_only_on_controller  # type: ignore[import-not-found]

        code, collector, _ = run_call(tmp_path / "..", len, [mod_only_on_controller.Thing()], env=job_env(0))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mod_only_on_controller", None)
    record = collector.error(0)
    assert code == 1 and record["stage"] == "load" and record["missing_module"] == "mod_only_on_controller"
    code, collector, _ = run_call(tmp_path, len, [], env=job_env(0), python="3.2")
    assert code == 1 and "pickled by Python 3.2" in collector.error(0)["message"]


def test_remote_exits_as_python_would_but_skips_c_teardown(tmp_path: Path):
    def aborts_at_teardown():
        import atexit
        import ctypes
        import threading
        import time

        libc = ctypes.CDLL(None)
        libc.__cxa_atexit(libc.abort, None, None)  # a C++ teardown that aborts, as gloo's can
        atexit.register(print, "tracker flushed at exit")
        threading.Thread(target=lambda: (time.sleep(0.3), print("checkpoint uploaded", flush=True))).start()
        return "trained"

    code, collector, shown = run_call(tmp_path, aborts_at_teardown, env=job_env(0))
    assert code == 0 and cloudpickle.loads(collector.result(0)) == "trained"
    assert shown == ["checkpoint uploaded", "tracker flushed at exit"]


def test_remote_unpicklable_result(tmp_path: Path):
    import threading

    code, collector, _ = run_call(tmp_path, threading.Lock, env=job_env(0))
    assert code == 1 and collector.error(0)["stage"] == "result"


def test_functions_of_modules_the_nodes_lack_travel_by_value():
    here = sys.modules[__name__]
    assert _by_value_modules(test_call_file_round_trip) == [here]  # a test file: not installed
    assert _by_value_modules(json.dumps) == [] and _by_value_modules(gpuctl.shard) == []
    data = dumps_call(test_call_file_round_trip, {"fn": test_call_file_round_trip})
    assert b"test_call_file_round_trip" in data and __name__ not in cloudpickle.dumps(len).decode("latin-1")


def test_run_script_quotes_and_takes_the_file_after_dashes():
    script = run_script("/opt/py env/bin/python", "~/.gpuctl/calls/ab.pkl")
    assert "py='/opt/py env/bin/python'" in script
    assert 'exec "$py" -m gpuctl.api.remote -- \'~/.gpuctl/calls/ab.pkl\'' in script
    assert 'py="$HOME/.gpuctl/venv/bin/python"' in run_script(None, "~/x.pkl")


# -- Cluster arguments, operators, the nodes' venv record -----------------------------------


def test_cluster_refuses_bad_arguments():
    with pytest.raises(TypeError, match="not a gpuctl plugin"):
        Cluster(name="x", plugins=["torch"])  # type: ignore[list-item]
    for bad in ("--index-url=http://x", "a b", "x;rm"):
        with pytest.raises(ValueError, match="pip requirement"):
            Cluster(name="x", packages=[bad])
    with pytest.raises(UserError, match="num_nodes"):
        Cluster(name="x", infra="local", num_nodes=0).up()
    with pytest.raises(UserError, match="cluster name"):
        Cluster(name="Bad_Name").up()
    with pytest.raises(UserError, match="cluster 'nosuch' not found"):
        Cluster(name="nosuch").up()


@pytest.mark.parametrize("nodes", [510, 10**9])
def test_cluster_beyond_the_provider_leaves_no_record(nodes: int):
    from gpuctl.common.paths import cluster_dir
    from gpuctl.state.registry import Registry

    with pytest.raises(UserError, match=r"infra local supports 1 to (253|509) nodes"):  # loopback, netns
        Cluster(name="big", infra="local", num_nodes=nodes).up()
    assert Registry(remote=None).cluster("big") is None and not cluster_dir("big").exists()


def test_operators_need_a_call_and_a_cluster():
    @gpuctl.function
    def f(x):
        return x + 1

    assert f.local(1) == 2 and f.__name__ == "f"
    with pytest.raises(TypeError, match="call f first"):
        f @ Cluster(name="x")  # type: ignore[operator]
    with pytest.raises(TypeError, match="must be a gpuctl.Cluster"):
        f(1) @ "cluster"  # type: ignore[operator]


def test_nodes_venv_record_grows_and_is_in_the_fingerprint(tmp_path: Path):
    before = prepare.want_python_env(tmp_path, "3.11", ["cloudpickle==3.1.2", "torch"])
    assert before is None
    assert prepare.want_python_env(tmp_path, "3.11", ["numpy"]) == {"version": "3.11",
                                                                     "packages": ["cloudpickle==3.1.2", "torch"]}
    assert prepare.python_env(tmp_path) == {"version": "3.11", "packages": ["cloudpickle==3.1.2", "numpy", "torch"]}
    prepare.want_python_env(tmp_path, "3.12", ["cloudpickle==3.1.2"])
    assert prepare.python_env(tmp_path) == {"version": "3.12", "packages": ["cloudpickle==3.1.2"]}
    base = prepare.fingerprint(internal_public_key="k", fabric_env={})
    with_python = prepare.fingerprint(internal_public_key="k", fabric_env={}, python=prepare.python_env(tmp_path))
    more = prepare.fingerprint(internal_public_key="k", fabric_env={},
                               python={"version": "3.12", "packages": ["cloudpickle==3.1.2", "jax"]})
    assert len({base, with_python, more}) == 3
    names = [name for name, _ in prepare.python_runtime_files()]
    assert names[0] == "__init__.py" and "api/remote.py" in names and "api/runtime.py" in names


def test_import_gpuctl_stays_cheap():
    code = ("import sys, gpuctl; heavy = [m for m in ('pydantic', 'cloudpickle', 'typer', 'rich', 'gpuctl.api') "
            "if m in sys.modules]; print(heavy); gpuctl.shard; print('pydantic' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "False"]
    assert "instance_info" in dir(gpuctl) and "Cluster" in gpuctl.__all__
    with pytest.raises(AttributeError):
        gpuctl.no_such_thing  # noqa: B018


def test_the_node_venv_script_makes_a_venv_once(tmp_path: Path):
    """roles/gpuctl_python's script, here: the venv from this Python's own pythonX.Y, gpuctl's
    runtime on its path, "ok" the second time (requirements empty: no index is asked)."""
    import shutil

    version = wire.python_version()
    if shutil.which(f"python{version}") is None:
        pytest.skip(f"no python{version} on PATH")
    script = Path(__file__).resolve().parents[2] / "ansible/roles/gpuctl_python/files/gpuctl-python-env"
    runtime = tmp_path / "runtime" / "gpuctl"
    (runtime / "api").mkdir(parents=True)
    for name, path in prepare.python_runtime_files():
        (runtime / name).write_bytes(path.read_bytes())
    (tmp_path / "req.txt").write_text("\n")
    argv = [str(script), str(tmp_path / "venv"), version, str(tmp_path / "req.txt"), str(runtime.parent),
            str(tmp_path / "tools"), "0.13.9"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and first.stdout.split() == ["changed"], first.stderr
    second = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert second.stdout.split() == ["ok"], second.stderr
    probe = subprocess.run([str(tmp_path / "venv/bin/python"), "-c",
                            "import gpuctl, gpuctl.api.remote; print(gpuctl.__file__)"], capture_output=True, text=True)
    assert probe.stdout.strip() == str(runtime / "__init__.py"), probe.stderr
    bad = subprocess.run([*argv[:2], "3;x", *argv[3:]], capture_output=True, text=True)
    assert bad.returncode == 2 and "bad Python version" in bad.stderr


def test_skywards_compute_is_a_cluster_with_its_argument_names() -> None:
    import gpuctl

    c = gpuctl.Compute(provider=gpuctl.AWS(region="us-east-1"), nodes=4, accelerator=gpuctl.accelerators.A100(8),
                       plugins=[gpuctl.plugins.torch()])
    assert isinstance(c, gpuctl.Cluster)
    assert (c.infra, c.num_nodes, c.accelerators, len(c.plugins)) == ("aws/us-east-1", 4, "A100:8", 1)
    local = gpuctl.Compute(nodes=2)
    assert (local.infra, local.num_nodes, local.accelerators) == ("local", 2, None)
    assert str(gpuctl.accelerators.A100_80GB()) == "A100-80GB:1"
    assert gpuctl.Local().infra == "local" and gpuctl.AWS().infra == "aws"


def test_down_of_a_cluster_that_does_not_exist_says_so(tmp_path: Path, monkeypatch, capsys):
    """As `gpuctl down NAME`: nothing to destroy is said plainly, and is no error."""
    import gpuctl

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    gpuctl.Cluster(name="nosuch").down()
    assert "Cluster 'nosuch' does not exist; nothing to tear down." in capsys.readouterr().out


def test_a_nodes_traceback_gets_the_source_lines_it_could_not_read(tmp_path: Path) -> None:
    """The function's module lies where the node cannot read it (a clone in a private home): the
    traceback shown here has its lines from this machine's copy; lines the node had stay as they were."""
    from gpuctl.api.cluster import with_source_lines

    module = tmp_path / "train.py"
    module.write_text("def step(x):\n    raise ValueError(f'bad shard {x}')\n")
    remote = (f'Traceback (most recent call last):\n  File "{module}", line 2, in step\n'
              f'  File "/usr/lib/python3/x.py", line 9, in other\n    kept = as_it_was()\n'
              "ValueError: bad shard 1\n")
    assert with_source_lines(remote) == (
        f'Traceback (most recent call last):\n  File "{module}", line 2, in step\n'
        "    raise ValueError(f'bad shard {x}')\n"
        f'  File "/usr/lib/python3/x.py", line 9, in other\n    kept = as_it_was()\nValueError: bad shard 1\n')
