"""gpuctl check --health, node side: is this node fit to train, and if not, what to do with it.

Installed on every node as ~/.gpuctl/lib/nodehealth.py (the prepared bundle) and run by the health
job's run stage with the node's system python3. Standard library only; the controller imports its
marks and actions (healthcheck/health.py), the unit tests its parsers. Each check reads what the node's own tools print, found on
PATH, so a fake `nvidia-smi` can stand in for a GPU:

  gpu_count   `nvidia-smi --query-gpu=... --format=csv` (`nvidia-smi -q -x` where a driver knows
              other field names) against the GPUs the cluster was made with
  ecc, row_remap, retired_pages, pcie, throttle, persistence   per GPU, from the same query
  gpu_index   a GPU index that is not a number (the GPU is then named by its place: GPU #N)
  xid         `NVRM: Xid (PCI:...): NN, ...` lines of this boot's kernel log (dmesg, else
              journalctl -k -b), each given the action of NVIDIA's Xid catalogue
  nvlink      `nvidia-smi nvlink -s`: a link listed inactive
  fabric      EFA / InfiniBand devices under SYS/class/infiniband against the count expected, and
              their ports' states
  memlock     `ulimit -l` (RLIMIT_MEMLOCK) where the node has an RDMA fabric: NCCL registers memory
  modules     nvidia_peermem (InfiniBand) and gdrdrv (GDRCopy, EFA) where the fabric wants them
  dcgm        `dcgmi diag -r LEVEL -j` where DCGM is installed
  disk        free space on the job and cache paths

Every finding names one action, the vocabulary of the AWS GPU cluster health-check suite, most
severe first: isolate (take the node out), reboot, reset (the GPU), monitor (keep an eye on it).
A node with an isolate, reboot or reset finding is unhealthy, one with monitor findings only is
degraded, else healthy. A missing tool is a skipped check, said in one line; a tool that hangs is
a finding (a GPU that stopped answering hangs nvidia-smi).

Output: one line `__GPUCTL_HEALTH__ {json}` on stdout: the node's verdict, its findings and what
each check did. Exit status 0 whatever the verdict: the controller judges.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

MARK = "__GPUCTL_HEALTH__"
ACTIONS = ("isolate", "reboot", "reset", "monitor")  # most severe first
UNHEALTHY_ACTIONS = ("isolate", "reboot", "reset")
TOOL_TIMEOUT_S = 30
MEMLOCK_MIN = 16 << 30  # what EFA and InfiniBand setups ask for ("unlimited" is best)
DISK_UNHEALTHY_BYTES = 1 << 30
DISK_LOW_BYTES = 10 << 30

# our name -> nvidia-smi's query field. Drivers before 535 call the clock reasons "throttle".
QUERY_FIELDS = (
    ("index", "index"), ("uuid", "uuid"), ("bus_id", "pci.bus_id"), ("name", "name"),
    ("ecc_uncorrected", "ecc.errors.uncorrected.volatile.total"),
    ("retired_pending", "retired_pages.pending"),
    ("remap_pending", "remapped_rows.pending"), ("remap_failure", "remapped_rows.failure"),
    ("pcie_width", "pcie.link.width.current"), ("pcie_width_max", "pcie.link.width.max"),
    ("pcie_gen", "pcie.link.gen.current"), ("pcie_gen_max", "pcie.link.gen.max"),
    ("clock_reasons", "clocks_event_reasons.active"), ("persistence", "persistence_mode"),
)
OLD_FIELD_NAMES = {"clocks_event_reasons.active": "clocks_throttle_reasons.active"}
UNKNOWN = ("", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "unknown error",
           "[insufficient permissions]")

# nvmlClocksEventReasons bits that mean the hardware slowed the GPU down (not idle or a power cap)
SLOWDOWN_REASONS = {0x8: "hardware slowdown", 0x20: "software thermal slowdown",
                    0x40: "hardware thermal slowdown", 0x80: "hardware power brake"}
GPU_IDLE = 0x1

# NVIDIA's Xid catalogue: number -> (action, meaning). Application faults (13, 31, 43) only ask to
# watch: the user's code is the usual cause; a number not listed here is watched too.
XID_CATALOGUE = {
    8: ("reset", "GPU stopped responding (timeout)"),
    13: ("monitor", "graphics engine exception (usually the application)"),
    31: ("monitor", "GPU memory page fault (usually the application)"),
    32: ("monitor", "invalid or corrupted push buffer stream"),
    38: ("reset", "driver firmware error"),
    43: ("monitor", "GPU stopped processing (usually the application)"),
    45: ("monitor", "preemptive cleanup after an earlier error"),
    48: ("reset", "double-bit ECC error"),
    54: ("isolate", "auxiliary power not connected"),
    57: ("reset", "error programming video memory interface"),
    58: ("reset", "unstable video memory interface"),
    61: ("reset", "internal micro-controller breakpoint"),
    62: ("reset", "internal micro-controller halt"),
    63: ("monitor", "ECC page retirement or row remapping recorded"),
    64: ("reset", "ECC page retirement or row remapping failed"),
    69: ("monitor", "graphics engine class error"),
    74: ("reset", "NVLink error"),
    79: ("reboot", "GPU has fallen off the bus"),
    92: ("monitor", "high single-bit ECC error rate"),
    94: ("reset", "contained ECC error"),
    95: ("reset", "uncontained ECC error"),
    109: ("monitor", "context switch timeout"),
    119: ("reboot", "GSP RPC timeout"),
    120: ("reboot", "GSP error"),
    121: ("monitor", "C2C link corrected error"),
    140: ("reset", "unrecovered ECC error"),
    143: ("reboot", "GPU initialization failure"),
    154: ("monitor", "GPU recovery action changed"),  # its text names the action: xid_action
}
XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+),?\s*(.*)")


def finding(check, action, text, device=None):
    return {"check": check, "action": action, "device": device, "text": text}


def verdict(findings):
    """healthy, degraded (monitor findings only) or unhealthy, and the most severe action (or None)."""
    actions = [f["action"] for f in findings]
    worst = next((a for a in ACTIONS if a in actions), None)
    if worst is None:
        return "healthy", None
    return ("unhealthy" if worst in UNHEALTHY_ACTIONS else "degraded"), worst


# -- reading nvidia-smi ------------------------------------------------------------------------


def value(text):
    """A field as a number, "Enabled"/"Yes" as True, "Disabled"/"No" as False, unknown as None."""
    text = (text or "").strip()
    low = text.lower()
    if low in UNKNOWN or low.startswith("[n/a") or low.startswith("[not supported"):
        return None
    if low in ("enabled", "yes", "active"):
        return True
    if low in ("disabled", "no", "inactive"):
        return False
    try:
        return int(text, 16) if low.startswith("0x") else int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse_query_csv(text, names=None):
    """`--query-gpu=... --format=csv,noheader,nounits` lines -> one dict per GPU, keyed by our names."""
    names = names or [ours for ours, _ in QUERY_FIELDS]
    gpus = []
    for line in text.split("\n"):  # a \r or other break inside a cell is the cell's (splitlines would cut it)
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < len(names):
            continue
        # a GPU name may hold commas: it is the only free text, so the extra cells are its own
        extra = len(cells) - len(names)
        at = names.index("name") if "name" in names else None
        if extra and at is not None:
            cells[at:at + extra + 1] = [", ".join(cells[at:at + extra + 1])]
        gpu = {}
        for ours, cell in zip(names, cells):
            gpu[ours] = cell if ours in ("uuid", "bus_id", "name") else value(cell)
        gpus.append(gpu)
    return gpus


def _xml_text(node, path):
    found = node.find(path)
    return None if found is None or found.text is None else found.text


def parse_query_xml(text):
    """`nvidia-smi -q -x` -> the same dicts as parse_query_csv."""
    root = ElementTree.fromstring(text)
    gpus = []
    for index, gpu in enumerate(root.findall("gpu")):
        reasons = gpu.find("clocks_event_reasons")
        if reasons is None:
            reasons = gpu.find("clocks_throttle_reasons")
        bits = 0
        if reasons is not None:  # one element per reason, "Active" or "Not Active"
            names = {"clocks_event_reason_gpu_idle": 0x1, "clocks_throttle_reason_gpu_idle": 0x1,
                     "clocks_event_reason_hw_slowdown": 0x8, "clocks_throttle_reason_hw_slowdown": 0x8,
                     "clocks_event_reason_sw_thermal_slowdown": 0x20,
                     "clocks_throttle_reason_sw_thermal_slowdown": 0x20,
                     "clocks_event_reason_hw_thermal_slowdown": 0x40,
                     "clocks_throttle_reason_hw_thermal_slowdown": 0x40,
                     "clocks_event_reason_hw_power_brake_slowdown": 0x80,
                     "clocks_throttle_reason_hw_power_brake_slowdown": 0x80}
            for child in reasons:
                if (child.text or "").strip() == "Active":
                    bits |= names.get(child.tag, 0)
        pci = "pci/pci_gpu_link_info/"
        gpus.append({
            "index": index, "uuid": _xml_text(gpu, "uuid") or "", "bus_id": gpu.get("id") or "",
            "name": _xml_text(gpu, "product_name") or "",
            "ecc_uncorrected": _uncorrectable(gpu.find("ecc_errors/volatile")),
            "retired_pending": value(_xml_text(gpu, "retired_pages/pending_retirement")),
            "remap_pending": value(_xml_text(gpu, "remapped_rows/remapped_row_pending")),
            "remap_failure": value(_xml_text(gpu, "remapped_rows/remapped_row_failure")
                                   or _xml_text(gpu, "remapped_rows/remapped_row_failure_occurred")),
            "pcie_width": _lanes(_xml_text(gpu, pci + "link_widths/current_link_width")),
            "pcie_width_max": _lanes(_xml_text(gpu, pci + "link_widths/max_link_width")),
            "pcie_gen": value(_xml_text(gpu, pci + "pcie_gen/current_link_gen")),
            "pcie_gen_max": value(_xml_text(gpu, pci + "pcie_gen/max_link_gen")),
            "clock_reasons": bits if reasons is not None else None,
            "persistence": value(_xml_text(gpu, "persistence_mode")),
        })
    return gpus


def _uncorrectable(volatile):
    """Volatile uncorrectable ECC errors: the sum of the sram_uncorrectable* and dram_uncorrectable
    counts (H100 and later drivers) or the double-bit total (older ones); None when none is known."""
    if volatile is None:
        return None
    counts = [value(e.text) for e in volatile.iter() if len(e) == 0 and "uncorrectable" in e.tag]
    double = volatile.find("double_bit/total")
    if double is not None:
        counts.append(value(double.text))
    known = [c for c in counts if isinstance(c, (int, float))]
    return sum(known) if known else None


def _lanes(text):
    """"16x" -> 16."""
    return value((text or "").strip().rstrip("xX"))


def parse_xids(lines):
    """Kernel log lines -> [(bus id, xid, the rest of the line)]."""
    found = []
    for line in lines:
        match = XID_LINE.search(line)
        if match:
            found.append((match.group(1), int(match.group(2)), match.group(3).strip()))
    return found


def parse_nvlink(text):
    """`nvidia-smi nvlink -s` -> {gpu index: (links listed, [inactive link numbers])}."""
    gpus = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"GPU (\d+):", line.strip())
        if head:
            current = int(head.group(1))
            gpus[current] = (0, [])
            continue
        link = re.match(r"Link (\d+): (.*)", line.strip())
        if link and current is not None:
            count, down = gpus[current]
            if "inactive" in link.group(2).lower():
                down = down + [int(link.group(1))]
            gpus[current] = (count + 1, down)
    return gpus


def _bus_key(bus_id):
    """The part of a PCI address both nvidia-smi (00000000:53:00.0) and the kernel log (0000:53:00) share."""
    parts = bus_id.lower().split(":")
    return ":".join(p for p in parts[-2:]).split(".")[0] if len(parts) >= 2 else bus_id.lower()


# -- findings -----------------------------------------------------------------------------------


def gpu_findings(gpus, expected):
    """The count against what the cluster was made with, then each GPU's own state."""
    out = []
    if expected and len(gpus) < expected:
        out.append(finding("gpu_count", "reboot", "%d of %d GPUs visible to nvidia-smi" % (len(gpus), expected)))
    for place, gpu in enumerate(gpus):
        dev = gpu_device(gpu.get("index"), place)
        if dev.startswith("GPU #"):
            out.append(finding("gpu_index", "monitor", "nvidia-smi gave GPU index %s, not a number"
                               % ascii(gpu.get("index")), dev))
        said = " ".join(str(v) for k, v in sorted(gpu.items()) if k not in ("uuid", "bus_id", "name")).lower()
        if "gpu is lost" in said:
            out.append(finding("gpu_state", "reboot", "nvidia-smi says the GPU is lost", dev))
            continue
        if "requires reset" in said or "err!" in said:
            out.append(finding("gpu_state", "reset", "nvidia-smi answers with errors (%s)" % (
                "GPU requires reset" if "requires reset" in said else "ERR!"), dev))
            continue
        ecc = gpu.get("ecc_uncorrected")
        if isinstance(ecc, (int, float)) and ecc > 0:
            out.append(finding("ecc", "reset", "%d uncorrectable ECC error(s) since the driver loaded" % ecc, dev))
        if gpu.get("remap_failure") is True:
            out.append(finding("row_remap", "isolate", "a row remapping failed: the memory cannot be repaired", dev))
        elif gpu.get("remap_pending") is True:
            out.append(finding("row_remap", "reset", "a row remapping is pending: a GPU reset applies it", dev))
        if gpu.get("retired_pending") is True:
            out.append(finding("retired_pages", "reset", "a page retirement is pending: a GPU reset applies it", dev))
        width, width_max = gpu.get("pcie_width"), gpu.get("pcie_width_max")
        if isinstance(width, int) and isinstance(width_max, int) and 0 < width < width_max:
            out.append(finding("pcie", "isolate", "PCIe link x%d of x%d" % (width, width_max), dev))
        reasons = gpu.get("clock_reasons")
        gen, gen_max = gpu.get("pcie_gen"), gpu.get("pcie_gen_max")
        idle = isinstance(reasons, int) and reasons & GPU_IDLE
        if isinstance(gen, int) and isinstance(gen_max, int) and gen < gen_max and not idle:
            out.append(finding("pcie", "monitor", "PCIe gen %d of %d while busy" % (gen, gen_max), dev))
        if isinstance(reasons, int):
            slow = [text for bit, text in sorted(SLOWDOWN_REASONS.items()) if reasons & bit]
            if slow:
                out.append(finding("throttle", "monitor", "clocks held down: %s" % ", ".join(slow), dev))
        if gpu.get("persistence") is False:
            out.append(finding("persistence", "monitor", "persistence mode is off (nvidia-smi -pm 1, or "
                                                         "nvidia-persistenced)", dev))
    return out


