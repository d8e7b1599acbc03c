"""The server launcher without a server: SGLang reads back the keys it is given, CPU ranks get
their share of the CPUs, and die_with_parent takes a command's whole group down with its starter."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

from actors.process_group import group_pids
from actors.sglang_server import (
    DraftSpec,
    ServerSpec,
    SGLangServer,
    build_command,
    build_env,
    cpu_bind_groups,
)
from patches.settings import ENV_CPU_EAGLE3, CaptureSettings
from tests.helpers.processes import kill_and_wait


def test_sglang_reads_back_every_key_the_launcher_gives_it(tmp_path: Path) -> None:
    """Through SGLang's own config merging and parser: a key argparse took for an option (a
    url-safe token starting with '-') failed one server start in ~30."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    spec = ServerSpec(model_path=tmp_path, capture=CaptureSettings.from_env({}), device="cpu")
    for _ in range(300):
        server = SGLangServer(spec, tmp_path / "server.log")
        keys_file = server._write_keys()
        argv = build_command(spec, server.port, keys_file)[3:]  # after `python -m module`
        parsed = parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(argv))
        assert (parsed.api_key, parsed.admin_api_key) == (server._api_key, server._admin_api_key)
        keys_file.unlink()


# A server in miniature: a command that starts a child of its own which never asks to die with
# it (as SGLang's detokenizer, still importing when its server dies), then prints its group.
SERVER_LIKE = (
    "import os, subprocess; child = subprocess.Popen(['sleep', '600']); "
    "print(os.getpgrp(), child.pid, flush=True); os.execvp('sleep', ['sleep', '600'])"
)
LAUNCHER = f"""
import os, subprocess, sys, time
subprocess.Popen(
    [sys.executable, "-m", "actors.die_with_parent", str(os.getpid()), "--",
     sys.executable, "-c", {SERVER_LIKE!r}],
    start_new_session=True,
)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def running_members(group: int) -> list[int]:
    return [pid for pid in group_pids(group) if running(pid)]


def test_die_with_parent_takes_the_whole_group_down_with_its_starter() -> None:
    """The supervisor, the command and the child that never asked to die with it: all gone
    once the starter is SIGKILLed (a PDEATHSIG on the command alone left that child)."""
    starter = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    group = 0
    try:
        group, child = (int(x) for x in starter.stdout.readline().split())
        assert running(child) and child in group_pids(group)
        kill_and_wait(starter, lambda: bool(running_members(group)), 10, "the group")
    finally:
        starter.kill()
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def test_die_with_parent_ends_with_its_command_and_takes_what_it_left() -> None:
    launcher = [sys.executable, "-m", "actors.die_with_parent", str(os.getpid()), "--"]
    supervisor = subprocess.Popen([*launcher, "sh", "-c", "sleep 600 & exit 3"])
    try:
        assert supervisor.wait(timeout=30) == 3
        assert not running_members(supervisor.pid)  # its group: the sleep left behind went
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(supervisor.pid, signal.SIGKILL)
    killed = subprocess.run([*launcher, "sh", "-c", "kill -9 $$"], timeout=30)
    assert killed.returncode == 128 + signal.SIGKILL


def test_the_whole_group_goes_when_the_supervisor_itself_is_killed_outright() -> None:
    """As Ray kills an actor's children when the actor dies: the supervisor gets SIGKILL, and
    its guard takes the group down, the child that never asked to die with it included."""
    launcher = [sys.executable, "-m", "actors.die_with_parent", str(os.getpid()), "--"]
    supervisor = subprocess.Popen(
        [*launcher, sys.executable, "-c", SERVER_LIKE], stdout=subprocess.PIPE, text=True
    )
    try:
        assert supervisor.stdout is not None
        group, child = (int(x) for x in supervisor.stdout.readline().split())
        assert group == supervisor.pid and running(child)
        kill_and_wait(supervisor, lambda: bool(running_members(group)), 10, "the group")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(supervisor.pid, signal.SIGKILL)


def test_die_with_parent_refuses_to_start_for_a_parent_already_gone() -> None:
    launched = subprocess.run(
        [sys.executable, "-m", "actors.die_with_parent", "1", "--", "sleep", "600"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert launched.returncode != 0 and "parent 1 is gone" in launched.stderr


def test_a_cpu_server_with_several_ranks_binds_each_to_its_share_of_the_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert cpu_bind_groups([0, 1], 2) == "0|1"
    assert cpu_bind_groups(list(range(8)), 2) == "0-3|4-7"
    assert cpu_bind_groups([0, 2, 4, 6], 2) == "0,2|4,6"
    assert cpu_bind_groups([0, 1], 3) == "0|0|1"  # more ranks than CPUs: they share
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    capture = CaptureSettings(None, "hsx-", 1 << 20, mla_cpu_fix=True)
    two = ServerSpec(model_path=Path("m"), capture=capture, dp_size=2, device="cpu")
    assert build_env(two)["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1
    one = ServerSpec(model_path=Path("m"), capture=capture, device="cpu")
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in build_env(one)  # SGLang's own NUMA binding


def parsed_command(spec: ServerSpec, tmp_path: Path) -> argparse.Namespace:
    """The launcher's command line as SGLang's own parser reads it (keys file merged)."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    keys_file = SGLangServer(spec, tmp_path / "server.log")._write_keys()
    argv = build_command(spec, 30000, keys_file)[3:]
    return parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(argv))


def test_a_draft_server_serves_the_draft_and_captures_nothing(tmp_path: Path) -> None:
    off = CaptureSettings.from_env({})
    draft = DraftSpec(tmp_path / "draft", num_steps=3, num_draft_tokens=4)
    spec = ServerSpec(model_path=tmp_path, capture=off, device="cpu", draft=draft)
    args = parsed_command(spec, tmp_path)
    assert args.speculative_algorithm == "EAGLE3"
    assert args.speculative_draft_model_path == str(tmp_path / "draft")
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (3, 1)
    assert args.speculative_num_draft_tokens == 4
    assert not args.enable_return_aux_hidden_states
    # On CPU the plugin's EAGLE-3 ops and attention modes are asked for; not for capture.
    assert build_env(spec)[ENV_CPU_EAGLE3] == "1"
    capture = ServerSpec(model_path=tmp_path, capture=off, device="cpu")
    assert ENV_CPU_EAGLE3 not in build_env(capture)
    assert parsed_command(capture, tmp_path).enable_return_aux_hidden_states


def test_a_plain_server_neither_captures_nor_speculates(tmp_path: Path) -> None:
    spec = ServerSpec(model_path=tmp_path, capture=CaptureSettings.from_env({}), plain=True)
    args = parsed_command(spec, tmp_path)
    assert args.speculative_algorithm is None and not args.enable_return_aux_hidden_states


def test_a_server_captures_or_serves_a_draft_not_both(tmp_path: Path) -> None:
    capture = CaptureSettings(tmp_path, "hsx-", 1 << 20, True)
    with pytest.raises(ValueError, match="captures nothing"):
        ServerSpec(model_path=tmp_path, capture=capture, draft=DraftSpec(tmp_path))
    with pytest.raises(ValueError, match="not both"):
        off = CaptureSettings.from_env({})
        ServerSpec(model_path=tmp_path, capture=off, draft=DraftSpec(tmp_path), plain=True)
