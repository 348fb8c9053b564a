"""One experiment's run: the experiment (`experiment`), each task's lifecycle and step loop (`task`), the host
side of its phases (`phases`), its actor and engine roles (`roles`), checkpoints (`checkpoints`), exporting one
(`export`) and stopping on a signal (`stopping`).

May import: every folder below the service (base, config, rundir, observe, scheduling, cluster).
"""
