"""JAX's persistent compilation cache, turned on in every role process (`cluster.compile_cache_dir`).

Design decisions:
- **On by default, shared.** Tasks of the same shapes (the same model and batch settings, like the demo's)
  compile each program once between them, and a rerun loads instead of compiling: starting is what a user
  waits for before the first step. JAX keys entries by program, devices and compiler version, so sharing is safe.
- **Every program is kept** (no minimum compile time or size): a role compiles a few dozen programs, most
  in well under JAX's default threshold of one second, and together they are the start-up time.
- **The environment wins.** JAX_COMPILATION_CACHE_DIR set by the user (or by the tests, for one cache per
  session) is left as it is.
"""

from __future__ import annotations

import os

MAX_BYTES = 4 * 2**30  # JAX evicts least recently used entries beyond it


def enable(directory: str | None) -> None:
    """Use `directory` as this process's persistent compilation cache (before its first compile)."""
    if directory is None or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax

    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
