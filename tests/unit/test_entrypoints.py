"""What `exec NAME ...` and `apply`/`launch FILE|COMMAND` take as a task file or a command: SkyPilot's
habits (`sky exec c python train.py --lr 1e-3`, `sky launch 'echo hi'`) next to gpuctl's own forms."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuctl import entrypoints
from gpuctl.common.errors import UserError
from gpuctl.spec.request import check_cluster_name

# exec's options: True for those that take a value
OPTIONS = {"--num-nodes": True, "--env": True, "--secret": True, "--workdir": True, "--output": True, "-o": True,
           "-d": False, "--detach": False, "--help": False}


@pytest.mark.parametrize("args, expected", [
    # bare words: everything from the command's first word on is the command's
    (["c", "python", "train.py", "--lr", "1e-3"], ["c", "--", "python", "train.py", "--lr", "1e-3"]),
    (["c", "-d", "--num-nodes", "2", "--env", "A=1", "python", "x.py", "-x"],
     ["c", "-d", "--num-nodes", "2", "--env", "A=1", "--", "python", "x.py", "-x"]),
    (["--env", "A=1", "c", "echo", "hi"], ["--env", "A=1", "c", "--", "echo", "hi"]),
    (["c", "--output=json", "hostname"], ["c", "--output=json", "--", "hostname"]),
    (["c", "mytool", "--help"], ["c", "--", "mytool", "--help"]),  # the tool's help: gpuctl's is `exec --help`
    (["c", "--env", "-d", "echo", "x"], ["c", "--env", "-d", "--", "echo", "x"]),  # -d: --env's value
    # a task file or a quoted command: gpuctl's options may follow, as before
    (["c", "task.yaml", "--env", "A=1", "-d"], ["c", "task.yaml", "--env", "A=1", "-d"]),
    (["c", "python train.py", "-d"], ["c", "python train.py", "-d"]),
    # nothing to cut
    (["c"], ["c"]), ([], []), (["c", "-d"], ["c", "-d"]),
])
def test_exec_words_after_the_commands_first_word_are_not_options(args, expected) -> None:
    assert entrypoints.exec_argv(args, OPTIONS) == expected


def test_an_existing_yaml_file_without_the_suffix_is_a_task_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "task").write_text("run: echo hi\n")
    (tmp_path / "script").write_text("echo hi\n")
    assert entrypoints.exec_argv(["c", "task", "-d"], OPTIONS) == ["c", "task", "-d"]
    assert entrypoints.exec_argv(["c", "script", "-x"], OPTIONS) == ["c", "--", "script", "-x"]
    assert entrypoints.exec_argv(["task", "-d"], OPTIONS, at=1) == ["task", "-d"]  # apply's FILE: options follow
    (tmp_path / "proj").mkdir()
    assert entrypoints.exec_argv(["proj", "-d"], OPTIONS, at=1) == ["proj", "-d"]  # refused later: a directory


@pytest.mark.parametrize("args, at, word", [
    (["c", "python", "train.py", "-d"], 2, "'-d'"),
    (["c", "python", "train.py", "--env=X=1"], 2, "'--env=X=1'"),
    (["echo", "hi", "--num-nodes", "2"], 1, "'--num-nodes'"),
])
def test_one_of_gpuctls_options_among_the_commands_words_is_refused(args, at, word) -> None:
    """It could be meant for either (`sky exec` takes it as its own, silently): one line says how."""
    with pytest.raises(UserError) as err:
        entrypoints.exec_argv(args, OPTIONS, at=at)
    assert err.value.message.startswith(f"{word} after the command's first word")
    assert "put gpuctl's options before the command, or quote the whole command" in err.value.message


@pytest.mark.parametrize("words, after, expected", [
    (["python", "train.py", "--lr", "1e-3"], [], ("python train.py --lr 1e-3", [])),
    (["echo", "$HOME", "a b"], [], ("echo $HOME a b", [])),  # joined with spaces, as sky exec joins them
    (["torchrun", "x.py"], ["--lr", "1"], ("torchrun x.py -- --lr 1", [])),  # a -- among the words is theirs
    (["echo hi && hostname"], [], ("echo hi && hostname", [])),
    (["task.yaml"], [], ("task.yaml", [])),
    ([], ["bash", "-c", "echo $X"], (None, ["bash", "-c", "echo $X"])),  # after --: an exact argv
    ([], [], (None, [])),
])
def test_exec_entrypoint(words, after, expected) -> None:
    assert entrypoints.exec_entrypoint(words, after) == expected


@pytest.mark.parametrize("words, after, message", [
    (["task.yaml", "extra"], [], "'task.yaml' is a task file, so 'extra' after it cannot be its words"),
    (["echo hi", "there"], [], "'echo hi' is a quoted command, so 'there' after it cannot be its words"),
    (["task.yaml"], ["true"], "give either a task FILE, a command string or `-- COMMAND...`, not two of them"),
    (["echo hi"], ["true"], "give either a task FILE, a command string or `-- COMMAND...`, not two of them"),
])
def test_exec_entrypoint_refusals_are_one_line(words, after, message) -> None:
    with pytest.raises(UserError) as err:
        entrypoints.exec_entrypoint(words, after)
    assert message in err.value.message and "\n" not in err.value.message


def test_a_command_is_what_names_no_task_file_and_no_directory(tmp_path: Path) -> None:
    assert entrypoints.is_command("echo hi") and entrypoints.is_command("nvidia-smi")
    assert entrypoints.is_command("") and entrypoints.is_command("   ")  # refused as an empty command
    assert not entrypoints.is_command("cluster.yaml") and not entrypoints.is_command("missing.yml")
    assert not entrypoints.is_command(str(tmp_path))  # refused as a directory, not run
    assert entrypoints.command_note("cluster.yaml", "c") is None
    assert entrypoints.command_note("echo hi", "demo") == \
        "note: 'echo hi' is no task file: running it as a command on cluster 'demo'"


def test_a_command_task_runs_the_command_and_is_named_by_it() -> None:
    command = "python train.py --name 'my run'   && echo done"
    task = yaml.safe_load(entrypoints.command_task_text(command))
    assert task == {"name": "python train.py --name 'my run' && ec...", "run": command}
    for empty in ("", "  \n"):
        with pytest.raises(UserError, match="the command is empty"):
            entrypoints.command_task_text(empty)


def test_generated_cluster_names_are_valid_and_new(monkeypatch) -> None:
    monkeypatch.setattr(entrypoints.getpass, "getuser", lambda: "Alice.Smith_99")
    names = {entrypoints.generated_cluster_name() for _ in range(20)}
    assert len(names) > 1
    for name in names:
        assert check_cluster_name(name) == name and name.startswith("gpuctl-") and name.endswith("-alice-smith-99")
    monkeypatch.setattr(entrypoints.getpass, "getuser", lambda: "x" * 80)
    # a made-up name fits every provider (AWS prefixes its resource names with it: 32), as a task's own does
    from gpuctl.providers.aws.provider import MODULE_NAME_MAX

    assert len(check_cluster_name(entrypoints.generated_cluster_name())) <= MODULE_NAME_MAX

    def no_user() -> str:
        raise KeyError("getpwuid(): uid not found: 1234")

    monkeypatch.setattr(entrypoints.getpass, "getuser", no_user)
    assert check_cluster_name(entrypoints.generated_cluster_name()).startswith("gpuctl-")


def test_launch_takes_its_commands_words_as_one_command() -> None:
    assert entrypoints.launch_entrypoint(["cluster.yaml"]) == "cluster.yaml"
    assert entrypoints.launch_entrypoint(["echo hi"]) == "echo hi"
    assert entrypoints.launch_entrypoint(["python", "train.py", "--lr", "1e-3"]) == "python train.py --lr 1e-3"
    for words, what in ((["cluster.yaml", "x"], "a task file"), (["echo hi", "x"], "a quoted command")):
        with pytest.raises(UserError, match=f"is {what}, so 'x' after it cannot be its words"):
            entrypoints.launch_entrypoint(words)
