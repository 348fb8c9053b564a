"""The long-lived scheduler service: the service actor (`server`) and its parts (its task records `records`, admission
by memory `admission`, the live submissions' drivers `runs`, the supervised monitor `monitor`), `rlsched up/down`
(`daemon`), the commands that talk to it (`client`), what it keeps of each submission (`submissions`) and its
bounded records (`bounded`).

May import: every other folder; only rlsched.cli imports it.
"""
