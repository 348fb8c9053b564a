"""The long-lived scheduler service: the service actor (`server`), `rlsched up/down` (`daemon`), the commands
that talk to it (`client`), what it keeps of each submission (`submissions`) and its bounded records (`bounded`).

May import: every other folder; only rlsched.cli imports it.
"""
