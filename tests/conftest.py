"""Shared fixtures: an isolated gpuctl state dir, and Terraform pointed at the
local filesystem mirror of hashicorp/aws (no registry on CI machines)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def find_provider_mirror() -> Path | None:
    """The directory holding `registry.terraform.io/hashicorp/aws/...`, if any."""
    candidates = [os.environ.get("GPUCTL_TF_MIRROR"), "/opt/tf-plugins", "/usr/share/terraform/plugins",
                  str(Path.home() / ".terraform.d/plugins")]
    for c in candidates:
        if c and (Path(c) / "registry.terraform.io/hashicorp/aws").is_dir():
            return Path(c)
    return None


@pytest.fixture(scope="session")
def tf_cli_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Terraform CLI config that installs hashicorp/* only from the mirror."""
    if not shutil.which("terraform"):
        pytest.fail("terraform is not on PATH; `make test` expects it (see README)")
    mirror = find_provider_mirror()
    if mirror is None:
        pytest.fail("no filesystem mirror of hashicorp/aws found; set GPUCTL_TF_MIRROR to its directory")
    cfg = tmp_path_factory.mktemp("tfcli") / "terraformrc"
    cfg.write_text(
        "provider_installation {\n"
        f'  filesystem_mirror {{\n    path    = "{mirror}"\n    include = ["registry.terraform.io/hashicorp/*"]\n  }}\n'
        '  direct {\n    exclude = ["registry.terraform.io/hashicorp/*"]\n  }\n'
        "}\n"
    )
    return cfg


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own GPUCTL_STATE_DIR so nothing touches ~/.gpuctl."""
    state = tmp_path / "gpuctl-state"
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(state))
    return state


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - Iterator[MotoServer]
    """One moto server on loopback for the session (tests that need a clean one reset it)."""
    from mototest import MotoServer

    server = MotoServer(log=tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
