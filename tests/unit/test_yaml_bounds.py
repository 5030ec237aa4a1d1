"""Every YAML file gpuctl reads from a user is read with bounded work: alias
bombs, deep nesting and values YAML's constructors reject are one line (exit 2),
never a traceback or an exhausted machine.

Each loader runs in a child process with a 1 GiB address-space limit and a
timeout, so a regression fails the test (MemoryError, a traceback) instead of
taking the machine down or hanging CI.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuctl.common.yamlfile import MAX_ALIAS_NODES
from gpuctl.spec import _compose, _line_of


def _laughs(levels: int, width: int, shape: str) -> str:
    """A "billion laughs" document: each anchor uses the one before `width` times."""
    lines = ["a0: &a0 {lol: lol}" if shape == "merge" else "a0: &a0 [lol]"]
    for i in range(1, levels):
        uses = ", ".join([f"*a{i - 1}"] * width)
        if shape == "list":
            lines.append(f"a{i}: &a{i} [{uses}]")
        elif shape == "mapping":
            lines.append(f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(width)) + "}")
        elif shape == "merge":  # merge keys copy the anchor's pairs, repeats and all
            lines.append(f"a{i}: &a{i} {{<<: [{uses}], k{i}: v}}")
    return "\n".join(lines) + "\n"


def _key_bomb() -> str:
    return _laughs(9, 9, "list") + "b: {? *a8 : 1}\n"


def _anchor_chain(length: int) -> str:
    """Each anchor nests the one before: shallow as written, `length` deep when expanded."""
    return "a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, length))


def _long_string_aliased(nested: bool) -> str:
    """Few nodes, much text: a 200 KiB string aliased 100 times (flat, or 10 x 10 through anchors)."""
    head = "s: &s " + "x" * (200 << 10) + "\n"
    if nested:
        return head + "t: &t [" + ", ".join(["*s"] * 10) + "]\nenvs: [" + ", ".join(["*t"] * 10) + "]\n"
    return head + "envs: [" + ", ".join(["*s"] * 100) + "]\n"


CASES = {
    # name: (document, fragment of the one line)
    "laughs-list": (_laughs(9, 9, "list"), "aliases expand to more than"),
    "laughs-list-wide": (_laughs(4, 200, "list"), "aliases expand to more than"),
    "laughs-mapping": (_laughs(9, 9, "mapping"), "aliases expand to more than"),
    "laughs-merge-keys": (_laughs(9, 9, "merge"), "aliases expand to more than"),
    "laughs-in-key": (_key_bomb(), "aliases expand to more than"),
    "long-string-aliased": (_long_string_aliased(False), "MiB of text"),
    "long-string-aliased-nested": (_long_string_aliased(True), "MiB of text"),
    "anchor-chain": (_anchor_chain(3000), "nest deeper than"),
    "alias-to-itself": ("a: &a [x, *a]\n", "refers to itself"),
    "deep-brackets": ("[" * 100_000, "nested deeper than"),
    "deep-braces": ("{a: " * 100_000 + "x", "nested deeper than"),
    "deep-dashes": ("".join("  " * i + "-\n" for i in range(3000)) + "  " * 3000 + "x\n", "nested deeper than"),
    "deep-mixed": ("x: " + "[{a: " * 30_000 + "1", "nested deeper than"),
    "huge-int": ("name: x\nnum_nodes: " + "7" * 5000 + "\n", ".yaml:2: a value YAML cannot read"),
    "bad-date": ("name: 2024-13-45\n", ".yaml:1: a value YAML cannot read"),
}

# The script the child runs: load each case with one loader, print its outcome as JSON.
_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    from gpuctl.common.errors import UserError
    loader, folder = sys.argv[1], Path(sys.argv[2])
    def load(path):
        if loader == "task":
            from gpuctl.spec import load_task
            return load_task(path)
        if loader == "api":
            from gpuctl.api.cluster import _load_task
            return _load_task(path)
        if loader == "config":
            from gpuctl.common.config import load_config
            return load_config(path)
        from gpuctl.provision.inventory import load_inventory
        return load_inventory(path)
    out = {}
    for path in sorted(folder.glob("*.yaml")):
        try:
            load(path)
            out[path.stem] = "loaded"
        except UserError as exc:
            out[path.stem] = "UserError: " + exc.message
        except BaseException as exc:
            out[path.stem] = type(exc).__name__
    print(json.dumps(out))
""")


