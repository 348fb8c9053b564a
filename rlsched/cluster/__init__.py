"""The processes a run's roles live in: the Ray cluster (`ray_cluster`), device-group processes that hold every
role of a device group (`group_process`), roles whose mesh spans hosts (`rolegroup`), pinning a process to its
cores (`pinning`), how a process ended (`exits`), probing a Ray address (`gcsprobe`), who may enter the cluster
(`security`), the compilation cache (`compile_cache`) and the weight channel between a task's roles (`comm`).

May import: rlsched.base, rlsched.config, rlsched.rundir, rlsched.observe, rlsched.scheduling.
"""
