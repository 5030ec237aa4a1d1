"""cluster.yaml: SkyPilot's task YAML as a typed, validated model.

`load_task` composes the YAML with a loader that remembers every key's line,
validates it with the pydantic models below and turns the first problem into
one `UserError` line that names the file, the line and the dotted field:

    cluster.yaml:7: resources.accelerators: 'A100:x' is not a valid accelerator; write NAME:COUNT such as A100:8

Task YAMLs written for SkyPilot (0.14) load unchanged. Where gpuctl differs, or
says what it will not do:

- Relative `workdir` and `file_mounts` sources resolve as SkyPilot does, from
  the directory gpuctl runs in, and then from the YAML file's directory; when
  neither exists the error names both paths. `~` expands to your home.
- `${VAR}` / `$VAR` in `workdir` and `file_mounts` expand from `envs` and
  `secrets`, as in SkyPilot; unknown names stay as written.
- `envs`/`secrets` values written as numbers or booleans keep their text as
  written (`VERSION: 1.10` is "1.10", `DEBUG: true` is "true"); SkyPilot would
  give "1.1" and "True".
- Bucket file_mounts (`/data: s3://bucket/prefix`, copied; or the storage
  object `{source, name, mode, store}`) become `Task.bucket_mounts`; only S3 is
  supported, other stores are named as unsupported.
- `image_id: docker:IMAGE` is `Task.container_image`: setup and run go inside it.
- A git `workdir: {url, ref}` is `Task.workdir_git`, cloned on the controller
  at apply (gitworkdir.py) and synced like a local workdir.
- `resources.any_of` / `ordered`: the first alternative gpuctl can provision
  (a cloud it supports; on AWS an instance type it can resolve) is merged over
  the shared fields (`Task.choice_note` says which). Of several
  `accelerators` choices, the first AWS sells is provisioned there.
- Aliases: `resources.gpus` is `accelerators`, `spot_recovery` is `job_recovery`.
- Read and not acted on, each with a warning line in `Task.warnings`:
  `resources.ports`, `labels`, `disk_tier`, `config` (except
  `config.aws.remote_identity`), and `Task.IGNORED_FIELDS` /
  `Resources.IGNORED_FIELDS` (kept verbatim in `.ignored`: `service`,
  `resources.autostop`, `resources.job_recovery`, ...).
- Refused with a "not supported by gpuctl" line: other clouds and Kubernetes,
  non-S3 buckets, uploading local files to a bucket, managed secrets (`secrets:NAME`, `managed_secrets`), `volumes`,
  and pipelines (several YAML documents in one file).
- A key given twice in one mapping is an error (YAML would keep the last silently).

Secret values never appear in an error message or in `repr(task)`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import pydantic
import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, Strict, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from gpuctl.common.envargs import _ENV_NAME_RULE, ENV_NAME_RE, parse_env_assignments
from gpuctl.common.errors import UserError
from gpuctl.spec.buckets import MODES as BUCKET_MODES
from gpuctl.spec.buckets import BucketMount
from gpuctl.spec.nodepaths import destination_problem
from gpuctl.spec.infra import (CONFIG_ACTED_ON, REGION_CLOUDS, WHAT_IS_SUPPORTED, Infra, UnsupportedInfra,
                               infra_from_legacy, parse_infra)
from gpuctl.common.yamlfile import BoundedLoader, check_printable, compose_bounded, constructing, read_text

__all__ = ["ENV_NAME_RE", "Resources", "Task", "load_task", "parse_env_assignments"]

_ACCEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ACCEL_HINT = "write NAME:COUNT such as A100:8"
_CPUS_RE = re.compile(r"^(\d+(?:\.\d+)?)\+?$")
_MEMORY_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:[kmgtp][bi]?)?[+x]?$", re.IGNORECASE)
_DISK_RE = re.compile(r"^(\d+)\s*([kmgtp][bi]?)?$", re.IGNORECASE)
_GB_PER_UNIT = {"k": 2.0**-20, "m": 2.0**-10, "g": 1.0, "t": 2.0**10, "p": 2.0**20}
_PORT_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
# A Path that also validates from a str, so a task dumped to JSON loads back.
_LocalPath = Annotated[Path, Strict(False)]
_WHERE_FIELDS = ("infra", "cloud", "region", "zone")
# The provider's offline word on a location's resources: (cloud, resources) -> (field, why) or None.
# load_task's callers pass gpuctl.providers.resources_problem (spec/ never imports providers/).
ResourcesCheck = Callable[[str, "Resources"], "tuple[str, str] | None"]
# SkyPilot's aliases: `gpus` (RESOURCE_CONFIG_ALIASES) and the older `spot_recovery`.
_STORE_NAMES = {"gs": "gcs (gs://)", "gcs": "gcs (gs://)", "r2": "Cloudflare R2 (r2://)",
                "cos": "IBM COS (cos://)", "oci": "OCI (oci://)", "nebius": "Nebius (nebius://)",
                "cw": "CoreWeave (cw://)", "az": "Azure blob (az://)", "https": "https://", "http": "http://",
                "hf": "Hugging Face (hf://)"}
_STORAGE_KEYS = frozenset({"source", "name", "mode", "store", "persistent", "type", "config", "_bucket_sub_path",
                           "_force_delete", "_is_sky_managed"})
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# Read, kept, and not acted on: each gets a warning line saying so.
_KEPT_UNUSED = ("ports", "labels", "disk_tier")
_IGNORED_WHY = {
    "service": "gpuctl runs jobs, not SkyPilot services (no replicas, no load balancer)",
    "pool": "gpuctl has no worker pools; apply runs the task on one cluster",
    "ports": "gpuctl opens no ports (only SSH from your address); add security-group rules yourself",
    "labels": "gpuctl tags instances itself",
    "disk_tier": "gpuctl uses the default EBS volume type",
    "job_recovery": "gpuctl does not restart a failed or preempted job",
    "autostop": "gpuctl never stops a cluster by itself; run gpuctl down",
    "config": "SkyPilot config overrides are not read (only config.aws.remote_identity is)",
    "experimental": "SkyPilot's experimental overrides are not read",
    "accelerator_args": "gpuctl does not configure TPUs",
    "max_hourly_cost": "gpuctl does not shop by price",
    "event_callback": "gpuctl runs no callback",
    "skypilot_image": "SkyPilot's own images are not available to gpuctl; AWS nodes boot the Deep Learning AMI "
                      "(give an ami-... id to choose another)",
    "inputs": "gpuctl does not estimate data transfer",
    "outputs": "gpuctl does not estimate data transfer",
}
DOCKER_PREFIX = "docker:"
_GIT_URL_RE = re.compile(r"^(?:(?:https?|ssh|git|file)://\S+|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^\s-]\S*)$")
_GIT_REF_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/+-]*$")
SKYPILOT_IMAGE_PREFIX = "skypilot:"  # SkyPilot's own image tags (skypilot:gpu-ubuntu-2204)
_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$")  # registry/name:tag or @sha256:...
_RESOURCE_ALIASES = {"gpus": "accelerators", "spot_recovery": "job_recovery"}
_MANAGED_SECRETS = (
    "managed secret references (secrets:NAME) need SkyPilot's API server and are not supported; "
    "write NAME: value, or NAME: null and pass --secret NAME"
)
# Words people type for a field, when difflib's spelling match cannot know them.
_SYNONYMS = {"nodes": "num_nodes", "gpus": "accelerators", "gpu": "accelerators", "env": "envs",
             "environment": "envs", "command": "run", "cmd": "run", "image": "image_id", "spot": "use_spot",
             "disk": "disk_size"}


def _bad(message: str, *at: str | int) -> PydanticCustomError:
    """A validation error; `at` names the key below the field being validated
    (an env name, a mount destination) so the error line can point at it."""
    return PydanticCustomError("gpuctl", "{message}", {"message": message, "at": tuple(str(a) for a in at)})


def _kind(value: Any) -> str:
    """What a value is, in YAML words, for messages that must not echo it."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true/false"
    for types, word in ((dict, "a mapping"), (list, "a list"), (str, "a string"), (int, "a whole number"),
                        (float, "a number")):
        if isinstance(value, types):
            return word
    return type(value).__name__


