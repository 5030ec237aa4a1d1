"""The value parsers behind the task models: one function per kind of value a
task YAML holds (accelerators, cpus/memory quantities, disk sizes, ports, labels,
envs/secrets, per-region images, bucket mounts, local paths).

Why a module of its own: each parser takes what YAML gave (a str, a number, a
mapping...), returns the normalised value or raises `_bad` with the message the
user reads, and knows nothing of pydantic models; models.py only wires them to
fields. `_bad`, `_kind` and `_show` are the vocabulary every spec message is
written in (a validation error that can point below its field; a value's kind
in YAML words; a short quote that never echoes a container).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationInfo
from pydantic_core import PydanticCustomError

from gpuctl.common.envargs import _ENV_NAME_RULE, ENV_NAME_RE
from gpuctl.common.errors import UserError
from gpuctl.spec.buckets import BucketMount, MODES as BUCKET_MODES
from gpuctl.spec.infra import REGION_CLOUDS, UnsupportedInfra, infra_from_legacy, parse_infra

_ACCEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ACCEL_HINT = "write NAME:COUNT such as A100:8"
_CPUS_RE = re.compile(r"^(\d+(?:\.\d+)?)\+?$")
_MEMORY_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:[kmgtp][bi]?)?[+x]?$", re.IGNORECASE)
_DISK_RE = re.compile(r"^(\d+)\s*([kmgtp][bi]?)?$", re.IGNORECASE)
_GB_PER_UNIT = {"k": 2.0**-20, "m": 2.0**-10, "g": 1.0, "t": 2.0**10, "p": 2.0**20}
_PORT_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_WHERE_FIELDS = ("infra", "cloud", "region", "zone")
_STORE_NAMES = {"gs": "gcs (gs://)", "gcs": "gcs (gs://)", "r2": "Cloudflare R2 (r2://)",
                "cos": "IBM COS (cos://)", "oci": "OCI (oci://)", "nebius": "Nebius (nebius://)",
                "cw": "CoreWeave (cw://)", "az": "Azure blob (az://)", "https": "https://", "http": "http://",
                "hf": "Hugging Face (hf://)"}
_STORAGE_KEYS = frozenset({"source", "name", "mode", "store", "persistent", "type", "config", "_bucket_sub_path",
                           "_force_delete", "_is_sky_managed"})
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# SkyPilot's aliases: `gpus` (RESOURCE_CONFIG_ALIASES) and the older `spot_recovery`.
_RESOURCE_ALIASES = {"gpus": "accelerators", "spot_recovery": "job_recovery"}
_MANAGED_SECRETS = (
    "managed secret references (secrets:NAME) need SkyPilot's API server and are not supported; "
    "write NAME: value, or NAME: null and pass --secret NAME"
)


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
                key = ("file_mounts" if info.field_name == "bucket_mounts" else info.field_name, *at)  # as written
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


def _upload_dir(text: str, info: ValidationInfo, at: str) -> Path:
    """A storage mount's local `source:`: the directory to upload, found as a file_mount source is."""
    found = next((c for c in _local_candidates(text, info) if c.exists()), None)
    if found is not None and not found.is_dir():
        raise _bad(f"source '{text}' is {found}, a file; give the directory to upload into the bucket", at)
    return _local_path(text, info, Path.is_dir, f"source '{text}' is no local directory to upload", at)


def _bucket_mount(dest: str, value: Any, variables: Mapping[str, str], at: str, unset: Iterable[str],
                  local_dir: Callable[[str], Path]) -> BucketMount:
    """One bucket file_mount: `s3://bucket/prefix` (copied) or SkyPilot's storage object
    `{source, name, mode, store, persistent}`; `name` alone is a bucket to create, `name` with a local
    `source` a bucket to create and fill with that directory (`local_dir` finds it) before the job."""
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
        raise _bad("a list of sources is not supported by gpuctl; give one local directory (with name:) or one "
                   "s3:// source, or write local paths as plain file_mounts", at)
    if not isinstance(source, str):
        raise _bad(f"source: expected s3://BUCKET/PATH, got {_kind(source)}", at)
    if _unset_in(source, unset):
        return BucketMount(dest=dest, bucket=source, mode=mode)
    source = _expand(source, variables)
    if "://" not in source:  # SkyPilot's upload: the bucket `name:` is made and filled from this directory
        if not isinstance(name, str) or not name:
            raise _bad(f"source {_show(source)} is a local directory: give name: BUCKET, the bucket gpuctl creates "
                       "and uploads it to (or write it as a plain file_mount)", at)
        _check_bucket_name(name, at)
        return BucketMount(dest=dest, bucket=name, mode=mode, create=True, upload=str(local_dir(source)))
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
