"""The Ray cluster a run uses: the embedded one keeps token authentication on, so a client without the token
runs nothing; one given by `--address` is checked within seconds (something else listening there, other
versions) instead of Ray's minutes of retries."""

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


def test_an_address_where_no_ray_cluster_listens_is_named_within_30_s(tmp_path):
    """Something listens there (a web server), but it is no Ray GCS: one line naming the address, exit 1,
    where Ray itself would retry for minutes."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        root = Path(__file__).resolve().parents[1]
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "rlsched.cli", "train", "configs/demo_multitask.yaml",
                               "--address", f"127.0.0.1:{port}", "--set", f"experiment.output_dir={tmp_path}"],
                              cwd=root, capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - t0
    finally:
        web.kill()
    assert done.returncode == 1 and seconds < 30, (seconds, done.stderr[-2000:])
    assert done.stderr.splitlines() == [
        f"error: --address 127.0.0.1:{port}: something listens there, but no Ray cluster answered in 15 s (a wrong "
        "port? Ray's GCS listens on 6379 unless `ray start --head --port` said otherwise); start one with `ray start "
        "--head` and pass the address it prints, or leave --address out for an embedded local Ray"], done.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_cluster_of_other_versions_is_named_with_both(ray_session):
    """The live cluster's own metadata, read as `--address` reads it, passes; the same with another Ray
    version (what a cluster started from another environment reports) is one line naming both."""
    import platform

    from rlsched.base.errors import ClusterUnreachable
    from rlsched.cluster import ray_cluster
    from rlsched.cluster.gcsprobe import cluster_metadata

    gcs = ray_session.get_runtime_context().gcs_address
    metadata = cluster_metadata(gcs)
    assert metadata["ray_version"] == ray_session.__version__
    ray_cluster.check_reachable(gcs)  # the probe in its child process, as `rlsched train --address` runs it
    with pytest.raises(ClusterUnreachable) as err:
        ray_cluster.check_versions(gcs, metadata | {"ray_version": "2.9.3"})
    assert str(err.value) == (
        f"--address {gcs}: the cluster runs Ray 2.9.3 on Python {metadata['python_version']}, this rlsched Ray "
        f"{ray_session.__version__} on Python {platform.python_version()}; run rlsched with the cluster's versions, "
        "or start the cluster from this environment")


ROLE_ENV = """
import os, sys
from rlsched.cluster.ray_cluster import enter_role_env, role_env
env = role_env(3, "CPU", shares_devices=False)
if sys.argv[1] == "started":
    import jax
    jax.devices()  # this process's JAX backend started before the role's environment was set
try:
    enter_role_env(env)
except RuntimeError as err:
    print("refused:", err)
else:
    import jax
    print(len(jax.devices()), os.environ["RLSCHED_RECORD_EXIT"])
"""


def test_a_role_process_takes_its_environment_before_jax_starts_and_refuses_one_started_already():
    """A role's environment (XLA host devices, the exit record) is set by its constructor (cluster.enter_role_env),
    not by Ray's runtime_env: it reaches JAX when nothing started JAX before, and is refused, naming why, when
    something did (the variables would not take effect). Fresh interpreters."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RLSCHED_RECORD_EXIT")}
    env["JAX_PLATFORMS"] = "cpu"
    run = lambda how: subprocess.run([sys.executable, "-c", ROLE_ENV, how], capture_output=True, text=True,  # noqa: E731
                                     env=env, timeout=120)
    fresh, started = run("fresh"), run("started")
    assert fresh.returncode == 0 and fresh.stdout.split() == ["3", "1"], fresh.stderr
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("refused: this role's process started JAX before"), started.stdout