def _show(value: Any) -> str:
    """A short quote of a scalar, or its kind for containers."""
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, (dict, list)) or value is None:
        return _kind(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _number_text(value: int | float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _expand(text: str, variables: Mapping[str, str]) -> str:
    """SkyPilot's `${VAR}`/`$VAR` substitution in paths; unknown names stay as written."""
    return _VAR_RE.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def _local_candidates(text: str, info: ValidationInfo) -> list[Path]:
    """Where a local path may be: `~` expanded; a relative one first against the
    directory gpuctl runs in (SkyPilot's rule), then against the YAML file's."""
    path = Path(text).expanduser()
    if path.is_absolute():
        return [Path(os.path.normpath(path))]
    context = info.context or {}
    bases = [Path(context.get("cwd") or Path.cwd()), Path(context.get("base_dir") or Path.cwd())]
    out: list[Path] = []
    for base in bases:
        candidate = Path(os.path.normpath(base.absolute() / path))
        if candidate not in out:
            out.append(candidate)
    return out


def _local_path(text: str, info: ValidationInfo, exists: Callable[[Path], bool], what: str, *at: str) -> Path:
    """The first candidate that `exists`; else an error naming every path tried."""
    candidates = _local_candidates(text, info)
    for candidate in candidates:
        if exists(candidate):
            notes = (info.context or {}).get("notes")
            if notes is not None and len(candidates) > 1 and candidate == candidates[0] and exists(candidates[1]):
                key = (info.field_name, *at)
                notes.append((key, f"'{text}' is {candidate}, from the current directory as in SkyPilot, not "
                              f"{candidates[1]}; run gpuctl in {info.context.get('base_dir')} for the latter"))
            return candidate
    tried = " nor ".join(str(c) for c in candidates)
    raise _bad(f"{what}: neither {tried} exists" if len(candidates) > 1 else f"{what}: {tried} does not exist",
               *at)


def _infra_problem(value: str, field: str, *, unsupported_too: bool = False) -> str | None:
    """parse_infra's complaint about `value`, without its leading field name. A cloud
    gpuctl does not support is no complaint here unless `unsupported_too`: an
    any_of/ordered alternative naming one is skipped, so the task decides."""
    try:
        parse_infra(value, field=field)
    except UnsupportedInfra as err:
        return err.message.removeprefix(f"{field} ") if unsupported_too else None
    except UserError as err:
        return err.message.removeprefix(f"{field} ")
    return None


# ---------------------------------------------------------------------------
# Field parsers (raise `_bad`, return the normalised value)


def _accelerator_options(value: Any) -> list[tuple[str, Any, str]]:
    """(name, count, as written) for each option SkyPilot accepts: "A100:8",
    "{A100:8, H100:8}", {A100: 8}, {A100:8: null} and ["A100:8", "H100:8"]."""

    def split(text: str) -> tuple[str, Any, str]:
        name, sep, count = text.strip().partition(":")
        return name.strip(), (count.strip() if sep else 1), text.strip()

    if isinstance(value, str):
        text = value.strip()
        if text[:1] in ("{", "[") and text[-1:] in ("}", "]"):
            return [split(item) for item in text[1:-1].split(",")]
        return [split(text)]
    if isinstance(value, list):
        if not all(isinstance(item, str) for item in value):
            raise _bad(f"each choice must be a string; {_ACCEL_HINT}")
        return [split(item) for item in value]
    if isinstance(value, dict):
        return [split(str(k)) if v is None else (str(k), v, f"{k}: {_show(v)}") for k, v in value.items()]
    raise _bad(f"expected NAME:COUNT or a mapping, got {_kind(value)}; {_ACCEL_HINT}")


def _accelerator_count(count: Any, written: str) -> float:
    """Counts are positive; fractions only below 1 (a share of one GPU), as in SkyPilot."""
    if isinstance(count, str):
        try:
            count = float(count)
        except ValueError:
            raise _bad(f"'{written}' is not a valid accelerator; {_ACCEL_HINT}") from None
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        raise _bad(f"'{written}' is not a valid accelerator; {_ACCEL_HINT}")
    if not math.isfinite(count) or count <= 0:
        raise _bad(f"'{written}': accelerator count must be a positive number")
    if count > 1 and not float(count).is_integer():
        raise _bad(f"'{written}': a fractional accelerator count must be below 1 (such as 0.5); "
                   "above 1 write a whole number")
    return float(count)


def _accelerators(value: Any) -> dict[str, float] | None:
    if value is None:
        return None
    out: dict[str, float] = {}
    for name, count, written in _accelerator_options(value):
        if not _ACCEL_NAME_RE.fullmatch(name) or (isinstance(count, str) and ":" in count):
            raise _bad(f"'{written}' is not a valid accelerator; {_ACCEL_HINT}")
        out[name] = _accelerator_count(count, written)
    if not out:
        raise _bad(f"no accelerator given; {_ACCEL_HINT}")
    return out


def _quantity(value: Any, pattern: re.Pattern[str], example: str) -> str | None:
    """`cpus`/`memory`: a positive number, or a string such as "8" or "8+" (at least 8)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = _number_text(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise _bad(f"expected a number or N+ such as {example}, got {_kind(value)}")
    match = pattern.fullmatch(text)
    if not match or float(match.group(1)) <= 0:
        raise _bad(f"{_show(value)} is not a positive number or N+ such as {example}")
    return text


def _disk_size(value: Any) -> int | None:
    """GB as an int; SkyPilot also takes "256GB", "1TB"."""
    if value is None:
        return None
    gigabytes: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        gigabytes = float(value)
    elif isinstance(value, str) and (match := _DISK_RE.fullmatch(value.strip())):
        unit = (match.group(2) or "g")[0].lower()
        gigabytes = int(match.group(1)) * _GB_PER_UNIT[unit]
    if gigabytes is None or gigabytes < 1 or not gigabytes.is_integer():
        raise _bad(f"{_show(value)} is not a positive whole number of GB; write a size such as 256")
    return int(gigabytes)


def _network_tier(value: Any) -> str | None:
    if value is None:
        return None
    tier = value.strip().lower() if isinstance(value, str) else None
    if tier not in ("standard", "best"):
        raise _bad(f"{_show(value)} is not a network tier; use standard or best")
    return tier


def _ports(value: Any) -> list[str] | None:
    """8080, "8080", "10020-10040" or a list of those."""
    if value is None:
        return None
    many = isinstance(value, list)
    out: list[str] = []
    for index, item in enumerate(value if many else [value]):
        at = (index,) if many else ()
        text = str(item).strip() if isinstance(item, (int, str)) and not isinstance(item, bool) else ""
        match = _PORT_RE.fullmatch(text)
        low, high = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
        if not (1 <= low <= high <= 65535):
            raise _bad(f"{_show(item)} is not a port or range such as 8080 or 10020-10040", *at)
        out.append(text)
    return out


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _labels(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(f"expected a mapping of label: value, got {_kind(value)}")
    out: dict[str, str] = {}
    for key, item in value.items():
        if item is None or isinstance(item, (dict, list)):
            raise _bad(f"a label value must be a string, got {_kind(item)}", key)
        out[str(key)] = _scalar_text(item)
    return out


def _variables(value: Any, *, secret: bool) -> dict[str, str]:
    """`envs` / `secrets`: valid names, string values. A secret's value is never quoted."""
    section, flag = ("secrets", "--secret") if secret else ("envs", "--env")
    if value is None:
        return {}
    if secret and isinstance(value, list):
        raise _bad(_MANAGED_SECRETS)
    if not isinstance(value, dict):
        raise _bad(f"expected a mapping of NAME: value, got {_kind(value)}")
    out: dict[str, str] = {}
    for key, item in value.items():
        name = str(key)
        if secret and name.startswith("secrets:"):
            raise _bad(_MANAGED_SECRETS, name)
        if not ENV_NAME_RE.fullmatch(name):
            raise _bad(f"'{name}' is not a valid variable name; {_ENV_NAME_RULE}", name)
        if item is None:
            raise _bad(f"no value; set one in {section} or pass {flag} {name}=VALUE ('' for empty)", name)
        if isinstance(item, (dict, list)):
            raise _bad(f"expected a string, got {_kind(item)}; quote the value", name)
        out[name] = _scalar_text(item)
    return out


def _region_of(data: Mapping[str, Any]) -> str | None:
    """The region a raw resources mapping names, if it parses (errors are reported elsewhere)."""
    try:
        if isinstance(data.get("infra"), str):
            return parse_infra(data["infra"]).region
        if isinstance(data.get("cloud"), str):
            return infra_from_legacy(data["cloud"], data.get("region"), data.get("zone")).region
    except (UserError, TypeError):
        pass
    return None


def _region_from_images(data: dict[str, Any]) -> dict[str, Any]:
    """A per-region image_id where no region is named: AWS takes the first region with an
    image (SkyPilot would pick among them); local nodes take its first image (ignored there)."""
    if _region_of(data) is not None:
        return data
    first = str(next(iter(data["image_id"])))
    infra, cloud = data.get("infra"), data.get("cloud")
    if isinstance(infra, str):
        name, _, rest = infra.strip().lower().partition("/")
        if name in REGION_CLOUDS and rest in ("", "*"):
            return {**data, "infra": f"{name}/{first}"}
    if isinstance(cloud, str) and cloud.strip().lower() in REGION_CLOUDS and not data.get("zone"):
        return {**data, "region": first}
    if infra is None and cloud is None:
        return {**data, "image_id": next(iter(data["image_id"].values()))}
    return data


def _image_for_region(images: dict[Any, Any], region: str | None) -> Any:
    """SkyPilot's per-region `image_id: {us-east-1: ami-...}` -> the one image for our region."""
    choices = ", ".join(str(k) for k in images)
    if region is None:
        raise _bad(f"a per-region image_id needs a region; set infra: aws/REGION with one of {choices}",
                   "image_id")
    if region not in images:
        raise _bad(f"no image for region {region} (images are given for {choices})", "image_id")
    return images[region]


def _bucket_url(url: str, at: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, prefix); other stores are named as unsupported."""
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme != "s3":
        store = _STORE_NAMES.get(scheme, f"{scheme}://")
        raise _bad(f"{store} sources are not supported by gpuctl; use an s3:// bucket or a local path", at)
    bucket, _, prefix = rest.partition("/")
    _check_bucket_name(bucket, at)
    return bucket, prefix.strip("/")


def _check_bucket_name(bucket: str, at: str) -> None:
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise _bad(f"{_show(bucket)} is not an S3 bucket name (3-63 lowercase letters, digits, '.' and '-')", at)


def _unset_in(text: Any, unset: Iterable[str]) -> bool:
    """Whether `text` names a variable that has no value yet (validate only)."""
    return isinstance(text, str) and any((m.group(1) or m.group(2)) in unset for m in _VAR_RE.finditer(text))


def _bucket_mount(dest: str, value: Any, variables: Mapping[str, str], at: str,
                  unset: Iterable[str] = ()) -> BucketMount:
    """One bucket file_mount: `s3://bucket/prefix` (copied) or SkyPilot's storage object
    `{source, name, mode, store, persistent}`; `name` alone is a bucket to create."""
    if isinstance(value, str):
        if _unset_in(value, unset):
            return BucketMount(dest=dest, bucket=value, mode="COPY")
        bucket, prefix = _bucket_url(_expand(value, variables), at)
        return BucketMount(dest=dest, bucket=bucket, prefix=prefix, mode="COPY")
    unknown = sorted(set(map(str, value)) - _STORAGE_KEYS)
    if unknown:
        raise _bad(f"unknown storage field '{unknown[0]}'; use source, name, mode, store or persistent", at)
    store_value = _expand(str(value.get("store") or "s3"), variables)
    if store_value.lower() != "s3":
        raise _bad(f"store: {store_value} is not supported by gpuctl; use store: s3 (or leave it out)", at)
    mode_value = _expand(str(value.get("mode") or "MOUNT"), variables)
    mode = mode_value.upper()
    if mode not in BUCKET_MODES:
        raise _bad(f"mode {_show(mode_value)} is not a storage mode; use {', '.join(BUCKET_MODES)}", at)
    source, name = value.get("source"), value.get("name")
    if source is None and _unset_in(name, unset):  # validate: a name from a variable still to be given
        return BucketMount(dest=dest, bucket=name, mode=mode, create=True)
    if isinstance(name, str):
        name = _expand(name, variables)
    if source is None:
        if not isinstance(name, str) or not name:
            raise _bad("a storage mount needs source: s3://BUCKET/PATH or name: BUCKET (a bucket to create); "
                       "fill in the bucket name", at)
        _check_bucket_name(name, at)
        return BucketMount(dest=dest, bucket=name, mode=mode, create=True)
    if isinstance(source, list):
        raise _bad("a list of sources uploads local files to a bucket, which gpuctl does not support; "
                   "use one s3:// source, or local paths as plain file_mounts", at)
    if not isinstance(source, str):
        raise _bad(f"source: expected s3://BUCKET/PATH, got {_kind(source)}", at)
    if _unset_in(source, unset):
        return BucketMount(dest=dest, bucket=source, mode=mode)
    source = _expand(source, variables)
    if "://" not in source:
        raise _bad(f"source {_show(source)} with a bucket name: uploading a local path to a bucket is not supported "
                   "by gpuctl; write the local path as a plain file_mount, or give an s3:// source", at)
    bucket, prefix = _bucket_url(source, at)
    if name and name != bucket:
        raise _bad(f"name '{name}' and source's bucket '{bucket}' differ; give one of them", at)
    return BucketMount(dest=dest, bucket=bucket, prefix=prefix, mode=mode)


def _aliased(data: Any, aliases: Mapping[str, str]) -> Any:
    """SkyPilot's other spellings of a field, under the field's own name."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for alias, name in aliases.items():
        if alias in out:
            if name in out:
                raise _bad(f"give either {alias} or {name} ({alias} is another name for it), not both", alias)
            out[name] = out.pop(alias)
    return out


# ---------------------------------------------------------------------------
# Models


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
        "accelerator_args", "job_recovery", "autostop", "local_disk", "max_hourly_cost", "priority",
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
            remote = _expand(key, variables)
            if not remote.startswith(("/", "~")):
                raise _bad(f"File mount destination must be an absolute path (start with \"/\" or \"~\"), "
                           f"not '{remote}'", key)
            problem = destination_problem(remote)
            if problem:
                raise _bad(problem, key)
            path = _local_path(source, info, Path.exists, f"File mount source '{source}' does not exist locally", key)
            out[remote] = str(path)
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
            remote = _expand(str(dest), variables)
            if not remote.startswith(("/", "~")):
                raise _bad(f"File mount destination must be an absolute path (start with \"/\" or \"~\"), "
                           f"not '{remote}'", dest)
            mount = _bucket_mount(remote, src, variables, str(dest), (info.context or {}).get("unset", ()))
            problem = destination_problem(remote, mount.mode)
            if problem:
                raise _bad(problem, dest)
            out[remote] = mount
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
# YAML with line numbers

_Path = tuple[str, ...]


def _compose(text: str, source: str) -> tuple[Any, dict[_Path, int], dict[_Path, str]]:
    """Parse `text`; return the data, the line of every key/item as written (by dotted
    path), and the written text of every plain non-string scalar (for envs values).

    The document is composed within yamlfile's bounds (depth, alias expansion), so
    building it recurses at most MAX_DEPTH deep. What an alias or merge key brings
    in gets no lines of its own (it is found at the line of the field that uses
    it), so the line map grows with the file, not with the expansion.
    """
    check_printable(text, source)
    loader = BoundedLoader(text, source)
    lines: dict[_Path, int] = {(): 1}
    texts: dict[_Path, str] = {}
    built: set[int] = set()  # nodes already built once: a second visit is through an alias

    def line(node: yaml.Node) -> int:
        return node.start_mark.line + 1

    def key_of(node: yaml.Node) -> Any:
        key = loader.construct_object(node, deep=True)
        if isinstance(key, (dict, list, set)):
            raise UserError(f"{source}:{line(node)}: a key must be a plain name, not {_kind(key)}")
        return key

    def build(node: yaml.Node, path: _Path, written: bool) -> Any:
        first = id(node) not in built
        built.add(id(node))
        written = written and first
        if isinstance(node, yaml.ScalarNode):
            value = loader.construct_object(node, deep=True)
            if node.style is None and value is not None and not isinstance(value, str):
                texts[path] = node.value
            return value
        if isinstance(node, yaml.SequenceNode):
            items = []
            for index, item in enumerate(node.value):
                if written and id(item) not in built:  # an alias item's mark is its anchor's line
                    lines[path + (str(index),)] = line(item)
                items.append(build(item, path + (str(index),), written))
            return items
        first_seen: dict[str, int] = {}
        # Once: an alias to this mapping finds it flattened, its merged keys beside its own.
        for key_node, _ in node.value if first else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` keys may be overridden; only repeats of written keys are errors
            name = str(key_of(key_node))
            if name in first_seen:
                raise UserError(f"{source}:{line(key_node)}: {'.'.join(path + (name,))}: duplicate key "
                                f"(first on line {first_seen[name]}); give each field once")
            first_seen[name] = line(key_node)
        loader.flatten_mapping(node)
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = key_of(key_node)
            if written and str(key) in first_seen:  # merged-in keys are the anchor's, not written here
                lines[path + (str(key),)] = line(key_node)
            mapping[key] = build(value_node, path + (str(key),), written)
        return mapping

    try:
        with constructing(loader):
            root = compose_bounded(loader)
            if root is None:
                return None, lines, texts
            lines[()] = line(root)
            return build(root, (), True), lines, texts
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        if isinstance(err, yaml.composer.ComposerError) and "single document" in str(err.context):
            raise UserError(f"{where}: more than one YAML document (---), as in a SkyPilot pipeline; pipelines are "
                            "not supported by gpuctl; split the file into one task per file") from None
        hint = "; indent with spaces, not tabs" if "\\t" in str(err.problem) else ""
        raise UserError(f"{where}: YAML syntax error: {err.problem or err.context}{hint}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{source}: YAML error: {err}") from None
    finally:
        loader.dispose()


# ---------------------------------------------------------------------------
# Errors -> one line


def _public_fields(model: type[_Model]) -> list[str]:
    names = [*model.model_fields, *model.IGNORED_FIELDS, *model.UNSUPPORTED_FIELDS]
    return [n for n in names if n != "ignored" and not n.startswith("_")]


def _suggestion(key: str, in_resources: bool) -> str | None:
    """The field the user probably meant, at this level or at the other one."""
    task_fields, resource_fields = _public_fields(Task), _public_fields(Resources)
    levels = [(resource_fields, "'{}'"), (task_fields, "the top-level '{}'")] if in_resources else \
             [(task_fields, "'{}'"), (resource_fields, "'resources.{}'")]
    wanted = _SYNONYMS.get(key.lower(), key)
    for fields, label in levels:
        if wanted in fields:
            return label.format(wanted)
    for fields, label in levels:
        close = difflib.get_close_matches(key.lower(), fields, n=1, cutoff=0.6)
        if close:
            return label.format(close[0])
    return None


def _message(error: Mapping[str, Any], loc: _Path) -> str:
    kind = error["type"]
    if kind == "gpuctl":
        return error["ctx"]["message"]
    if kind == "extra_forbidden":
        guess = _suggestion(loc[-1], in_resources=len(loc) > 1)
        return f"unknown field; did you mean {guess}?" if guess else "unknown field"
    expected = {"string_type": "expected a string", "bool_type": "expected true or false",
                "int_type": "expected a whole number", "float_type": "expected a number",
                "dict_type": "expected a mapping (key: value)", "model_type": "expected a mapping (key: value)",
                "list_type": "expected a list"}.get(kind)
    if expected is None:
        return str(error["msg"])
    shown = _kind(error["input"]) if loc[:1] == ("secrets",) else _show(error["input"])
    return f"{expected}, got {shown}"


def _one_line(err: pydantic.ValidationError, source: str, lines: Mapping[_Path, int]) -> str:
    """The first problem in file order, as `FILE:LINE: FIELD: MESSAGE`."""
    problems = []
    for error in err.errors(include_url=False):
        loc = tuple(str(p) for p in error["loc"]) + tuple((error.get("ctx") or {}).get("at", ()))
        if loc[:1] == ("bucket_mounts",):  # written under file_mounts
            loc = ("file_mounts",) + loc[1:]
        if loc[:1] == ("workdir_git",):  # written as workdir
            loc = ("workdir",) + loc[1:]
        loc = _as_written(lines, loc)
        line = next(lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines)
        problems.append((line, loc, _message(error, loc)))
    problems.sort(key=lambda p: p[0])
    line, loc, message = problems[0]
    more = len(problems) - 1
    tail = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    field = f"{'.'.join(loc)}: " if loc else ""
    return f"{source}:{line}: {field}{message}{tail}"


def _redact(message: str, secret_values: Iterable[str]) -> str:
    """Belt and braces: no secret value leaves in a message, even through a path that expanded it."""
    for value in sorted(secret_values, key=len, reverse=True):
        if len(value) >= 4:
            message = message.replace(value, "***")
    return message


# ---------------------------------------------------------------------------
# Public entry points


def _override_infra(data: dict[str, Any], infra: str) -> None:
    """`--infra`: one location for the task; the file's infra/cloud/region/zone go, alternatives' too."""
    parse_infra(infra, field="--infra")  # its own error names the flag, not the file
    resources = data.get("resources")
    if not isinstance(resources, dict):
        resources = {} if resources is None else resources
    if isinstance(resources, dict):
        resources = {k: v for k, v in resources.items() if k not in _WHERE_FIELDS}
        for group in ("any_of", "ordered"):
            if isinstance(resources.get(group), list):
                resources[group] = [{k: v for k, v in alt.items() if k not in _WHERE_FIELDS}
                                    if isinstance(alt, dict) else alt for alt in resources[group]]
        data["resources"] = {"infra": infra, **resources}


def _merge_overrides(data: dict[str, Any], section: str, overrides: Mapping[str, str] | None, flag: str) -> None:
    """`--env`/`--secret` values replace or extend the file's, validated like them."""
    if not overrides:
        return
    for name in overrides:
        if not ENV_NAME_RE.fullmatch(name):
            raise UserError(f"{flag} {name}: not a valid variable name; {_ENV_NAME_RULE}")
    current = data.get(section)
    if current is None or isinstance(current, dict):
        data[section] = {**(current or {}), **{k: str(v) for k, v in overrides.items()}}


def load_task(
    path: str | Path,
    *,
    env_overrides: Mapping[str, str] | None = None,
    secret_overrides: Mapping[str, str] | None = None,
    require_values: bool = True,
    infra_override: str | None = None,
    resources_check: ResourcesCheck | None = None,
) -> Task:
    """Read and validate a SkyPilot-format task YAML.

    Relative `workdir` and `file_mounts` sources resolve against the YAML
    file's directory (not the current one). `env_overrides` (from `--env K=V`)
    and `secret_overrides` (from `--secret K=V`) replace or extend `envs` and
    `secrets` before validation, so they fill `null` values and are checked
    the same way. Any problem raises `UserError` with one line
    `FILE:LINE: FIELD: MESSAGE` (`FILE:LINE:COLUMN: ...` for YAML syntax).
    `infra_override` (`--infra`) replaces every location in the file, the
    alternatives' too, as SkyPilot's `--infra` does.
    `resources_check(cloud, resources)`: the provider's offline word on resources
    (gpuctl.providers.resources_problem; spec/ does not import providers/), which
    refuses them and skips any_of/ordered alternatives; without it only the cloud is checked.
    With `require_values=False` (validate) an env or secret still without a
    value is no error: it is listed in `Task.warnings` as needed at apply.
    Fields read but not acted on are listed there too, one line each.
    """
    source = str(path)
    file = Path(path).expanduser()
    text = read_text(file, what="task YAML file", source=source)

    data, lines, texts = _compose(text, source)
    if data is None:
        data = {}  # an empty file is an empty task, as in SkyPilot
    if not isinstance(data, dict):
        raise UserError(f"{source}:{lines[()]}: the top level must be a mapping of task fields "
                        f"(name, resources, run, ...), not {_kind(data)}")
    for section in ("envs", "secrets"):
        if isinstance(data.get(section), dict):
            data[section] = {k: texts.get((section, str(k)), v) for k, v in data[section].items()}
    raw_secrets = data.get("secrets") if isinstance(data.get("secrets"), dict) else {}
    secret_values = [str(v) for v in [*raw_secrets.values(), *(secret_overrides or {}).values()] if v is not None]

    _merge_overrides(data, "envs", env_overrides, "--env")
    _merge_overrides(data, "secrets", secret_overrides, "--secret")
    if infra_override:
        _override_infra(data, infra_override)
    unset: list[str] = []
    if not require_values:
        for section in ("envs", "secrets"):
            if isinstance(data.get(section), dict):
                unset += [f"{section}.{k}" for k, v in data[section].items() if v is None]
                data[section] = {k: "" if v is None else v for k, v in data[section].items()}
    try:
        notes: list[tuple[tuple[str, ...], str]] = []
        task = Task.model_validate(data, context={"base_dir": file.absolute().parent, "cwd": Path.cwd(),
                                                  "from_yaml": True, "unset": {u.split(".", 1)[1] for u in unset},
                                                  "notes": notes, "resources_check": resources_check})
    except pydantic.ValidationError as err:
        raise UserError(_redact(_one_line(err, source, lines), secret_values)) from None
    task._where = lambda *key: f"{source}:{_line_of(lines, _as_written(lines, key))}"
    task._warnings = [f"{task.where(*key)}: {'.'.join(key)}: {text}" for key, text in notes]
    task._warnings += _warnings(task, unset, task._where)
    return task


def _as_written(lines: Mapping[_Path, int], key: tuple[str, ...]) -> tuple[str, ...]:
    """`key` with each part spelled as the file spells it (an alias such as gpus, spot_recovery)."""
    out: tuple[str, ...] = ()
    for part in key:
        if out + (part,) not in lines:
            aliases = [a for a, name in _RESOURCE_ALIASES.items() if name == part and out + (a,) in lines]
            part = aliases[0] if aliases else part
        out += (part,)
    return out


def _line_of(lines: Mapping[_Path, int], key: tuple[str, ...]) -> int:
    return next(lines[key[:n]] for n in range(len(key), -1, -1) if key[:n] in lines)


def _warnings(task: Task, unset: Iterable[str], where: Callable[..., str]) -> list[str]:
    """One line per field gpuctl reads and does not act on, and per value still to give."""
    out = []
    for name in unset:
        section, key = name.split(".", 1)
        flag = "--env" if section == "envs" else "--secret"
        out.append(f"{where(section, key)}: {name}: no value yet; pass {flag} {key}=VALUE at apply")
    ignored = [((k,), k) for k in task.ignored if not k.startswith("_")]
    ignored += [(("resources", k), k) for k in task.resources.ignored if not k.startswith("_")]
    ignored += [(("resources", k), k) for k in _KEPT_UNUSED if getattr(task.resources, k)]
    if (task.resources.image_id or "").startswith(SKYPILOT_IMAGE_PREFIX):
        ignored.append((("resources", "image_id"), "skypilot_image"))
    config = task.config or {}
    ignored += [(("config", str(k)), "config") for k in config if k not in CONFIG_ACTED_ON]
    for section, acted_on in CONFIG_ACTED_ON.items():  # config.<cloud>.<key>: spec/infra.py
        keys = config[section] if isinstance(config.get(section), dict) else {}
        ignored += [(("config", section, str(k)), "config") for k in keys if k not in acted_on]
    for key, field in ignored:
        out.append(f"{where(*key)}: {'.'.join(key)}: ignored; {_IGNORED_WHY.get(field, 'gpuctl does not act on it')}")
    return out