@pytest.fixture(scope="module", params=["task", "api", "config", "inventory"])
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each case's outcome through one of gpuctl's YAML loaders (in a bounded child)."""
    folder = tmp_path_factory.mktemp(f"yaml-{request.param}")
    for name, (text, _) in CASES.items():
        (folder / f"{name}.yaml").write_text(text)
    env = {**os.environ, "GPUCTL_STATE_DIR": str(folder / "state")}
    proc = subprocess.run([sys.executable, "-c", _CHILD, request.param, str(folder)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_yaml_is_one_line(outcomes: dict[str, str], case: str) -> None:
    _, fragment = CASES[case]
    outcome = outcomes[case]
    assert outcome.startswith("UserError: "), outcome
    assert fragment in outcome and "\n" not in outcome, outcome
    assert f"{case}.yaml" in outcome, outcome  # names the file


def test_line_map_grows_with_the_file_not_the_expansion() -> None:
    # 9**4 * 9 leaves: within the bound, so it is built, but the lines are those written
    text = "a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 5))
    data, lines, _ = _compose(text, "x.yaml")
    assert len(data["a4"]) == 9 and data["a4"][8][8][8][8] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert len(lines) <= 60, len(lines)
    assert _line_of(lines, ("a4", "8", "3", "0")) == 5  # what an alias brings in is found where it is used


def test_aliases_within_the_bound_still_load(tmp_path: Path) -> None:
    from gpuctl.spec import load_task

    width = 300  # 300 x 300 = 90,000 nodes through aliases: just under the bound
    assert width * width < MAX_ALIAS_NODES
    path = tmp_path / "task.yaml"
    path.write_text("config:\n  a0: &a0 [" + ", ".join(["x"] * width) + "]\n"
                    "  a1: [" + ", ".join(["*a0"] * width) + "]\nrun: echo hi\n")
    task = load_task(path)
    assert task.config is not None and len(task.config["a1"]) == width


def test_errors_in_aliased_values_name_the_line_that_uses_them(tmp_path: Path) -> None:
    from gpuctl.common.errors import UserError
    from gpuctl.spec import load_task

    path = tmp_path / "task.yaml"
    path.write_text("config:\n  shared: &res\n    accelerators: 'A100:x'\nname: t\nresources: *res\nrun: echo hi\n")
    with pytest.raises(UserError) as err:
        load_task(path)
    assert f"{path}:5:" in err.value.message and "resources.accelerators" in err.value.message


@pytest.mark.parametrize("command", ["validate", "apply"])
@pytest.mark.parametrize("case", ["laughs-merge-keys", "deep-brackets", "huge-int"])
def test_cli_json_error_document(tmp_path: Path, command: str, case: str) -> None:
    """`-o json` prints {ok: false, error, exit_code} on stdout, and nothing is provisioned."""
    (tmp_path / "cluster.yaml").write_text(CASES[case][0])
    state = tmp_path / "state"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    proc = subprocess.run([sys.executable, "-m", "gpuctl", command, "cluster.yaml", "-o", "json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit,
                          env={**os.environ, "GPUCTL_STATE_DIR": str(state)})
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and CASES[case][1] in doc["error"]
    assert not (state / "clusters").exists() or not any((state / "clusters").iterdir())


def test_an_alias_to_a_mapping_with_merge_keys_is_no_duplicate(tmp_path: Path) -> None:
    from gpuctl.spec import load_task

    path = tmp_path / "task.yaml"
    path.write_text("envs: &common {A: '1', B: '2'}\nsecrets: &s {<<: *common, A: '3'}\n"
                    "config: {copy: *s}\nrun: echo hi\n")
    task = load_task(path)
    assert task.secrets == {"A": "3", "B": "2"} and task.config == {"copy": {"A": "3", "B": "2"}}