def gpu_device(index, place):
    """"GPU 3" for an index that is a whole number; else "GPU #place" (its place in nvidia-smi's
    list): a tool's text never names a device in our findings unchecked."""
    if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
        return "GPU %d" % index
    return "GPU #%d" % place


def xid_action(xid, text):
    """The catalogue's (action, meaning); Xid 154 says its own: "... Node Reboot Required", "GPU Reset
    Required", "Drain and Reset"."""
    action, meaning = XID_CATALOGUE.get(xid, ("monitor", "not in gpuctl's Xid catalogue"))
    if xid == 154:
        low = text.lower()
        action = "reboot" if "reboot" in low else "reset" if "reset" in low else action
    return action, meaning


def xid_findings(xids, gpus):
    """One finding per Xid number and GPU, with the catalogue's action and how often it occurred."""
    by_bus = {_bus_key(g.get("bus_id") or ""): gpu_device(g.get("index"), place) for place, g in enumerate(gpus)}
    seen = {}
    for bus, xid, rest in xids:
        dev = by_bus.get(_bus_key(bus)) or "PCI %s" % bus
        key = (dev, xid)
        seen[key] = (seen[key][0] + 1, seen[key][1]) if key in seen else (1, rest)
    out = []
    for (dev, xid), (count, rest) in sorted(seen.items()):
        action, meaning = xid_action(xid, rest)
        times = "" if count == 1 else " (%d times)" % count
        out.append(finding("xid", action, "Xid %d: %s%s%s" % (xid, meaning, times,
                                                             (": " + rest[:120]) if rest else ""), dev))
    return out


