"""The run directory and the files in it: its layout and one atomic write (`files`), its owner's lock (`lock`),
and run.log (`log`).

May import: rlsched.base, rlsched.config.
"""
