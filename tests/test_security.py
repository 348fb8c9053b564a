"""Only the owner gets in: the Ray token file's modes, authentication that is never off unasked and is checked
on the cluster itself, `down` that signals only what `up` started, and local records nobody else can redirect."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlsched.cluster import security

ROOT = Path(__file__).resolve().parents[1]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh home directory, Ray's token looked up in it as Ray would (~/.ray/auth_token)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", security.INSECURE_ENV):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_a_new_token_is_made_private_before_ray_could_make_it_world_readable(home):
    lines = []
    assert security.prepare_embedded_cluster(lines.append) == "token"
    token = home / ".ray" / "auth_token"
    assert mode(home / ".ray") == 0o700 and mode(token) == 0o600
    assert len(token.read_text()) == 64 and int(token.read_text(), 16) >= 0  # 256 bits, hex, as Ray makes them
    assert lines == []  # nothing to say: nothing was loose
    before = token.read_text()
    security.prepare_embedded_cluster(lines.append)
    assert token.read_text() == before  # an existing token is kept: clients already hold it


def test_a_loose_token_file_and_directory_are_tightened_and_said_so(home):
    folder = home / ".ray"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    token = folder / "auth_token"
    token.write_text("ab" * 32)
    os.chmod(token, 0o644)  # what Ray 2.60 leaves with a 022 umask
    lines = []
    security.prepare_embedded_cluster(lines.append)
    assert mode(folder) == 0o700 and mode(token) == 0o600
    assert token.read_text() == "ab" * 32
    assert len(lines) == 2 and "755 -> 700" in lines[0] and "644 -> 600" in lines[1]


def test_a_token_path_that_is_a_link_is_refused(home, tmp_path):
    (home / ".ray").mkdir(mode=0o700)
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("cd" * 32)
    (home / ".ray" / "auth_token").symlink_to(elsewhere)
    with pytest.raises(security.AuthError, match="symbolic link"):
        security.prepare_embedded_cluster(print)


def test_authentication_off_is_refused_unless_insecure(home, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(security.AuthError, match="--insecure"):
        security.prepare_embedded_cluster(print)
    monkeypatch.setenv(security.INSECURE_ENV, "1")
    lines = []
    monkeypatch.setattr(security, "_said", [])
    assert security.prepare_embedded_cluster(lines.append) == "disabled"
    assert lines == [security.INSECURE_LINE]
    assert not (home / ".ray").exists()  # no token made for a cluster that will not ask for one


def test_the_cluster_refuses_a_client_without_its_token(ray_session):
    """Asked of the cluster itself: a child process with no token anywhere is refused by Ray's GCS."""
    address = ray_session.get_runtime_context().gcs_address
    assert security.enforced(address) is True


def test_ray_auth_disabled_up_is_refused_before_anything_starts(tmp_path):
    env = os.environ | {"RAY_AUTH_MODE": "disabled", "RLSCHED_HOME": str(tmp_path / "state")}
    env.pop(security.INSECURE_ENV, None)
    done = subprocess.run([sys.executable, "-m", "rlsched.cli", "up"], capture_output=True, text=True, env=env,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "RAY_AUTH_MODE=disabled" in done.stderr and "--insecure" in done.stderr
    assert not (tmp_path / "state" / "service.json").exists()


def test_down_leaves_alone_a_process_that_took_a_dead_services_pid(tmp_path):
    """After a crash or a reboot the recorded pid may be someone else's: `down` signals nothing and says why."""
    from rlsched.service.daemon import process_identity

    state = tmp_path / "state"
    state.mkdir()
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        identity = process_identity(bystander.pid)
        record = {"pid": bystander.pid, "identity": {**identity, "start_ticks": identity["start_ticks"] - 100},
                  "address": "127.0.0.1:1", "namespace": "rlsched", "settings": {}, "auth": "token"}
        (state / "service.json").write_text(json.dumps(record))
        done = subprocess.run([sys.executable, "-m", "rlsched.cli", "down"], capture_output=True, text=True,
                              env=os.environ | {"RLSCHED_HOME": str(state)}, timeout=60)
        time.sleep(0.5)
        assert bystander.poll() is None, "down signalled a process it did not start"
        assert done.returncode == 1
        assert f"pid {bystander.pid} is now another process (sleep 60)" in done.stderr
        assert "nothing to stop" in done.stderr
        assert not (state / "service.json").exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_private_dirs_are_the_users_alone_and_links_are_not_followed(tmp_path):
    target = tmp_path / "a" / "b"
    security.private_dir(target)
    assert mode(target) == 0o700
    os.chmod(target, 0o755)
    security.private_dir(target)
    assert mode(target) == 0o700
    (tmp_path / "victim").write_text("keep")
    (target / "1.SIGTERM").symlink_to(tmp_path / "victim")  # what another user could plant in a shared folder
    with pytest.raises(OSError):
        security.open_private(target / "1.SIGTERM")
    assert (tmp_path / "victim").read_text() == "keep"
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(security.AuthError, match="link"):
        security.private_dir(tmp_path / "link")
