"""The node health probe (node/nodehealth.py) on recorded tool output: nvidia-smi's CSV query
and `-q -x` XML, `nvidia-smi nvlink -s`, kernel-log Xid lines, a fake /sys of EFA devices; and the
controller's reading of the probe's documents (healthcheck/health.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from gpuctl.healthcheck import health
from gpuctl.node import nodehealth
from gpuctl.provision.inventory import Inventory, Node

DATA = Path(__file__).parent / "data" / "health"
H100_CSV = (DATA / "h100x8-query.csv").read_text()


def h100s(**change: object) -> list[dict]:
    """The 8 healthy H100 of the recorded query, with `change` applied to GPU 3 (key=value)."""
    gpus = nodehealth.parse_query_csv(H100_CSV)
    gpus[3].update(change)
    return gpus


def actions(findings: list[dict]) -> list[tuple[str, str, str | None]]:
    return [(f["check"], f["action"], f["device"]) for f in findings]


def test_eight_healthy_h100_have_no_finding() -> None:
    gpus = nodehealth.parse_query_csv(H100_CSV)
    assert len(gpus) == 8 and gpus[0]["name"] == "NVIDIA H100 80GB HBM3"
    assert gpus[5]["bus_id"] == "00000000:AB:00.0" and gpus[0]["pcie_width_max"] == 16
    assert gpus[0]["retired_pending"] is None  # [N/A]: unknown, not healthy
    assert gpus[0]["persistence"] is True and gpus[0]["clock_reasons"] == 1
    assert nodehealth.gpu_findings(gpus, expected=8) == []
    assert nodehealth.verdict([]) == ("healthy", None)


def test_a_missing_gpu_asks_for_a_reboot() -> None:
    gpus = nodehealth.parse_query_csv(H100_CSV)[:7]
    found = nodehealth.gpu_findings(gpus, expected=8)
    assert actions(found) == [("gpu_count", "reboot", None)]
    assert found[0]["text"] == "7 of 8 GPUs visible to nvidia-smi"
    assert nodehealth.verdict(found) == ("unhealthy", "reboot")


@pytest.mark.parametrize("change, expected", [
    ({"ecc_uncorrected": 2}, ("ecc", "reset", "GPU 3")),
    ({"remap_pending": True}, ("row_remap", "reset", "GPU 3")),
    ({"remap_failure": True, "remap_pending": True}, ("row_remap", "isolate", "GPU 3")),
    ({"retired_pending": True}, ("retired_pages", "reset", "GPU 3")),
    ({"pcie_width": 8}, ("pcie", "isolate", "GPU 3")),
    ({"clock_reasons": 0x40}, ("throttle", "monitor", "GPU 3")),
    ({"persistence": False}, ("persistence", "monitor", "GPU 3")),
])
def test_each_fault_of_one_gpu_names_it_and_its_action(change: dict, expected: tuple) -> None:
    found = nodehealth.gpu_findings(h100s(**change), expected=8)
    assert actions(found) == [expected]
    state = "degraded" if expected[1] == "monitor" else "unhealthy"
    assert nodehealth.verdict(found) == (state, expected[1])


def test_pcie_x8_of_x16_is_said_so_and_a_lower_gen_only_counts_while_busy() -> None:
    found = nodehealth.gpu_findings(h100s(pcie_width=8), expected=8)
    assert found[0]["text"] == "PCIe link x8 of x16"
    assert nodehealth.gpu_findings(h100s(pcie_gen=1), expected=8) == []  # idle GPUs drop their link speed
    busy = nodehealth.gpu_findings(h100s(pcie_gen=1, clock_reasons=0), expected=8)
    assert actions(busy) == [("pcie", "monitor", "GPU 3")]


def test_a_gpu_that_answers_with_errors_is_not_taken_for_healthy() -> None:
    lost = nodehealth.gpu_findings(h100s(ecc_uncorrected="[GPU is lost]", pcie_width="[GPU is lost]"), expected=8)
    assert actions(lost) == [("gpu_state", "reboot", "GPU 3")]
    reset = nodehealth.gpu_findings(h100s(remap_pending="[GPU requires reset]"), expected=8)
    assert actions(reset) == [("gpu_state", "reset", "GPU 3")]
    err = nodehealth.gpu_findings(h100s(clock_reasons="ERR!"), expected=8)
    assert actions(err) == [("gpu_state", "reset", "GPU 3")] and "ERR!" in err[0]["text"]


def test_older_drivers_field_names_and_a_name_with_commas() -> None:
    names = [ours for ours, _ in nodehealth.QUERY_FIELDS]
    line = ("0, GPU-1, 00000000:18:00.0, NVIDIA A100-SXM4-80GB, rev. 2, 0, No, No, No, 16, 16, 4, 4, "
            "0x0000000000000000, Disabled")
    gpu = nodehealth.parse_query_csv(line, names)[0]
    assert gpu["name"] == "NVIDIA A100-SXM4-80GB, rev. 2" and gpu["persistence"] is False
    assert nodehealth.OLD_FIELD_NAMES["clocks_event_reasons.active"] == "clocks_throttle_reasons.active"
    assert nodehealth.value("[Not Supported]") is None and nodehealth.value("0x00000000000000A0") == 0xA0


def test_the_xml_gives_the_same_facts_as_the_query() -> None:
    gpus = nodehealth.parse_query_xml((DATA / "h100x2-q.xml").read_text())
    assert [g["bus_id"] for g in gpus] == ["00000000:18:00.0", "00000000:2A:00.0"]
    assert gpus[0]["ecc_uncorrected"] == 0 and gpus[1]["ecc_uncorrected"] == 3  # SRAM + DRAM, volatile only
    assert (gpus[1]["pcie_width"], gpus[1]["pcie_width_max"]) == (8, 16)
    assert gpus[1]["remap_pending"] is True and gpus[1]["remap_failure"] is False
    assert gpus[0]["retired_pending"] is None
    assert gpus[1]["clock_reasons"] == 0x40 and gpus[0]["clock_reasons"] == 0
    found = nodehealth.gpu_findings(gpus, expected=2)
    assert actions(found) == [("ecc", "reset", "GPU 1"), ("row_remap", "reset", "GPU 1"),
                              ("pcie", "isolate", "GPU 1"), ("throttle", "monitor", "GPU 1")]
    assert nodehealth.verdict(found) == ("unhealthy", "isolate")


def test_xid_79_is_a_reboot_and_xid_13_only_watched_on_the_gpu_it_hit() -> None:
    xids = nodehealth.parse_xids((DATA / "dmesg-xid.txt").read_text().splitlines())
    assert [(bus, xid) for bus, xid, _ in xids] == [("0000:2a:00", 13), ("0000:2a:00", 13), ("0000:ab:00", 79)]
    found = nodehealth.xid_findings(xids, nodehealth.parse_query_csv(H100_CSV))
    assert actions(found) == [("xid", "monitor", "GPU 1"), ("xid", "reboot", "GPU 5")]
    assert found[0]["text"].startswith("Xid 13: graphics engine exception (usually the application) (2 times): ")
    assert found[1]["text"].startswith("Xid 79: GPU has fallen off the bus")
    assert nodehealth.verdict(found[:1]) == ("degraded", "monitor")
    assert nodehealth.verdict(found) == ("unhealthy", "reboot")
    told = nodehealth.parse_xids(["NVRM: Xid (PCI:0000:ab:00): 154, GPU recovery action changed from 0x0 "
                                  "(None) to 0x2 (Node Reboot Required)",
                                  "NVRM: Xid (PCI:0000:18:00): 154, GPU recovery action changed from 0x0 (None) "
                                  "to 0x1 (GPU Reset Required)"])
    assert actions(nodehealth.xid_findings(told, nodehealth.parse_query_csv(H100_CSV))) == [
        ("xid", "reset", "GPU 0"), ("xid", "reboot", "GPU 5")]  # 154 names its own action
    unknown = nodehealth.xid_findings([("0000:01:00", 999, "")], [])
    assert actions(unknown) == [("xid", "monitor", "PCI 0000:01:00")] and "not in gpuctl's" in unknown[0]["text"]


def test_an_inactive_nvlink_is_a_reset() -> None:
    links = nodehealth.parse_nvlink((DATA / "nvlink-s.txt").read_text())
    assert links[0] == (18, []) and links[1] == (18, [4, 5])
    found = nodehealth.nvlink_findings(links)
    assert actions(found) == [("nvlink", "reset", "GPU 1")] and found[0]["text"] == "NVLink 4, 5 of 18 inactive"


def fake_sys(root: Path, efa: int, *, down: tuple[str, ...] = ()) -> Path:
    """SYS/class/infiniband with `efa` EFA devices (driver efa), port 1 ACTIVE unless named in `down`."""
    driver = root / "bus" / "pci" / "drivers" / "efa"
    driver.mkdir(parents=True, exist_ok=True)
    for i in range(efa):
        dev = root / "class" / "infiniband" / f"rdmap{i}s0"
        (dev / "ports" / "1").mkdir(parents=True)
        (dev / "device").mkdir()
        os.symlink(driver, dev / "device" / "driver")
        (dev / "ports" / "1" / "state").write_text("1: DOWN\n" if dev.name in down else "4: ACTIVE\n")
    return root


def test_31_of_32_efa_on_a_p5_and_a_port_down(tmp_path: Path) -> None:
    devices = nodehealth.rdma_devices(str(fake_sys(tmp_path / "sys", 32)))
    assert len(devices) == 32 and devices["rdmap0s0"] == ("efa", {"1": "4: ACTIVE"})
    assert nodehealth.fabric_findings(devices, "efa", 32) == []
    fewer = nodehealth.rdma_devices(str(fake_sys(tmp_path / "sys31", 31, down=("rdmap7s0",))))
    found = nodehealth.fabric_findings(fewer, "efa", 32)
    assert actions(found) == [("fabric", "reboot", None), ("fabric", "reboot", "rdmap7s0")]
    assert found[0]["text"] == "31 of 32 EFA devices present" and found[1]["text"] == "port 1 is DOWN"
    # a port down on a device the cluster does not train over (no fabric expected) is only watched
    assert actions(nodehealth.fabric_findings(fewer, None, 0)) == [("fabric", "monitor", "rdmap7s0")]


def test_memlock_of_64_kib_on_an_rdma_node() -> None:
    found = nodehealth.memlock_findings(64 * 1024, rdma=True)
    assert actions(found) == [("memlock", "isolate", None)] and "ulimit -l is 64 KiB" in found[0]["text"]
    assert nodehealth.memlock_findings(64 * 1024, rdma=False) == []  # sockets only: not needed
    assert nodehealth.memlock_findings(nodehealth.resource.RLIM_INFINITY, rdma=True) == []


def test_gpudirect_modules_dcgm_results_and_disks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert actions(nodehealth.module_findings({"nvidia"}, "ib", gdrcopy_wanted=False)) == [
        ("modules", "monitor", None)]
    assert nodehealth.module_findings({"nvidia_peermem", "gdrdrv"}, "efa", gdrcopy_wanted=True) == []
    diag = {"DCGM GPU Diagnostic": {"test_categories": [
        {"category": "Hardware", "tests": [{"name": "GPU Memory", "results": [
            {"gpu_id": 2, "status": "Fail", "info": "bad page"}, {"gpu_id": 3, "status": "Pass"}]}]},
        {"category": "Integration", "tests": [{"name": "PCIe", "results": [{"gpu_id": 0, "status": "Warn"}]}]}]}}
    assert actions(nodehealth.dcgm_findings(diag)) == [("dcgm", "isolate", "GPU 2"), ("dcgm", "monitor", "GPU 0")]
    missing = str(tmp_path / "not" / "made" / "yet")  # its nearest existing parent's disk
    assert nodehealth.disk_findings([missing]) == []
    monkeypatch.setattr(nodehealth, "DISK_LOW_BYTES", 1 << 62)
    assert actions(nodehealth.disk_findings([missing])) == [("disk", "monitor", None)]
    monkeypatch.setattr(nodehealth, "DISK_UNHEALTHY_BYTES", 1 << 62)
    assert nodehealth.disk_findings([missing])[0]["text"].startswith(f"{missing}: ")
    assert actions(nodehealth.disk_findings([missing])) == [("disk", "isolate", None)]


def run_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, *args: str) -> dict:
    """The probe's whole run with `nvidia-smi` (a shell script) and a quiet kernel log first on
    PATH, and no disk found short (this machine's disks are not the point)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("nvidia-smi", script), ("dmesg", "echo '[    1.0] Linux version 6.1'\n")):
        (bin_dir / name).write_text("#!/bin/sh\n" + text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(nodehealth, "DISK_LOW_BYTES", 0)
    monkeypatch.setattr(nodehealth, "DISK_UNHEALTHY_BYTES", 0)
    out = []
    monkeypatch.setattr(nodehealth.sys.stdout, "write", out.append)
    assert nodehealth.main(["--root", str(tmp_path), "--level", "0", "--path", str(tmp_path), *args]) == 0
    line = "".join(out)
    assert line.startswith(nodehealth.MARK + " ")
    return json.loads(line[len(nodehealth.MARK) + 1:])


def test_the_whole_probe_with_a_fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    csv = tmp_path / "q.csv"
    csv.write_text(H100_CSV.replace("00000000:5D:00.0, NVIDIA H100 80GB HBM3, 0,", "00000000:5D:00.0, NVIDIA H100 80GB HBM3, 4,"))
    doc = run_probe(tmp_path, monkeypatch, f'case "$1" in --query-gpu=*) cat {csv};; nvlink) exit 3;; *) exit 9;; esac\n',
                    "--expect-gpus", "8")
    assert doc["verdict"] == "unhealthy" and doc["action"] == "reset" and doc["gpus"] == 8
    assert actions(doc["findings"]) == [("ecc", "reset", "GPU 3")]
    assert doc["checks"]["gpus"] == "8 GPU(s) read with nvidia-smi --query-gpu"
    assert doc["checks"]["nvlink"].startswith("skipped") and doc["checks"]["xid"] == "0 Xid line(s) in dmesg"


def test_an_old_driver_is_asked_again_and_a_failing_tool_is_one_line(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    csv = tmp_path / "q.csv"
    csv.write_text(H100_CSV)
    old = (f'case "$1" in *clocks_event_reasons*) echo \'Field "clocks_event_reasons.active" is not a valid field '
           f'to query.\'; exit 2;; --query-gpu=*) cat {csv};; *) exit 3;; esac\n')
    doc = run_probe(tmp_path, monkeypatch, old, "--expect-gpus", "8")
    assert doc["verdict"] == "healthy" and doc["gpus"] == 8, doc
    broken = run_probe(tmp_path, monkeypatch, 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the '
                                              'NVIDIA driver." >&2; exit 9\n', "--expect-gpus", "8")
    assert broken["verdict"] == "unhealthy" and actions(broken["findings"]) == [("gpu_count", "reboot", None)]
    assert "couldn't communicate with the NVIDIA driver" in broken["findings"][0]["text"]


def test_no_nvidia_smi_is_a_skipped_check_or_a_missing_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(nodehealth, "DISK_LOW_BYTES", 0)
    out: list[str] = []
    monkeypatch.setattr(nodehealth.sys.stdout, "write", out.append)
    nodehealth.main(["--root", str(tmp_path), "--level", "0", "--path", str(tmp_path)])
    doc = json.loads("".join(out).split(" ", 1)[1])
    assert doc["verdict"] == "healthy" and doc["checks"]["gpus"].startswith("skipped: no nvidia-smi")
    out.clear()
    nodehealth.main(["--root", str(tmp_path), "--level", "0", "--path", str(tmp_path), "--expect-gpus", "8"])
    doc = json.loads("".join(out).split(" ", 1)[1])
    assert doc["verdict"] == "unhealthy" and doc["findings"][0]["text"] == "nvidia-smi is not on PATH: 0 of 8 GPUs visible"


def inventory() -> Inventory:
    nodes = [Node(name=n, rank=r, address=f"10.0.0.{r + 1}", ssh_host=f"10.0.0.{r + 1}", ssh_user="u",
                  node_id=f"i-{r}") for r, n in enumerate(("head", "worker1", "worker2"))]
    return Inventory(cluster="c1", cloud="local", nodes=tuple(nodes))


def probe_line(verdict: str, findings: list[dict]) -> str:
    return f"{health.MARK} " + json.dumps({"kind": "node", "verdict": verdict, "gpus": 8, "findings": findings,
                                           "action": nodehealth.verdict(findings)[1], "checks": {}})


def test_the_report_names_unhealthy_nodes_and_a_silent_one(tmp_path: Path) -> None:
    ecc = nodehealth.finding("ecc", "reset", "2 uncorrectable ECC error(s) since the driver loaded", "GPU 3")
    lines = {0: [probe_line("healthy", [])], 1: ["noise", probe_line("unhealthy", [ecc])], 2: []}
    report = health.analyze(inventory(), lines, job_id=4, now=100.0)
    assert [(n["name"], n["verdict"], n["action"]) for n in report.nodes] == [
        ("head", "healthy", None), ("worker1", "unhealthy", "reset"), ("worker2", "unhealthy", "reboot")]
    assert report.problem == ("health: 2 of 3 node(s) unhealthy: worker1 (reset: GPU 3: 2 uncorrectable ECC error(s) "
                              "since the driver loaded), worker2 (reboot: the node gave no health report (its output: "
                              "`gpuctl logs c1 4`)); replace them: gpuctl replace c1 --unhealthy")
    doc = report.document()
    assert doc["ok"] is False and doc["verdict"] == "unhealthy" and doc["unhealthy"] == ["worker1", "worker2"]
    assert set(doc) == {"ok", "cluster", "job_id", "checked_at", "verdict", "unhealthy", "nodes", "problem"}
    assert set(doc["nodes"][1]) == {"name", "rank", "node_id", "address", "verdict", "action", "gpus", "findings",
                                    "checks"}
    text = "\n".join(report.text())
    assert "  reset    worker1 GPU 3: ecc: 2 uncorrectable ECC error(s)" in text
    silent = health.analyze(inventory(), {}, job_id=5, failure="ssh to the head failed")
    assert silent.answered == 0 and silent.problem == ("health: the health job failed before any node reported: "
                                                       "ssh to the head failed")


def test_the_record_follows_node_ids_and_is_private(tmp_path: Path) -> None:
    inv = inventory()
    report = health.analyze(inv, {r: [probe_line("healthy", [])] for r in range(3)}, job_id=1, now=5.0)
    health.save(tmp_path, report)
    assert (tmp_path / health.HEALTH_FILE).stat().st_mode & 0o777 == 0o600
    assert sorted(health.last_verdicts(tmp_path, inv)) == [0, 1, 2]
    made_again = Inventory(cluster="c1", cloud="local",
                           nodes=(inv.nodes[0], Node(name="worker1", rank=1, address="10.0.0.2", ssh_host="10.0.0.2",
                                                     ssh_user="u", node_id="i-new"), inv.nodes[2]))
    seen = health.last_verdicts(tmp_path, made_again)
    assert sorted(seen) == [0, 2] and seen[0]["checked_at"] == 5.0  # the new node has no verdict yet
    assert health.status_doc(seen.get(1)) is None
    assert health.status_doc(seen[0]) == {"verdict": "healthy", "action": None, "checked_at": 5.0, "finding": None}
    with pytest.raises(Exception, match="--level 7"):
        health.check_level(7)
    for broken in ("[]", '{"nodes": 3}', "not json"):  # a damaged record is no verdict, never a crash
        (tmp_path / health.HEALTH_FILE).write_text(broken)
        assert health.last_verdicts(tmp_path, inv) == {}


def test_pairs_name_the_node_whose_pairs_are_all_slow() -> None:
    from gpuctl.healthcheck import pairs
    from gpuctl.node import allreduceprobe as probe

    for n in (3, 4, 5, 8):  # every ring pair, each in one round, no node twice in a round
        rounds = probe.ring_rounds(n)
        assert sorted(e for r in rounds for e in r) == sorted(pairs.ring(n))
        assert all(len({x for e in r for x in e}) == 2 * len(r) for r in rounds)
        assert len(rounds) == (2 if n % 2 == 0 else 3)
    names = {0: "head", 1: "worker1", 2: "worker2", 3: "worker3"}
    # 64 MiB between 2 ranks: 10 ms is 6.7 GB/s busbw; worker2's pairs take 10x as long
    recs = [{"kind": "pair", "nodes": list(e), "ranks": 2, "size_bytes": 1 << 26, "backend": "gloo",
             "time_us": 100_000.0 if 2 in e else 10_000.0, "wrong": False} for e in pairs.ring(4)]
    recs.append({"kind": "pair", "nodes": [0, 1], "ranks": 2, "size_bytes": 1 << 20, "time_us": 1.0})  # smaller size
    recs.append({**recs[2], "time_us": 400_000.0})  # worker2-worker3's other pass, slowed by its neighbours: not kept
    recs.append({**recs[0], "time_us": 30_000.0})  # head-worker1 slowed once: its best pass counts
    found = pairs.results(4, recs)
    assert [p.nodes for p in found] == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert found[0].size_bytes == 1 << 26 and round(found[0].busbw_gbps, 2) == 6.71
    slow_pairs, named = pairs.slow(found)
    assert [p.nodes for p in slow_pairs] == [(1, 2), (2, 3)] and named == [2]
    text = pairs.problem("c1", found, names)
    assert text.startswith("check --pairs: worker2 is slow: its pairs worker1-worker2 0.67 GB/s, worker2-worker3 "
                           "0.67 GB/s, the best pair 6.71 GB/s; replace it: gpuctl replace c1 worker2"), text
    assert [line.endswith("slow") for line in pairs.table(found, names)[1:5]] == [False, True, True, False]
    # a pair that gave nothing points at its nodes too; one slow pair alone names nobody
    missing = pairs.results(4, [r for r in recs if r["nodes"] != [1, 2]])
    assert [p.busbw_gbps for p in missing][1] == 0.0 and pairs.slow(missing)[1] == [2]
    six = pairs.results(6, [{"nodes": list(e), "ranks": 2, "size_bytes": 1 << 26,
                             "time_us": 100_000.0 if {1, 4} & set(e) else 10_000.0} for e in pairs.ring(6)])
    names6 = {r: f"worker{r}" for r in range(6)}
    assert pairs.slow(six)[1] == [1, 4]
    assert pairs.problem("c1", six, names6).startswith("check --pairs: worker1, worker4 are slow: their pairs "
                                                       "worker0-worker1 0.67 GB/s")
    assert pairs.problem("c1", six, names6).endswith("replace them: gpuctl replace c1 worker1 worker4")
    one = pairs.results(4, [{**r, "time_us": 10_000.0} if r["nodes"] != [2, 3] else r for r in recs])
    assert pairs.slow(one)[1] == [] and "no single node explains them" in pairs.problem("c1", one, names)
    assert pairs.slow(pairs.results(4, []))[0] == pairs.results(4, [])  # no pair answered: none is fine
    even = pairs.results(4, [{**r, "time_us": 10_000.0} for r in recs])
    assert pairs.slow(even) == ([], []) and pairs.problem("c1", even, names) is None


def test_the_gate_checks_only_nodes_not_yet_seen_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """apply's gate: off where no GPU is expected (unless asked), on while some node has no fit
    verdict, and an unhealthy report stops the job with the replace command."""
    from gpuctl import healthcli
    from gpuctl.common.console import Reporter
    from gpuctl.common.errors import JobFailed
    from gpuctl.state.registry import Registry

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    inv = inventory()
    cdir = tmp_path / "clusters" / "c1"
    cdir.mkdir(parents=True)
    gpus = {"n": 0}
    monkeypatch.setattr(health, "expectations", lambda inv_, request: health.Expectations(gpus=gpus["n"]))
    verdicts = {"now": "healthy"}
    ran: list[str] = []

    def run_health(inv_, *, registry, reporter, level=1, expect=None):
        assert expect is not None and expect.gpus == gpus["n"]  # the gate's own reading, not read again
        ran.append(verdicts["now"])
        findings = [] if verdicts["now"] == "healthy" else [nodehealth.finding("ecc", "reset", "2 errors", "GPU 0")]
        lines = {r: [probe_line(verdicts["now"], findings) if r == 1 else probe_line("healthy", [])] for r in range(3)}
        report = health.analyze(inv_, lines, job_id=len(ran))
        health.save(cdir, report)
        return report

    monkeypatch.setattr(health, "run_health", run_health)
    quiet = Reporter(plain=True)
    registry = Registry()  # no row of c1: expectations get no request (stubbed above)
    healthcli.gate(inv, registry=registry, reporter=quiet, wanted=None)
    assert ran == []  # no GPU expected (local nodes): off
    healthcli.gate(inv, registry=registry, reporter=quiet, wanted=True)
    assert ran == ["healthy"]  # asked for: on
    gpus["n"] = 8
    healthcli.gate(inv, registry=registry, reporter=quiet, wanted=None)
    assert ran == ["healthy"]  # every node seen healthy: a warm re-apply costs nothing
    healthcli.gate(inv, registry=registry, reporter=quiet, wanted=False)
    verdicts["now"] = "unhealthy"
    with pytest.raises(JobFailed, match="worker1 .reset: GPU 0: 2 errors.; replace them: gpuctl replace c1 "
                                        "--unhealthy; or run without the gate: --no-health-check"):
        healthcli.gate(inv, registry=registry, reporter=quiet, wanted=True)
    with pytest.raises(JobFailed):  # unhealthy last time: checked again
        healthcli.gate(inv, registry=registry, reporter=quiet, wanted=None)
    assert ran == ["healthy", "unhealthy", "unhealthy"]


# -- what a node prints never acts on the controller's terminal (issue 34, item 14) ------------

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def strings(value: object) -> list[str]:
    """Every string of a document, keys too."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings(k) + strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in strings(v)]
    return []


def test_escape_sequences_from_nvidia_smi_reach_no_line_or_file_of_gpuctls(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU index holding `ESC]0;TITLE BEL`, a colour code and a \\r in its name, and an Xid line
    with escapes: the probe names the GPU by its place and says its index is no number; the
    controller's table, error line, health.json and `status` carry no control character."""
    rows = H100_CSV.splitlines()
    rows[0] = rows[0].replace("0, GPU-", "0\x1b]0;TITLE\x07, GPU-", 1).replace("H100 80GB HBM3", "H100\x1b[31m\r", 1)
    rows[3] = rows[3].replace("HBM3, 0,", "HBM3, 2,", 1)  # GPU 3: ECC errors, so the node is unhealthy
    csv = tmp_path / "q.csv"
    csv.write_bytes(("\n".join(rows) + "\n").encode())
    xid = tmp_path / "dmesg.txt"
    xid.write_bytes(b"[ 9.0] NVRM: Xid (PCI:0000:18:00): 79, pid=1, \x1b]0;pwned\x07 GPU has fallen off the bus\n")
    doc = run_probe(tmp_path, monkeypatch, f'case "$1" in --query-gpu=*) cat {csv};; *) exit 3;; esac\n',
                    "--expect-gpus", "8")
    (tmp_path / "bin" / "dmesg").write_text(f"#!/bin/sh\ncat {xid}\n")
    out: list[str] = []
    monkeypatch.setattr(nodehealth.sys.stdout, "write", out.append)
    nodehealth.main(["--root", str(tmp_path), "--level", "0", "--path", str(tmp_path), "--expect-gpus", "8"])
    line = "".join(out)
    doc = json.loads(line.split(" ", 1)[1])
    assert ("gpu_index", "monitor", "GPU #0") in actions(doc["findings"])
    assert ("ecc", "reset", "GPU 3") in actions(doc["findings"])
    assert ("xid", "reboot", "GPU #0") in actions(doc["findings"])  # its bus id still finds the GPU
    assert doc["gpus"] == 8 and doc["verdict"] == "unhealthy"
    assert not CONTROL.search(line.rstrip("\n"))  # JSON quotes what the tools printed
    assert "GPU index '0\\x1b]0;TITLE\\x07', not a number" in next(f["text"] for f in doc["findings"]
                                                                    if f["check"] == "gpu_index")

    # A node that prints raw escapes itself (an older probe, or a hostile node), and a GPU count
    # that is no number: what the controller reads, shows and keeps is printable all the same.
    raw = dict(doc, gpus="8\x1b[2J", action="\x1b[31mreset",
               findings=[{"check": "ecc\r", "action": "reset", "device": "GPU \x1b]0;TITLE\x07",
                          "text": "red \x1b[31m\rhidden\x9b"}, {"check": "x", "action": "format the disk", "text": 7}],
               checks={"gpus\x1b": "read\x07"})
    from gpuctl.healthcheck import collect
    from gpuctl.jobplane.events import Event

    runner = collect.CollectingRunner.__new__(collect.CollectingRunner)
    runner.lines = {0: [], 1: [], 2: []}
    for rank, text in ((0, line.rstrip("\n")), (1, f"{health.MARK} {json.dumps(raw)}")):
        runner.output_text(Event("O", rank, stage="run", text=text))
    report = health.analyze(inventory(), runner.lines, job_id=9, now=1.0)
    head, worker1 = report.nodes[0], report.nodes[1]
    assert worker1["gpus"] == 0 and worker1["action"] == "reset"  # not one of ours: its findings' worst
    assert worker1["findings"][0] == {"check": "ecc\\r", "action": "reset", "device": "GPU \\x1b]0;TITLE\\x07",
                                      "text": "red \\x1b[31m\\rhidden\\x9b"}
    assert worker1["findings"][1] == {"check": "x", "action": "monitor", "device": None, "text": "7"}
    assert worker1["findings"][2]["text"] == "the probe's GPU count (8\\x1b[2J) is not a number"
    assert worker1["checks"] == {"gpus\\x1b": "read\\x07"}
    assert ("gpu_index", "monitor", "GPU #0") in actions(head["findings"])
    health.save(tmp_path, report)
    saved = (tmp_path / health.HEALTH_FILE).read_text()
    assert not CONTROL.search(saved.replace("\n", ""))
    said = [*report.text(), report.problem or "", *(health.status_text(e)
                                                    for e in health.last_verdicts(tmp_path, inventory()).values())]
    assert not [s for s in said if CONTROL.search(s)], said
    assert "worker1 (reset: GPU \\x1b]0;TITLE\\x07: red \\x1b[31m\\rhidden\\x9b)" in (report.problem or "")


def test_a_record_an_older_gpuctl_kept_is_read_printable(tmp_path: Path) -> None:
    """health.json written before these checks may hold a node's escapes: `status` reads it clean."""
    inv = inventory()
    entry = {"name": "head", "rank": 0, "node_id": "i-0", "verdict": "unhealthy", "action": "reset", "gpus": 8,
             "findings": [{"check": "ecc", "action": "reset", "device": "GPU \x1b]0;T\x07", "text": "bad"}]}
    (tmp_path / health.HEALTH_FILE).write_text(json.dumps({"checked_at": 1.0, "nodes": [entry]}))
    seen = health.last_verdicts(tmp_path, inv)
    assert health.status_text(seen[0]) == "health unhealthy (reset: GPU \\x1b]0;T\\x07: bad)"


def test_a_dcgm_gpu_id_that_is_no_number_names_no_device() -> None:
    found = nodehealth.dcgm_findings({"tests": [{"name": "Memory", "status": "Fail", "gpu_id": "1\x1b[2J"},
                                                {"name": "PCIe", "status": "Warn", "gpu_id": "3"},
                                                {"name": "SM", "status": "Fail", "gpu_id": -1}]})
    assert actions(found) == [("dcgm", "isolate", "GPU ?"), ("dcgm", "monitor", "GPU 3"), ("dcgm", "isolate", "GPU ?")]
