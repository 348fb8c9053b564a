"""What an experiment is before anything runs: the config schema and its loading (`schema`), the config reference
rendered from it (`reference`), each role's mesh and devices (`meshes`), what each device will hold (`plan`), the
checks that can only fail later (`preflight`) and `rlsched check` (`check`).

May import: rlsched.base. No Ray, no JAX at import.
"""
