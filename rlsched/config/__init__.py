"""What an experiment is before anything runs: the config schema (`schema`), reading files and
overrides (`loading`), what a task's processes are handed (`spec`), the config reference
rendered from it (`reference`), each role's mesh and devices (`meshes`), what each device will hold (`plan`), the
checks that can only fail later (`preflight`) and `rlsched check` (`check`).

May import: rlsched.base. No Ray, no JAX at import.
"""
