"""What a run shows: the timeline of spans and counters (`timeline`) and its Gantt chart (`gantt`), metric
trackers (`tracking`), the lines a person watching sees (`progress`) and memory probes (`memprobe`).

May import: rlsched.base, rlsched.config, rlsched.rundir.
"""
