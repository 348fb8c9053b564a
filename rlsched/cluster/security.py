"""Who gets into the Ray cluster rlsched starts: its owner, and nobody else.

    mode = prepare_embedded_cluster(echo)   # before an embedded Ray starts: "token", or "disabled" with --insecure
    enforced(address)                       # True when a client without the token is refused there (None: unknown)

Anyone who can connect to a Ray cluster can run code as its owner, and Ray's servers listen on every interface
(Ray turns a 127.0.0.1 node address into the machine's own). What keeps others out is Ray's token
authentication, which the pinned Ray turns on for a new local cluster. Design decisions (and why):
- **The token file is the owner's alone.** Ray writes `~/.ray/auth_token` with the process's umask (0644 in a
  0755 directory, as found on a stock machine): any local user who can read the home directory could read the
  token. Before an embedded cluster starts, rlsched creates the token itself (0600, in a 0700 directory) if none
  exists, and tightens an existing file and directory of the user's to those modes, saying so once.
- **Off only when asked for twice.** `RAY_AUTH_MODE=disabled` would start a cluster that anyone reaching the
  machine may run code on; rlsched refuses to start one unless the command also says `--insecure` (or
  RLSCHED_INSECURE=1), and then says so loudly on every command.
- **Checked, not assumed.** What a cluster enforces is asked of the cluster: a child process with no token in
  its environment asks it for its metadata (rlsched.cluster.gcsprobe); a cluster that answers does not enforce
  authentication.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

INSECURE_ENV = "RLSCHED_INSECURE"  # set by `--insecure`; inherited by the service's process
INSECURE_LINE = ("WARNING: Ray's token authentication is OFF (--insecure): anyone who can reach this machine's Ray "
                 "ports can run code as you. Unset RAY_AUTH_MODE and drop --insecure to turn it back on.")
PROBE_TIMEOUT_S = 20.0
_said: list[bool] = []


class AuthError(ValueError):
    """Ray's authentication would be off, or its token is not the user's alone (exit 2: a setting to fix)."""


def insecure_allowed() -> bool:
    return os.environ.get(INSECURE_ENV, "") not in ("", "0")


def token_path() -> Path | None:
    """The file Ray reads its token from, as Ray looks for it; None when the token is in the environment."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def prepare_embedded_cluster(echo=print) -> str:
    """Before `ray.init` starts a local cluster: "token" (the token file made or tightened), or "disabled" when
    the user turned authentication off and said --insecure.
    An AuthError when authentication is off without --insecure."""
    mode = os.environ.get("RAY_AUTH_MODE", "").strip().lower()
    if mode == "disabled":
        if not insecure_allowed():
            raise AuthError("RAY_AUTH_MODE=disabled would start a Ray cluster that anyone who can reach this "
                              "machine may run code on; unset RAY_AUTH_MODE (rlsched keeps Ray's token "
                              "authentication on), or add --insecure to start it anyway")
        if not _said:  # once per process: the command's own check and the start of its Ray both come here
            echo(INSECURE_LINE)
            _said.append(True)
        return "disabled"
    if mode not in ("", "token"):
        raise AuthError(f"RAY_AUTH_MODE={mode!r}: rlsched starts Ray with 'token' (the default) or, with "
                          "--insecure, 'disabled'")
    # RAY_AUTH_MODE is left as it is: unset, Ray turns token mode on for a new local cluster itself, and only Ray
    # can also refresh the mode it cached when it was imported.
    path = token_path()
    if path is not None:
        secure_token_file(path, echo)
    return "token"


def secure_token_file(path: Path, echo=print) -> None:
    """`path` holds a token readable by this user alone, in a directory only this user can enter: made so if
    missing (never through a link), tightened if the user's own and looser; refused if someone else owns it."""
    uid = os.getuid()
    folder = path.parent
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True)
    _owned_and_private(folder, 0o700, uid, echo)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        if path.is_symlink():
            raise AuthError(f"{path} is a symbolic link; Ray's token file must be a plain file of yours "
                              "(remove the link and start again: a new token is made)") from None
        _owned_and_private(path, 0o600, uid, echo)
        return
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))  # what Ray itself generates: 256 random bits, hex


def _owned_and_private(path: Path, mode: int, uid: int, echo) -> None:
    st = os.stat(path)
    if st.st_uid != uid:
        raise AuthError(f"{path} belongs to uid {st.st_uid}, not to you (uid {uid}): whoever owns it can read or "
                          "replace the Ray token; point RAY_AUTH_TOKEN_PATH at a file of your own")
    loose = stat.S_IMODE(st.st_mode) & 0o077
    if loose:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
        echo(f"made {path} private to you (mode {oct(stat.S_IMODE(st.st_mode))[2:]} -> "
             f"{oct(stat.S_IMODE(st.st_mode) & ~0o077)[2:]}): it holds or guards the key to your Ray cluster")


def enforced(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the cluster at `address` refuses a client that has no token: True (it refused one), False (it
    answered one), None (no answer either way in `timeout_s`). The client is a child process with no token in
    its environment, no token file and authentication off on its side."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    with tempfile.TemporaryDirectory() as home:
        env |= {"RAY_AUTH_MODE": "disabled", "HOME": home, "RAY_AUTH_TOKEN_PATH": os.path.join(home, "none"),
                "RAY_USAGE_STATS_ENABLED": "0"}
        try:
            probe = subprocess.run([sys.executable, "-m", "rlsched.cluster.gcsprobe", address], capture_output=True,
                                   text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return None
    if probe.returncode == 0:
        return False
    return True if "AuthenticationError" in probe.stderr or "InvalidAuthToken" in probe.stderr else None


# ---- local files other users must not touch ------------------------------------------------------------------


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter, made so (with any missing parents under the system's temp
    directory, each 0700) or checked: a link, or a directory someone else owns, is refused (another user could
    plant files or links there), and a looser one of the user's is tightened."""
    uid = os.getuid()
    path = Path(path)
    chain = [*reversed(path.parents[:_depth_below_tmp(path)]), path]
    chain[0].parent.mkdir(parents=True, exist_ok=True)  # above the chain: made as usual (a home's own folders)
    for folder in chain:
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        st = os.lstat(folder)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise AuthError(f"{folder} is not a directory of yours but a link or a file; remove it (another user "
                            "may have planted it) and start again")
        if st.st_uid != uid:
            raise AuthError(f"{folder} belongs to uid {st.st_uid}, not to you (uid {uid}); remove it or set TMPDIR "
                            "to a directory of your own")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(folder, 0o700)
    return path


def _depth_below_tmp(path: Path) -> int:
    """How many of `path`'s parents lie below the system's temp directory (those are made private too)."""
    import tempfile

    tmp = Path(tempfile.gettempdir())
    parents = list(path.parents)
    return parents.index(tmp) if tmp in parents else 0


def open_private(path: Path, mode: str = "w"):
    """`open(path, mode)` for writing a file only this user can read, never through a link at `path`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o600), mode)
