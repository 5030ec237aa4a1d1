"""The nodes' IAM instance profile: SkyPilot's `remote_identity` from the task's config,
gpuctl's config / environment or ~/.sky/config.yaml, as the module's iam_instance_profile."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gpuctl.common.config import AwsSettings, aws_settings, instance_profile
from gpuctl.common.errors import UserError
from gpuctl.providers.aws.provider import AwsProvider, X_REMOTE_IDENTITY, describe, module_inputs
from gpuctl.spec import load_task
from gpuctl.spec.request import request_from_task

from test_aws_provider import KEY, p5_request


@pytest.mark.parametrize("value,cluster,profile", [
    ("data-reader", "c", "data-reader"),
    (None, "c", None),
    ("LOCAL_CREDENTIALS", "c", None),  # SkyPilot's default: gpuctl uploads no keys, so no profile
    ("no_upload", "c", None),
    ([{"train-*": "trainer"}, {"*": "reader"}], "train-7", "trainer"),
    ([{"train-*": "trainer"}, {"*": "reader"}], "eval", "reader"),
    ([{"train-*": "trainer"}], "eval", None),
])
def test_remote_identity_names_a_profile(value: object, cluster: str, profile: str | None) -> None:
    assert instance_profile(value, cluster, where="w") == profile


@pytest.mark.parametrize("value,says", [
    ("SERVICE_ACCOUNT", "w SERVICE_ACCOUNT: gpuctl creates no IAM roles"),
    ("arn:aws:iam::111122223333:instance-profile/reader", "not its ARN"),
    ([{"a": "x", "b": "y"}], "one-key mappings"),
    ({"a": "x"}, "give an instance profile name"),
])
def test_remote_identity_refusals_say_what_to_give(value: object, says: str) -> None:
    with pytest.raises(UserError) as err:
        instance_profile(value, "c", where="w")
    assert says in err.value.message


def test_settings_take_gpuctl_config_then_environment_then_skypilot_config(tmp_path: Path) -> None:
    sky = tmp_path / "sky.yaml"
    sky.write_text("aws:\n  remote_identity: from-sky\n")
    cfg = tmp_path / "config.yaml"
    env = {"SKYPILOT_GLOBAL_CONFIG": str(sky)}
    got = aws_settings(env, path=cfg)
    assert got.remote_identity == "from-sky" and got.origin("remote_identity") == f"aws.remote_identity in {sky}"
    cfg.write_text("aws:\n  remote_identity: [{'train-*': trainer}]\n")
    assert aws_settings(env, path=cfg).remote_identity == [{"train-*": "trainer"}]
    got = aws_settings({**env, "GPUCTL_AWS_REMOTE_IDENTITY": "from-env"}, path=cfg)
    assert (got.remote_identity, got.origin("remote_identity")) == ("from-env", "GPUCTL_AWS_REMOTE_IDENTITY")
    assert aws_settings({"SKYPILOT_GLOBAL_CONFIG": str(tmp_path / "none.yaml")}, path=tmp_path / "x").remote_identity \
        is None


def test_task_config_reaches_the_request_on_aws_only(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("name: t\nresources:\n  infra: aws/us-east-1\n  instance_type: g5.xlarge\n"
                    "config:\n  aws:\n    remote_identity: [{'t*': trainer}]\nrun: x\n")
    req = request_from_task(load_task(path))
    assert json.loads(req.extra[X_REMOTE_IDENTITY]) == [{"t*": "trainer"}]
    local = request_from_task(load_task(path), infra="local")
    assert X_REMOTE_IDENTITY not in local.extra


def test_module_input_from_the_task_over_the_settings() -> None:
    settings = AwsSettings(remote_identity="from-config", source={"remote_identity": "aws.remote_identity in X"})
    assert "iam_instance_profile" not in module_inputs(p5_request(), AwsSettings(), ssh_public_key=KEY)
    assert module_inputs(p5_request(), settings, ssh_public_key=KEY)["iam_instance_profile"] == "from-config"
    task = p5_request(extra={**p5_request().extra, X_REMOTE_IDENTITY: json.dumps("from-task")})
    assert module_inputs(task, settings, ssh_public_key=KEY)["iam_instance_profile"] == "from-task"
    assert "IAM instance profile: from-task (the task's config.aws.remote_identity)" in describe(task, settings)
    none = replace(task, extra={**task.extra, X_REMOTE_IDENTITY: json.dumps("NO_UPLOAD")})
    assert "iam_instance_profile" not in module_inputs(none, settings, ssh_public_key=KEY)


def test_bad_remote_identity_stops_before_any_aws_call(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_aws(*args: object, **kwargs: object) -> None:
        raise AssertionError("preflight ran")

    monkeypatch.setattr("gpuctl.providers.aws.provider.check_aws", no_aws)
    bad = p5_request(extra={X_REMOTE_IDENTITY: json.dumps("SERVICE_ACCOUNT")})
    with pytest.raises(UserError, match="config.aws.remote_identity SERVICE_ACCOUNT"):
        AwsProvider(AwsSettings()).prepare(bad)
