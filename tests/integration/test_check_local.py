"""`gpuctl check` (issue 12) end to end on one 2-node local cluster (CPU: torch.distributed gloo).

- the all_reduce runs as one gpuctl job on both nodes (in `gpuctl queue` as gpuctl-check), prints
  the size / time / algbw / busbw table, reports the transport (socket (gloo)) and what was
  expected (socket: local nodes), and exits 0;
- `--expect-fabric efa -o json` fails: exit 1, one `error: check: ...` line on stderr saying gloo
  used sockets where efa was expected, and the JSON document (ok false, the problem, the results)
  on stdout.

Kept short (the suite's budget): small sizes, two checks, one cluster.
"""

from __future__ import annotations

import json
import re

import pytest

from e2e import Cluster, needs_local_nodes

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "chk2"
DOC_KEYS = {"schema", "command", "ok", "cluster", "job_id", "nodes", "ranks", "method", "backend", "transport",
            "transport_kind", "expected_fabric", "expected_source", "per_rank", "results", "min_busbw_gbps",
            "nccl_version", "problem", "pairs", "slow_nodes"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("check")
    (root / "c.yaml").write_text(f"name: {NAME}\nnum_nodes: 2\nresources:\n  infra: local\n")
    c = Cluster(NAME, root / "state")
    try:
        c.gpuctl("apply", str(root / "c.yaml"), timeout=180).check()
        yield c
    finally:
        c.down_quietly()


def test_check_prints_the_table_and_passes_on_sockets(cluster: Cluster) -> None:
    res = cluster.gpuctl("check", NAME, "--sizes", "64K,1M", timeout=180).check()
    out = res.stdout
    assert f"Cluster '{NAME}': all_reduce across 2 rank(s) on 2 node(s) with torch.distributed gloo, job 1" in out
    assert "Transport: socket (gloo); expected: socket (local nodes)" in out
    rows = re.findall(r"^\s+(64K|1M)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["64K", "1M"], out
    assert all(float(t) > 0 and float(alg) > 0 and alg == bus for _, t, alg, bus in rows), rows  # 2 ranks: bus = alg
    assert out.rstrip().splitlines()[-1] == "OK: socket (gloo) meets the expected fabric (socket)"
    # each size as it completed, before the table
    progress = re.findall(r"^  all_reduce (64K|1M): [0-9.]+ ms on rank 0$", out, re.M)
    assert progress == ["64K", "1M"] and out.index("all_reduce 1M:") < out.index("Transport:"), out
    assert "NCCL INFO" not in out and "__GPUCTL_CHECK__" not in out  # in the job's logs only
    queue = cluster.gpuctl("queue", NAME).check().stdout.splitlines()
    assert queue[1].split()[1:3] == ["gpuctl-check", "SUCCEEDED"], queue


def test_expecting_efa_fails_with_one_clear_line(cluster: Cluster) -> None:
    res = cluster.gpuctl("check", NAME, "--sizes", "64K", "--expect-fabric", "efa", "-o", "json", timeout=180)
    assert res.returncode == 1, res.describe()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: check: torch.distributed used gloo over sockets (no CUDA GPU for NCCL) but cluster "
                      f"'{NAME}' should use efa (--expect-fabric); gloo has no efa transport, only NCCL on GPU nodes "
                      "can use it"], res.describe()
    doc = json.loads(res.stdout)
    assert set(doc) == DOC_KEYS
    assert (doc["command"], doc["ok"], doc["cluster"], doc["ranks"], doc["backend"], doc["transport"],
            doc["expected_fabric"], doc["expected_source"]) == \
        ("check", False, NAME, 2, "gloo", "socket (gloo)", "efa", "--expect-fabric")
    assert doc["problem"] == errors[0].removeprefix("error: ")
    assert [r["size_bytes"] for r in doc["results"]] == [65536] and doc["results"][0]["busbw_gbps"] > 0
    assert [(r["node"], r["transport"]) for r in doc["per_rank"]] == [("head", "socket (gloo)"),
                                                                       ("worker1", "socket (gloo)")]