def nvlink_findings(links):
    out = []
    for index, (count, down) in sorted(links.items()):
        if count and down:
            out.append(finding("nvlink", "reset", "NVLink %s of %d inactive" % (
                ", ".join(str(d) for d in down), count), "GPU %d" % index))
    return out


def rdma_devices(sys_root):
    """{device: (driver, {port: state})} under SYS/class/infiniband."""
    base = os.path.join(sys_root, "class", "infiniband")
    found = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return found
    for name in names:
        try:
            driver = os.path.basename(os.path.realpath(os.path.join(base, name, "device", "driver")))
        except OSError:
            driver = ""
        ports = {}
        try:
            for port in sorted(os.listdir(os.path.join(base, name, "ports"))):
                with open(os.path.join(base, name, "ports", port, "state")) as fh:
                    ports[port] = fh.read().strip()
        except OSError:
            pass
        found[name] = (driver, ports)
    return found


def efa_devices(devices):
    """The EFA devices of rdma_devices(): driver efa, or an EFA name (rdmap*, efa_*) where the driver
    link cannot be read."""
    return [d for d, (driver, _) in devices.items() if driver == "efa" or d.startswith("rdmap") or d.startswith("efa")]


def fabric_findings(devices, expected_fabric, expected_efa):
    """EFA/InfiniBand devices against the count and kind the cluster was made with, and their ports:
    a port not ACTIVE on the fabric the cluster trains over asks for a reboot; elsewhere (a spare
    HCA, a front-end NIC) it is only watched."""
    out = []
    efa = efa_devices(devices)
    if expected_efa and len(efa) < expected_efa:
        out.append(finding("fabric", "reboot", "%d of %d EFA devices present" % (len(efa), expected_efa)))
    elif expected_fabric in ("ib", "roce") and not [d for d in devices if d not in efa]:
        out.append(finding("fabric", "reboot", "no InfiniBand or RoCE device present"))
    for dev, (_, ports) in sorted(devices.items()):
        on_fabric = (dev in efa) if expected_fabric == "efa" else (dev not in efa and expected_fabric in ("ib", "roce"))
        for port, state in sorted(ports.items()):
            if "ACTIVE" not in state.upper() or "INACTIVE" in state.upper():
                out.append(finding("fabric", "reboot" if on_fabric else "monitor",
                                   "port %s is %s" % (port, state.split(":")[-1].strip()), dev))
    return out


