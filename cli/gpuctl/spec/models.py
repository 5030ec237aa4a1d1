"""The task YAML as pydantic models: `Task`, its `Resources` and a git `workdir`.

Why a module of its own: this is the shape of a task, what each field holds
after validation and the few rules that span fields (infra vs cloud/region/zone,
any_of/ordered, which alternative gpuctl can provision). Parsing single values
is fields.py's; reading a file and turning errors into one line is loader.py's
and messages.py's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, Strict, ValidationInfo, field_validator,
                      model_validator)

from gpuctl.spec.autostop import Autostop, AutostopError, parse_autostop
from gpuctl.spec.recovery import JobRecovery, RecoveryError, parse_job_recovery
from gpuctl.spec.buckets import BucketMount
from gpuctl.spec.fields import (_CPUS_RE, _MANAGED_SECRETS, _MEMORY_RE, _RESOURCE_ALIASES, _WHERE_FIELDS, _accelerators,
                                _aliased, _bad, _bucket_mount, _disk_size, _expand, _image_for_region, _infra_problem,
                                _kind, _labels, _local_path, _network_tier, _number_text, _ports, _quantity,
                                _region_from_images, _region_of, _scalar_text, _show, _upload_dir, _variables)
from gpuctl.spec.infra import WHAT_IS_SUPPORTED, Infra, infra_from_legacy, parse_infra
from gpuctl.spec import nodepaths
from gpuctl.spec.nodepaths import destination_problem

# The provider's offline word on a location's resources: (cloud, resources) -> (field, why) or None.
# load_task's callers pass gpuctl.providers.resources_problem (spec/ never imports providers/).
ResourcesCheck = Callable[[str, "Resources"], "tuple[str, str] | None"]

# A Path that also validates from a str, so a task dumped to JSON loads back.
_LocalPath = Annotated[Path, Strict(False)]
DOCKER_PREFIX = "docker:"
_GIT_URL_RE = re.compile(r"^(?:(?:https?|ssh|git|file)://\S+|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^\s-]\S*)$")
_GIT_REF_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/+-]*$")
_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$")  # registry/name:tag or @sha256:...


def _placed(dest: str, *, bucket: bool) -> tuple[str, str]:
    """(where `dest` lands as checked, the key it is kept under): an absolute or ~ one as written both
    times; a relative one placed by nodepaths.on_node, and kept as the canonical path it names
    (~/gpuctl_workdir/train.py) once the checks passed."""
    remote = nodepaths.on_node(dest, bucket=bucket)
    if remote == dest:
        return remote, remote
    try:
        return remote, nodepaths.normalize(remote)
    except nodepaths.BadPath:
        return remote, remote  # destination_problem says why


class _Model(BaseModel):
    """Strict (no "2" -> 2, no true -> 1) and closed (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    IGNORED_FIELDS: ClassVar[frozenset[str]] = frozenset()
    UNSUPPORTED_FIELDS: ClassVar[dict[str, str]] = {}

    @classmethod
    def _set_aside(cls, data: Any, info: ValidationInfo) -> Any:
        """Move SkyPilot fields gpuctl does not act on into `ignored`; refuse unsupported ones.
        `ignored` itself is input only when re-validating a dumped model, never in a YAML file."""
        if not isinstance(data, dict):
            return data
        if "ignored" in data and (info.context or {}).get("from_yaml"):
            raise _bad("unknown field", "ignored")
        for key, why in cls.UNSUPPORTED_FIELDS.items():
            if key in data:
                raise _bad(why, key)
        ignored = {k: v for k, v in data.items() if k in cls.IGNORED_FIELDS}
        if not ignored:
            return data
        kept = {k: v for k, v in data.items() if k not in ignored}
        return {**kept, "ignored": {**(kept.get("ignored") or {}), **ignored}}


class Resources(_Model):
    """`resources:` of a task: where, what machine, how many accelerators."""

    IGNORED_FIELDS: ClassVar[frozenset[str]] = frozenset({
        "accelerator_args", "local_disk", "max_hourly_cost", "priority",
        "priority_class", "ephemeral_storage", "_no_missing_accel_warnings", "_docker_login_config",
        "_is_image_managed", "_requires_fuse", "_cluster_config_overrides",
    })
    UNSUPPORTED_FIELDS: ClassVar[dict[str, str]] = {
        "volumes": "volumes are not supported by gpuctl; use file_mounts (a local path or an s3:// bucket)",
    }

    infra: str | None = None
    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    accelerators: dict[str, float] | None = None  # name as written -> count; first = provisioned
    cpus: str | None = None  # "8", "8+", "0.5"
    memory: str | None = None  # "32", "32+", "32GB+"
    instance_type: str | None = None
    use_spot: bool = False
    disk_size: int | None = None  # GB
    disk_tier: str | None = None
    image_id: str | None = None
    network_tier: Literal["standard", "best"] | None = None
    ports: list[str] | None = None
    labels: dict[str, str] | None = None
    autostop: Autostop | None = None
    job_recovery: JobRecovery | None = None  # acted on by `gpuctl jobs launch` (managed jobs)
    any_of: list[Resources] | None = None
    ordered: list[Resources] | None = None
    ignored: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data: Any, info: ValidationInfo) -> Any:
        data = cls._set_aside(_aliased(data, _RESOURCE_ALIASES), info)
        if isinstance(data, dict) and isinstance(data.get("image_id"), dict) and data["image_id"]:
            data = _region_from_images(data)
            if isinstance(data["image_id"], dict):
                data = {**data, "image_id": _image_for_region(data["image_id"], _region_of(data))}
        return data

    @field_validator("accelerators", mode="before")
    @classmethod
    def _check_accelerators(cls, value: Any) -> dict[str, float] | None:
        return _accelerators(value)

    @field_validator("autostop", mode="before")
    @classmethod
    def _check_autostop(cls, value: Any) -> Autostop | None:
        try:
            return parse_autostop(value)
        except AutostopError as exc:
            raise _bad(str(exc), *([exc.key] if exc.key else [])) from None

    @field_validator("job_recovery", mode="before")
    @classmethod
    def _check_job_recovery(cls, value: Any) -> JobRecovery | None:
        try:
            return parse_job_recovery(value)
        except RecoveryError as exc:
            raise _bad(str(exc), *([exc.key] if exc.key else [])) from None

    @field_validator("cpus", mode="before")
    @classmethod
    def _check_cpus(cls, value: Any) -> str | None:
        return _quantity(value, _CPUS_RE, "8 or 8+")

    @field_validator("memory", mode="before")
    @classmethod
    def _check_memory(cls, value: Any) -> str | None:
        return _quantity(value, _MEMORY_RE, "32 or 32+ (GB)")

    @field_validator("use_spot", mode="before")
    @classmethod
    def _check_use_spot(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("disk_size", mode="before")
    @classmethod
    def _check_disk_size(cls, value: Any) -> int | None:
        return _disk_size(value)

    @field_validator("network_tier", mode="before")
    @classmethod
    def _check_network_tier(cls, value: Any) -> str | None:
        return _network_tier(value)

    @field_validator("image_id", mode="before")
    @classmethod
    def _check_image_id(cls, value: Any) -> Any:
        if isinstance(value, str) and value.startswith(DOCKER_PREFIX):
            image = value[len(DOCKER_PREFIX):].strip()
            if not _IMAGE_RE.fullmatch(image):
                raise _bad(f"{_show(value)} is not a container image; write docker:IMAGE such as "
                           "docker:nvcr.io/nvidia/pytorch:24.10-py3")
            return DOCKER_PREFIX + image
        return value

    @field_validator("ports", mode="before")
    @classmethod
    def _check_ports(cls, value: Any) -> list[str] | None:
        return _ports(value)

    @field_validator("labels", mode="before")
    @classmethod
    def _check_labels(cls, value: Any) -> dict[str, str] | None:
        return _labels(value)

    @model_validator(mode="after")
    def _check_location_and_choices(self) -> Resources:
        legacy = [f for f in ("cloud", "region", "zone") if getattr(self, f)]
        if self.infra and legacy:
            raise _bad(f"give either infra or cloud/region/zone, not both (infra is '{self.infra}')", legacy[0])
        if self.infra:
            if problem := _infra_problem(self.infra, "infra"):
                raise _bad(problem, "infra")
        elif legacy and not self.cloud:
            raise _bad(f"{legacy[0]} needs cloud: aws (or write infra: aws/REGION/ZONE)", legacy[0])
        elif self.cloud:
            # One step at a time, so the error points at the part that is wrong.
            steps = [("cloud", self.cloud)]
            if self.region:
                steps.append(("region", f"{self.cloud}/{self.region}"))
            if self.zone:
                steps.append(("zone", f"{self.cloud}/{self.region or '*'}/{self.zone}"))
            for field, text in steps:
                if problem := _infra_problem(text, field):
                    raise _bad(problem, field)
        if self.any_of and self.ordered:
            raise _bad("give either any_of or ordered, not both", "ordered")
        for group in ("any_of", "ordered"):
            for index, choice in enumerate(getattr(self, group) or []):
                if choice.any_of or choice.ordered:
                    raise _bad("an alternative cannot hold any_of/ordered itself", group, index)
        return self

    def infra_spec(self) -> Infra:
        """Where to provision: `infra`, else legacy cloud/region/zone, else local."""
        if self.infra:
            return parse_infra(self.infra)
        return infra_from_legacy(self.cloud, self.region, self.zone)

    def describe(self) -> str:
        """A few words for what these resources ask for, as written: `aws/us-east-1, H100:8`."""
        where = self.infra or "/".join(x for x in (self.cloud, self.region, self.zone) if x) or "local"
        accel = ", ".join(f"{k}:{_number_text(v)}" for k, v in (self.accelerators or {}).items())
        return ", ".join(x for x in (where, self.instance_type, accel) if x)

    def provision_problem(self, check: ResourcesCheck | None = None) -> tuple[str, str] | None:
        """(field, why) when gpuctl cannot provision these resources: a cloud it does not
        support, or what `check` (the provider's, e.g. AWS: no instance type for the
        accelerators / cpus / memory asked for) finds."""
        fields = [("infra", self.infra)] if self.infra else [("cloud", self.cloud)] if self.cloud else []
        for field, value in fields:
            if problem := _infra_problem(value, field, unsupported_too=True):
                return field, problem
        return check(self.infra_spec().cloud, self) if check is not None else None

    def accelerator_pair(self) -> tuple[str | None, float]:
        """("A100", 8.0) for the accelerator that is provisioned; (None, 0.0) if none."""
        if not self.accelerators:
            return None, 0.0
        name, count = next(iter(self.accelerators.items()))
        return name, float(count)

    def with_choice(self, choice: Resources) -> Resources:
        """This resources' shared fields with `choice`'s fields on top (SkyPilot's
        any_of/ordered merge). Only fields the choice sets to something other than
        the default count, so a re-validated dump merges the same way. A choice
        that names a location replaces the whole shared location, so `infra` and
        `cloud` never end up mixed."""
        update = {
            k: getattr(choice, k)
            for k in choice.model_fields_set - {"any_of", "ordered", "ignored"}
            if getattr(choice, k) != Resources.model_fields[k].get_default(call_default_factory=True)
        }
        if any(k in update for k in _WHERE_FIELDS):
            update.update({k: update.get(k) for k in _WHERE_FIELDS})
        update["ignored"] = {**self.ignored, **choice.ignored}
        return self.model_copy(update=update)


class GitWorkdir(_Model):
    """`workdir: {url, ref}`: a repository cloned on the controller and synced as the workdir."""

    url: str
    ref: str | None = None

    @field_validator("url", mode="before")
    @classmethod
    def _check_url(cls, value: Any) -> str:
        if not isinstance(value, str) or not _GIT_URL_RE.fullmatch(value.strip()):
            raise _bad(f"{_show(value)} is not a git URL (https://..., ssh://..., git@host:path or file://...)")
        return value.strip()

    @field_validator("ref", mode="before")
    @classmethod
    def _check_ref(cls, value: Any) -> str | None:
        if value is None:
            return None
        text = _scalar_text(value) if isinstance(value, (str, int)) else None
        if not text or not _GIT_REF_RE.fullmatch(text):
            raise _bad(f"{_show(value)} is not a branch, tag or commit")
        return text


class Task(_Model):
    """One task YAML: what to provision (`resources`, `num_nodes`) and what to run."""

    IGNORED_FIELDS: ClassVar[frozenset[str]] = frozenset({
        "service", "pool", "event_callback", "inputs", "outputs", "file_mounts_mapping", "volume_mounts",
        "api_server_access", "_metadata", "experimental",
    })
    UNSUPPORTED_FIELDS: ClassVar[dict[str, str]] = {
        "volumes": "volumes are not supported by gpuctl; use file_mounts (a local path or an s3:// bucket)",
        "managed_secrets": _MANAGED_SECRETS,
    }

    # Order matters: envs and secrets are validated before the paths that expand them.
    name: str | None = None
    envs: dict[str, str] = Field(default_factory=dict)
    secrets: dict[str, str] = Field(default_factory=dict, repr=False)
    workdir: _LocalPath | None = None  # absolute
    workdir_git: GitWorkdir | None = None  # `workdir: {url, ref}` (in YAML it is workdir too)
    num_nodes: int = 1
    resources: Resources = Field(default_factory=Resources)
    file_mounts: dict[str, _LocalPath] = Field(default_factory=dict)  # remote dest -> absolute local source
    # file_mounts whose source is a cloud bucket, by destination (in YAML they are file_mounts too)
    bucket_mounts: dict[str, BucketMount] = Field(default_factory=dict)
    setup: str | None = None
    run: str | None = None
    config: dict[str, Any] | None = None
    ignored: dict[str, Any] = Field(default_factory=dict)
    _choice_note: str | None = PrivateAttr(default=None)
    _warnings: list[str] = PrivateAttr(default_factory=list)
    _where: Callable[..., str] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data: Any, info: ValidationInfo) -> Any:
        data = cls._set_aside(data, info)
        if isinstance(data, dict) and "workdir_git" in data and (info.context or {}).get("from_yaml"):
            raise _bad("unknown field", "workdir_git")
        if isinstance(data, dict) and isinstance(data.get("workdir"), dict):
            data = {**data, "workdir_git": data["workdir"], "workdir": None}
        if isinstance(data, dict) and isinstance(data.get("file_mounts"), dict):
            if "bucket_mounts" in data and (info.context or {}).get("from_yaml"):
                raise _bad("unknown field", "bucket_mounts")
            local, buckets = {}, dict(data.get("bucket_mounts") or {})
            for dest, src in data["file_mounts"].items():
                if isinstance(src, dict) or (isinstance(src, str) and "://" in src):
                    buckets[dest] = src
                else:
                    local[dest] = src
            data = {**data, "file_mounts": local, "bucket_mounts": buckets}
        return data

    @field_validator("envs", mode="before")
    @classmethod
    def _check_envs(cls, value: Any) -> dict[str, str]:
        return _variables(value, secret=False)

    @field_validator("secrets", mode="before")
    @classmethod
    def _check_secrets(cls, value: Any) -> dict[str, str]:
        return _variables(value, secret=True)

    @staticmethod
    def _substitutions(info: ValidationInfo) -> dict[str, str]:
        return {**info.data.get("envs", {}), **info.data.get("secrets", {})}

    @field_validator("workdir", mode="before")
    @classmethod
    def _check_workdir(cls, value: Any, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        if not isinstance(value, (str, Path)):
            raise _bad(f"expected a directory path, got {_kind(value)}")
        text = _expand(str(value), cls._substitutions(info))
        path = _local_path(text, info, Path.is_dir, f"must be a valid directory; '{text}' is not one here")
        return str(path)  # a str, which the field turns into a Path in both Python and JSON mode

    @field_validator("num_nodes", mode="before")
    @classmethod
    def _check_num_nodes(cls, value: Any) -> int:
        if value is None:
            return 1
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad(f"must be a positive int, got {_show(value)}"
                       + (" (a string; remove the quotes)" if isinstance(value, str) else ""))
        return value

    @field_validator("resources", mode="before")
    @classmethod
    def _check_resources(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("file_mounts", mode="before")
    @classmethod
    def _check_file_mounts(cls, value: Any, info: ValidationInfo) -> dict[str, str]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise _bad(f"expected a mapping of /remote/path: local/path, got {_kind(value)}")
        variables = cls._substitutions(info)
        out: dict[str, str] = {}
        for dest, src in value.items():
            key = str(dest)
            if isinstance(src, dict):
                raise _bad("cloud storage mounts (name/source/store/mode) are not supported yet; "
                           "use a local path, or fetch the data in setup", key)
            if not isinstance(src, (str, Path)):
                raise _bad(f"expected a local path, got {_kind(src)}", key)
            source = _expand(str(src), variables)
            if "://" in source:
                scheme = source.split("://", 1)[0]
                raise _bad(f"{scheme}:// sources are not supported yet; "
                           "use a local path, or fetch the data in setup", key)
            remote, placed = _placed(_expand(key, variables), bucket=False)  # relative: in the workdir
            problem = destination_problem(remote)
            if problem:
                raise _bad(problem, key)
            path = _local_path(source, info, Path.exists, f"File mount source '{source}' does not exist locally", key)
            out[placed] = str(path)
        return out

    @field_validator("bucket_mounts", mode="before")
    @classmethod
    def _check_bucket_mounts(cls, value: Any, info: ValidationInfo) -> dict[str, BucketMount]:
        variables = cls._substitutions(info)
        out: dict[str, BucketMount] = {}
        for dest, src in (value or {}).items():
            if isinstance(src, BucketMount):  # a dumped task validated again
                out[str(dest)] = src
                continue
            remote, placed = _placed(_expand(str(dest), variables), bucket=True)  # relative: in the home
            mount = _bucket_mount(placed, src, variables, str(dest), (info.context or {}).get("unset", ()),
                                  lambda source, at=str(dest): _upload_dir(source, info, at))
            problem = destination_problem(remote, mount.mode)
            if problem:
                raise _bad(problem, dest)
            out[placed] = mount
        return out

    @field_validator("setup", "run", mode="before")
    @classmethod
    def _check_script(cls, value: Any, info: ValidationInfo) -> str | None:
        if value is None or isinstance(value, str):
            return value
        raise _bad(f"expected a shell script as a string, got {_kind(value)}; "
                   f"write '{info.field_name}: |' and the commands on the lines below")

    @model_validator(mode="after")
    def _choose_resources(self, info: ValidationInfo) -> Task:
        """Of any_of/ordered alternatives, the first gpuctl can provision (SkyPilot would
        shop across clouds; gpuctl takes the first that it supports and can resolve, as the
        validation context's `resources_check` -- the providers' -- says)."""
        check = (info.context or {}).get("resources_check")
        group = "any_of" if self.resources.any_of else "ordered" if self.resources.ordered else None
        if group is None:
            if problem := self.resources.provision_problem(check):
                raise _bad(problem[1], "resources", problem[0])
            return self
        skipped: list[str] = []
        choices = getattr(self.resources, group)
        for index, choice in enumerate(choices):
            merged = self.resources.with_choice(choice)
            problem = merged.provision_problem(check)
            if problem is None:
                self.resources = merged
                if len(choices) > 1:
                    self._choice_note = (f"resources.{group}: using alternative {index + 1} of {len(choices)} "
                                         f"({merged.describe()})" + (f"; skipped {'; '.join(skipped)}" if skipped
                                                                     else ""))
                return self
            skipped.append(f"{index + 1} ({problem[1].replace('; ' + WHAT_IS_SUPPORTED, '')})")
        raise _bad(f"none of the {len(choices)} alternatives can be provisioned by gpuctl: {'; '.join(skipped)}; "
                   f"{WHAT_IS_SUPPORTED}", "resources", group)

    def __eq__(self, other: object) -> bool:
        """What the task says; where it was read from (warnings, lines) is no part of it."""
        return isinstance(other, Task) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]

    @property
    def container_image(self) -> str | None:
        """IMAGE for `image_id: docker:IMAGE` (setup and run go inside it), else None."""
        image = self.resources.image_id
        return image.removeprefix(DOCKER_PREFIX) if image and image.startswith(DOCKER_PREFIX) else None

    @property
    def warnings(self) -> list[str]:
        """`FILE:LINE: FIELD: ...` for every field read and not acted on (validate and apply print them)."""
        return list(self._warnings)

    def where(self, *key: str) -> str:
        """`FILE:LINE` of a field (its nearest written parent), for messages about it."""
        return self._where(*key) if self._where else "task"

    @property
    def choice_note(self) -> str | None:
        """Which any_of/ordered alternative was taken and why others were not."""
        return self._choice_note


# ---------------------------------------------------------------------------
