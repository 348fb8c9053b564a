"""Is there a Ray cluster at ADDRESS, and which versions does it run? Asked in a child process, so a port
where something else listens costs a bounded wait, not Ray's minutes of retries.

    python -m rlsched.cluster.gcsprobe 10.0.0.5:6379     # prints {"ray_version": "2.60.0", "python_version": ...}

Design decisions (and why):
- **A child process.** Ray's GCS client retries a silent or foreign server for minutes, from C++, and logs
  each retry on stderr; a child with a deadline is the one clean way to stop it. The parent
  (`rlsched.cluster.ray_cluster.check_reachable`) kills it after `PROBE_TIMEOUT_S`.
- **The cluster's own metadata.** What `ray.init` compares (Ray and Python versions) is read from the GCS
  here, with the token Ray reads as `ray.init` would (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
  ~/.ray/auth_token), and compared by Ray's own check in the parent: one line instead of Ray's traceback.
"""

from __future__ import annotations

import json
import sys


def cluster_metadata(address: str, timeout_s: float = 10.0) -> dict:
    from ray._raylet import GcsClient  # the client ray.init uses (no public API reads the metadata)

    client = GcsClient(address=address)
    raw = client.internal_kv_get(b"CLUSTER_METADATA", namespace=b"cluster", timeout=timeout_s)
    return json.loads(raw.decode()) if raw else {}


if __name__ == "__main__":
    print(json.dumps(cluster_metadata(sys.argv[1])))
