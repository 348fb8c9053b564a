"""Who gets a device group's locks and memory, and when: the pure policy (`policy`, no Ray, no JAX, no IO), the
scheduler actor that executes it (`scheduler`), fencing a role whose lease ran out (`fencing`), memory accounting
per device pool (`memory`) and coordinator ports (`ports`).

May import: rlsched.base, rlsched.config, rlsched.rundir, rlsched.observe. Never the cluster, a run or the service.
"""