def memlock_findings(limit, rdma):
    """RLIMIT_MEMLOCK where NCCL registers memory with an RDMA device."""
    if not rdma or limit == resource.RLIM_INFINITY or limit < 0:
        return []
    if limit < MEMLOCK_MIN:
        return [finding("memlock", "isolate", "ulimit -l is %s KiB; RDMA needs unlimited (or >= 16 GiB): set "
                                              "memlock in /etc/security/limits.conf or the unit's LimitMEMLOCK"
                        % (limit // 1024))]
    return []


def module_findings(loaded, fabric, gdrcopy_wanted):
    """Kernel modules GPUDirect wants: nvidia_peermem on InfiniBand, gdrdrv (GDRCopy) on EFA."""
    out = []
    if fabric == "ib" and not ({"nvidia_peermem", "nv_peer_mem"} & loaded):
        out.append(finding("modules", "monitor", "nvidia_peermem is not loaded: no GPUDirect RDMA over InfiniBand"))
    if gdrcopy_wanted and "gdrdrv" not in loaded:
        out.append(finding("modules", "monitor", "gdrdrv (GDRCopy) is not loaded: slower small messages on EFA"))
    return out


def dcgm_findings(document):
    """`dcgmi diag -j` output: every test whose result is Fail (isolate) or Warn (monitor)."""
    out = []

    def walk(node, name):
        if isinstance(node, dict):
            here = node.get("name") or node.get("test_name") or name
            status = str(node.get("status") or node.get("result") or "")
            if status.lower() in ("fail", "failed") and here:
                out.append(finding("dcgm", "isolate", "dcgmi diag: %s failed" % here, _dcgm_device(node)))
            elif status.lower() in ("warn", "warning") and here:
                out.append(finding("dcgm", "monitor", "dcgmi diag: %s warned" % here, _dcgm_device(node)))
            for child in node.values():
                walk(child, here)
        elif isinstance(node, list):
            for child in node:
                walk(child, name)

    walk(document, None)
    unique = []
    for f in out:
        if f not in unique:
            unique.append(f)
    return unique


def _dcgm_device(node):
    gpu = node.get("gpu_id", node.get("gpu"))
    if isinstance(gpu, str) and re.match(r"[0-9]+\Z", gpu):
        gpu = int(gpu)
    if gpu is None:
        return None
    return "GPU %d" % gpu if isinstance(gpu, int) and not isinstance(gpu, bool) and gpu >= 0 else "GPU ?"


def disk_findings(paths):
    out = []
    for path in paths:
        probe = path
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        try:
            st = os.statvfs(probe or "/")
        except OSError:
            continue
        free = st.f_bavail * st.f_frsize
        if free < DISK_UNHEALTHY_BYTES:
            out.append(finding("disk", "isolate", "%s: %.1f GiB free" % (path, free / float(1 << 30))))
        elif free < DISK_LOW_BYTES:
            out.append(finding("disk", "monitor", "%s: %.1f GiB free" % (path, free / float(1 << 30))))
    return out


# -- running the tools -------------------------------------------------------------------------


def run_tool(argv, timeout=TOOL_TIMEOUT_S):
    """(exit code, stdout, stderr); code None when the tool is not on PATH, "timeout" when it hung."""
    if shutil.which(argv[0]) is None:
        return None, "", ""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", ""
    except OSError as exc:
        return 127, "", str(exc)
    return proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")


def read_gpus():
    """(gpus, how they were read, a finding when nvidia-smi hung or failed)."""
    fields = [theirs for _, theirs in QUERY_FIELDS]
    names = [ours for ours, _ in QUERY_FIELDS]
    for attempt in (fields, [OLD_FIELD_NAMES.get(f, f) for f in fields]):
        code, out, err = run_tool(["nvidia-smi", "--query-gpu=" + ",".join(attempt), "--format=csv,noheader,nounits"])
        if code is None:
            return None, "nvidia-smi is not on PATH", None
        if code == "timeout":
            return [], "", finding("gpu_count", "reboot", "nvidia-smi did not answer in %d s" % TOOL_TIMEOUT_S)
        if code == 0:
            return parse_query_csv(out, names), "nvidia-smi --query-gpu", None
        if "field" not in (out + err).lower():
            break  # not a field-name problem: the XML has the same facts
    code, out, err = run_tool(["nvidia-smi", "-q", "-x"])
    if code == 0:
        try:
            return parse_query_xml(out), "nvidia-smi -q -x", None
        except ElementTree.ParseError:
            pass
    why = (err.strip().splitlines() or out.strip().splitlines() or ["exit code %s" % code])[-1][:200]
    return [], "", finding("gpu_count", "reboot", "nvidia-smi failed: %s" % why)


def kernel_log():
    """This boot's kernel log lines, and where they came from (None when none could be read)."""
    for argv in (["dmesg"], ["journalctl", "-k", "-b", "-o", "cat", "--no-pager"]):  # never sudo: no alarms
        code, out, _ = run_tool(argv)
        if code == 0 and out:
            return out.splitlines(), " ".join(argv)
    return None, None


def loaded_modules(proc_root):
    try:
        with open(os.path.join(proc_root, "modules")) as fh:
            return {line.split()[0] for line in fh if line.strip()}
    except OSError:
        return set()


def check_node(args):
    """Every check; the node's document."""
    findings = []
    checks = {}

    gpus, how, failed = read_gpus()
    if gpus is None:
        if args.expect_gpus:
            findings.append(finding("gpu_count", "reboot", "nvidia-smi is not on PATH: 0 of %d GPUs visible"
                                    % args.expect_gpus))
            checks["gpus"] = "nvidia-smi missing"
        else:
            checks["gpus"] = "skipped: no nvidia-smi, and the cluster has no GPU"
        gpus = []
    else:
        findings += [failed] if failed else gpu_findings(gpus, args.expect_gpus)
        checks["gpus"] = "%d GPU(s) read with %s" % (len(gpus), how) if how else "nvidia-smi failed"
        code, out, _ = run_tool(["nvidia-smi", "nvlink", "-s"])
        if code == 0:
            links = parse_nvlink(out)
            findings += nvlink_findings(links)
            checks["nvlink"] = "%d link(s) read" % sum(c for c, _ in links.values())
        else:
            checks["nvlink"] = "skipped: nvidia-smi nvlink -s did not answer"
    if gpus:
        lines, source = kernel_log()
        if lines is None:
            checks["xid"] = "skipped: the kernel log is not readable here (dmesg_restrict)"
        else:
            xids = parse_xids(lines)
            findings += xid_findings(xids, gpus)
            checks["xid"] = "%d Xid line(s) in %s" % (len(xids), source)
    else:
        checks["xid"] = "skipped: no GPU"

    devices = rdma_devices(os.path.join(args.root, "sys"))
    findings += fabric_findings(devices, args.expect_fabric, args.expect_efa)
    checks["fabric"] = "%d RDMA device(s)" % len(devices) + (
        ", %d EFA expected" % args.expect_efa if args.expect_efa else "")
    rdma = bool(devices) or args.expect_fabric in ("efa", "ib", "roce")
    limit = args.memlock if args.memlock is not None else resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    findings += memlock_findings(limit, rdma)
    checks["memlock"] = ("unlimited" if limit == resource.RLIM_INFINITY else "%d KiB" % (limit // 1024)) + (
        "" if rdma else " (no RDMA fabric: not needed)")
    fabric = args.expect_fabric or ("efa" if efa_devices(devices) else None)
    if gpus and fabric in ("efa", "ib"):
        findings += module_findings(loaded_modules(os.path.join(args.root, "proc")), fabric,
                                    gdrcopy_wanted=fabric == "efa")
        checks["modules"] = "read"
    if gpus and args.level:
        code, out, err = run_tool(["dcgmi", "diag", "-r", str(args.level), "-j"], timeout=args.dcgm_timeout)
        if code is None:
            checks["dcgm"] = "skipped: dcgmi is not installed"
        elif code == "timeout":
            findings.append(finding("dcgm", "reboot", "dcgmi diag -r %d did not finish in %d s"
                                    % (args.level, args.dcgm_timeout)))
            checks["dcgm"] = "timed out"
        else:
            try:
                findings += dcgm_findings(json.loads(out))
                checks["dcgm"] = "dcgmi diag -r %d" % args.level
            except ValueError:
                why = (err.strip().splitlines() or ["exit code %s" % code])[-1][:200]
                checks["dcgm"] = "skipped: dcgmi diag gave no JSON (%s)" % why
    findings += disk_findings([os.path.expanduser(p) for p in args.path])
    checks["disk"] = ", ".join(args.path)

    state, action = verdict(findings)
    return {"kind": "node", "node_rank": args.node_rank, "hostname": socket.gethostname(), "verdict": state,
            "action": action, "gpus": len(gpus), "findings": findings, "checks": checks}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="nodehealth.py")
    parser.add_argument("--node-rank", type=int, default=int(os.environ.get("GPUCTL_NODE_RANK", "0") or 0))
    parser.add_argument("--expect-gpus", type=int, default=0)
    parser.add_argument("--expect-efa", type=int, default=0)
    parser.add_argument("--expect-fabric", default=None)
    parser.add_argument("--level", type=int, default=1, help="dcgmi diag level (0: no DCGM run)")
    parser.add_argument("--dcgm-timeout", type=int, default=600)
    parser.add_argument("--path", action="append", default=None, help="a job or cache path whose disk to check")
    parser.add_argument("--memlock", type=int, default=None, help=argparse.SUPPRESS)  # tests
    parser.add_argument("--root", default="/", help=argparse.SUPPRESS)  # tests: a fake /sys and /proc
    args = parser.parse_args(argv)
    args.path = args.path or ["~/.gpuctl/jobs", "~/.cache", "/tmp"]
    try:
        doc = check_node(args)
    except Exception as exc:  # noqa: BLE001 - one line for the controller, never a traceback on its screen
        doc = {"kind": "node", "node_rank": args.node_rank, "hostname": socket.gethostname(),
               "verdict": "unhealthy", "action": "isolate", "gpus": 0, "checks": {},
               "findings": [finding("probe", "isolate", "the health probe failed: %s: %s"
                                    % (type(exc).__name__, exc))]}
    sys.stdout.write("%s %s\n" % (MARK, json.dumps(doc, sort_keys=True)))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
