"""The one entry to prepare a cluster's nodes (the configuration plane, when needed).

`Preparer.ensure_prepared` brings the nodes whose prepared record is not the expected
fingerprint to the prepared state: the head (and any node the head cannot install) by the
prepare play (configplane/prepare.py), the other workers through the head in one call
(headinstall.py), and records those that got there. The job runner prepares through it before
a job; autostop, `gpuctl start`, `gpuctl replace` and a managed job's supervisor through it
alone, with no job. It lives in jobplane/ because installing through the head is a call to
the head's agent.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from gpuctl.common.console import Reporter
from gpuctl.common.errors import PrepareFailed, UserError
from gpuctl.common.paths import cluster_dir
from gpuctl.configplane import clusterview, fabricrecord, prepare
from gpuctl.jobplane import headinstall
from gpuctl.providers import get_provider
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.provision.sshkeys import ensure_internal_key
from gpuctl.state.registry import Registry

if TYPE_CHECKING:  # the playbooks' driver (PyYAML, ansible-runner's world) loads only when nodes are prepared
    from gpuctl.configplane import playbooks


class Preparer:
    """Prepares the nodes of one cluster (its inventory) and keeps their records in its directory."""

    def __init__(self, inv: Inventory, *, reporter: Reporter, registry: Registry) -> None:
        self.inv = inv
        self.reporter = reporter
        self.registry = registry
        self.cdir = cluster_dir(inv.cluster)
        self.inventory_path = self.cdir / "inventory.yml"
        self.private_data_dir = self.cdir / "runner"
        self.control_dir = ssh.control_dir_for(self.cdir / "cm")
        self.features = prepare.features(self.cdir)  # optional node features prepared so far (bucket tools)

    def _request(self) -> dict:
        rec = self.registry.cluster(self.inv.cluster)
        return dict(rec.request) if rec and rec.request else {}

    def fabric_env(self) -> dict:
        """What prepare passes each node's fabric probe: the instance type and the cloud's static
        defaults (written only where the probe cannot see); the node decides the rest."""
        return fabricrecord.probe_settings(self.inv.cloud, self._request())

    def fingerprint(self) -> str:
        _, public = ensure_internal_key(self.cdir)
        return prepare.fingerprint(internal_public_key=public, fabric_env=self.fabric_env(), features=self.features,
                                   python=prepare.python_env(self.cdir))

    def view(self) -> dict | None:
        """What every node knows of the others (clusterview.py): given at prepare, carried by every job."""
        return clusterview.cluster_view(self.inv, fabricrecord.hostnames(self.cdir))

    def ensure_prepared(self, fingerprint: str | None = None, why: str | None = None) -> None:
        """Prepare the nodes not recorded as prepared with `fingerprint` (default: the one the cluster
        needs now); none: nothing to do."""
        fingerprint = fingerprint if fingerprint is not None else self.fingerprint()
        nodes = prepare.unprepared(self.cdir, self.inv, fingerprint)
        if not nodes:
            return
        if why is None:
            records = prepare.recorded(self.cdir)
            known = [n for n in nodes if prepare.node_key(n) in records]
            first = not records and not prepare.has_old_record(self.cdir)
            why = ("first job on this cluster" if first else
                   "gpuctl or the cluster changed" if known or not records else
                   ", ".join(n.name for n in nodes[:8]) + (", ..." if len(nodes) > 8 else "") + " not prepared yet")
        self.prepare(fingerprint, nodes, why)

    def prepare(self, fingerprint: str, nodes: Sequence[Node], why: str) -> None:
        """Bring `nodes` to the prepared state: the head (and any node the head cannot install) by
        the prepare play, each node on its own pace; then the other workers through the head, in
        one call (headinstall.py). Record those that got there, also when others failed: they are
        not prepared again."""
        from gpuctl.configplane import playbooks

        key, public = ensure_internal_key(self.cdir)
        total = len(self.inv.nodes)
        title = (f"Preparing {len(nodes)} node(s) ({why})" if len(nodes) == total else
                 f"Preparing {len(nodes)} of {total} node(s) ({why})")
        installed: dict[str, dict] = {}
        provider = get_provider(self.inv.cloud)
        view = self.view()
        by_head = self.installable_by_head(nodes, view)
        with self.reporter.stage(title, phase="prepare") as step:
            def on_installed(host: str, result: Mapping) -> None:
                installed[host] = dict(result)
                step.update(f"{len(installed)} of {len(nodes)} node(s) prepared", len(installed), len(nodes))

            def play(names: list[str], wait: bool) -> playbooks.PlaybookResult:
                return prepare.run_prepare(
                    self.inventory_path, private_data_dir=self.private_data_dir, control_dir=self.control_dir,
                    fingerprint_value=fingerprint, internal_key=key, fabric_env=self.fabric_env(),
                    known_hosts=Path(self.inv.head.known_hosts) if self.inv.head.known_hosts else None,
                    features=self.features, limit=names, python=prepare.python_env(self.cdir),
                    fabric_head=self.inv.head.address, view=view, wait=wait,
                    manages_sshd=not provider.local, on_installed=on_installed)

            def play_waiting(names: list[str]) -> playbooks.PlaybookResult:
                # Every node at once without waiting (a wait costs a connection reset and a probe per
                # node), then a wait for those still booting, each prepared as soon as it answers.
                result = play(names, wait=False)
                booting = [h for h, why in result.unreachable_reasons.items() if not ssh.host_key_changed(why)]
                if booting and result.error is None:
                    step.update(f"{len(installed)} of {len(nodes)} node(s) prepared; waiting for "
                                f"{len(booting)} to accept SSH")
                    # a phase within prepare: the nodes still booting, each prepared as it answers
                    with self.reporter.phase("wait"):
                        result = playbooks.merge_results(result, play(booting, wait=True), booting)
                return result

            direct = [n.name for n in nodes if n not in by_head]
            if direct and by_head:
                step.update(f"the prepare play on {', '.join(direct[:3])}{', ...' if len(direct) > 3 else ''}")
            result = play_waiting(direct) if direct else playbooks.PlaybookResult(ok=True)
            if by_head:
                head_failed = {f.host for f in result.failures} | set(result.unreachable)
                missed = [n.name for n in by_head]
                if self.inv.head.name not in head_failed and result.error is None:
                    step.update(f"{len(installed)} of {len(nodes)} node(s) prepared; the head installs the "
                                f"other {len(by_head)}")
                    by_head_result, missed = self.install_by_head(fingerprint, public, by_head, view, on_installed)
                    result = playbooks.merge_results(result, by_head_result, [])
                if missed:  # not reached from the head (booting, made before nodes trusted it, head down)
                    result = playbooks.merge_results(result, play_waiting(missed), [])
        found = fabricrecord.record(self.cdir, self.inv, installed)  # also after a failure: what the nodes found
        failed = {f.host for f in result.failures} | set(result.unreachable)
        done = [n for n in nodes if n.name in installed and n.name not in failed]
        if provider.checks_console_host_keys:
            self.check_console_host_keys(done)
        if done and result.error is None:
            prepare.record(self.cdir, self.inv, done, fingerprint)
            prepare.record_features(self.cdir, self.features)
        self.publish()  # shared state: the prepare records and learned host keys, a failure's too
        if not result.ok:
            for host, reason in result.unreachable_reasons.items():
                node = next((n for n in self.inv.nodes if n.name == host), None)
                if node is not None and ssh.host_key_changed(reason):
                    raise UserError(ssh.host_key_error(node))
            raise PrepareFailed(f"preparing the nodes failed: {describe_result(result)}")
        if found is not None:
            for line in fabricrecord.warnings(found, fabricrecord.expected_kind(self.inv.cloud, self._request())):
                self.reporter.info(f"Fabric: {line}")

    def install_by_head(self, fingerprint: str, public_key: str, workers: Sequence[Node], view: Mapping,
                        on_installed: Callable[[str, Mapping], None]) -> tuple[playbooks.PlaybookResult, list[str]]:
        """The head installs `workers` (headinstall.py): the outcome as a play's, and the workers it
        did not reach, for the prepare play."""
        from gpuctl.configplane import playbooks

        def on_peer(node: Node, outcome: headinstall.PeerResult) -> None:
            if outcome.ok:
                on_installed(node.name, {k: v for k, v in outcome.result.items() if k != "changed"})

        provider = get_provider(self.inv.cloud)
        bundle = prepare.install_bundle(fingerprint_value=fingerprint, internal_public_key=public_key, view=view,
                                        fabric_env=self.fabric_env(), fabric_head=self.inv.head.address)
        with self.reporter.phase("head_install"):  # a phase within prepare: one call, whatever the size
            outcomes = headinstall.install_through_head(
                self.inv.head, workers, bundle=bundle, bootstrap=prepare.install_bootstrap(),
                python=provider.node_python(), view=view, control_dir=self.control_dir, on_result=on_peer)
        failures = [playbooks.HostFailure(n.name, n.rank, None, outcomes[n.name].error) for n in workers
                    if not outcomes[n.name].ok and not outcomes[n.name].unreachable]
        return (playbooks.PlaybookResult(ok=not failures, failures=failures),
                [n.name for n in workers if outcomes[n.name].unreachable])

    def installable_by_head(self, nodes: Sequence[Node], view: Mapping | None) -> list[Node]:
        """The workers of `nodes` the head may install itself: their provider authorized the internal
        key at boot, the controller knows their host keys (the head checks them strictly), there is
        a view to give (not loopback nodes) and the install step is all that applies to them."""
        provider = get_provider(self.inv.cloud)
        if not (provider.authorizes_internal_key_at_boot and view and self.inv.head.known_hosts):
            return []
        if not prepare.only_install_step(manages_sshd=not provider.local, features=self.features,
                                         python=prepare.python_env(self.cdir)):
            return []
        pinned = ssh.known_aliases(Path(self.inv.head.known_hosts))
        return [n for n in nodes if n.rank != 0 and n.host_key_alias in pinned]

    def publish(self) -> None:
        """Leave the cluster's records in the state bucket (shared state only), for the next runner."""
        self.registry.publish(self.inv.cluster)

    def check_console_host_keys(self, nodes: Sequence[Node]) -> None:
        """The keys learned at first contact against those each instance printed to its console."""
        provider = get_provider(self.inv.cloud)
        unchecked = 0
        for node in nodes:
            if not node.known_hosts:
                continue
            printed, bad = provider.console_host_keys(node.node_id, self.inv.region, Path(node.known_hosts),
                                                      node.host_key_alias)
            if not printed:
                unchecked += 1
                continue
            if bad:
                ssh.forget_host_keys(Path(node.known_hosts), {node.host_key_alias})
                prepare.forget(self.cdir, [node])
                raise UserError(f"{node.name} ({node.ssh_host}): the SSH host key gpuctl received ({bad[0]}) is not "
                                f"one the instance printed to its console ({', '.join(sorted(printed))}); someone may "
                                "be intercepting the connection, so no job was run")
        if unchecked:
            self.reporter.info(f"Host keys of {unchecked} node(s) not checked against their console "
                               "(no fingerprints printed there yet); learned at first contact")


def describe_result(result: playbooks.PlaybookResult) -> str:
    parts = [f"{f.host}: {f.message}" + (f" (exit code {f.rc})" if f.rc is not None and "exit code" not in f.message
                                          else "") for f in result.failures]
    parts += [f"{h}: unreachable ({result.unreachable_reasons.get(h, 'no reason given')})" for h in result.unreachable]
    if result.error:
        parts.append(result.error)
    return "; ".join(parts) or "ansible reported a failure"

