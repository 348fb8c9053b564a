"""The leaves every part of rlsched shares: the errors a run ends with (`errors`) and byte counts as people read
them (`units`).

May import: nothing of rlsched (every other folder imports these).
"""
