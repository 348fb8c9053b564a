"""The leaves every part of rlsched shares: the errors a run ends with (`errors`), byte counts as people read
them (`units`) and waiting for another process's answer within a bound (`waits`).

May import: nothing of rlsched (every other folder imports these).
"""
