"""The file modes a user's own files get, for what rlsched writes into a directory of theirs (an export, a model).

    written = save_file(...)          # safetensors' save_file makes 0600; tempfile.mkdtemp makes 0700
    as_user_made(directory)           # every file 0666 & ~umask, every directory 0777 & ~umask (0644 / 0755 at 022)

Writers that stage a directory and rename it into place (atomic) start from tempfile's private modes; the result
is then one mode for every kind of export (full weights, a PEFT adapter, a merged model), the one any file the user
makes gets, instead of 0644 for one and 0600 for another.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc/self/status): os.umask can only
    set it, and setting it back leaves a moment in which another thread's new file gets the wrong mode."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_user_made(path: str | Path) -> None:
    """Give `path` and, for a directory, everything under it the modes a file the user creates gets."""
    path, mask = Path(path), umask()
    for p in [path, *sorted(path.rglob("*"))] if path.is_dir() else [path]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
