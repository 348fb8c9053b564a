"""The embedded Ray cluster: token authentication stays on, so a client without the token runs nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CONNECT = ("import ray\nray.init(address={gcs!r}, log_to_driver=False)\n"
           "print('ran', ray.get(ray.remote(lambda: 6 * 7).remote()))\n")


def _clients(gcs: str, envs: list[dict]) -> list[tuple[int | None, str, str]]:
    """Separate Python processes, started together, that each connect to `gcs` and run one task:
    (exit code, or None if it hung for 60 s; stdout; stderr) of each."""
    procs = [subprocess.Popen([sys.executable, "-c", CONNECT.format(gcs=gcs)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for env in envs]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=60)
            out.append((p.returncode, stdout, stderr))
        except subprocess.TimeoutExpired:
            p.kill()
            out.append((None, *p.communicate()))
    return out


def test_a_client_without_the_clusters_token_cannot_run_work(ray_session, tmp_path):
    gcs = ray_session.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    owner, *outsiders = _clients(gcs, [
        {**env, "RAY_AUTH_MODE": "token"},  # the same user: Ray reads the token the cluster generated
        # Anyone else: no token file (another HOME), a wrong token, or no authentication at all.
        {**env, "HOME": str(tmp_path), "RAY_AUTH_MODE": "token"},
        {**env, "HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"},
        {**env, "HOME": str(tmp_path)},
    ])
    assert owner[0] == 0 and "ran 42" in owner[1], owner[2][-2000:]
    for code, stdout, stderr in outsiders:
        assert code != 0 and "ran 42" not in stdout, (code, stdout)
        assert code is None or "authentication token" in stderr.lower(), stderr[-2000:]
