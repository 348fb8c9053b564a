"""The weights an engine serves, stamped: their version, and a checksum hashed from what the engine serves.

Every engine answers `weight_version` and `weight_checksum` (workers.rollout.base.RolloutEngine), and the driver
compares the checksum with the actor's. The checksum is hashed from the served weights read back, never assumed
from what was sent: a sync that silently did nothing (an adapter that never reached its slot, a leaf left behind)
shows as a mismatch. Hashing reads every leaf back to the host, so it runs when asked and is kept until the
weights change. An engine subclasses `StampedWeights`, sets `_version` and `_checksum` (None: hash when asked),
and says what it serves in `_served_flat()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.models import params as P


class StampedWeights:
    _version: int
    _checksum: str | None

    def _served_flat(self) -> Mapping[str, Any]:
        """{name: array} of what this engine serves now, in rlsched's flat layout (workers.models.params)."""
        raise NotImplementedError

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def weight_checksum(self) -> str:
        if self._checksum is None:
            self._checksum = P.checksum(self._served_flat())
        return self._checksum

    def _refusal(self, version: int, digest: str, checksum: str | None,
                 what: str = "weights") -> P.WeightMismatchError | None:
        """The error refusing a sync whose result (`digest`, hashed from what landed) is not what the sender hashed
        (`checksum`, when it sent one), or None to accept it. The caller puts its previous weights back, then raises
        it: the engine keeps serving its current version, which the message names."""
        if checksum is None or digest == checksum:
            return None
        verb = "hash" if what.endswith("s") else "hashes"
        return P.WeightMismatchError(f"update_weights(version={version}): the {what} that landed {verb} to {digest}, "
                                     f"the sender's to {checksum}; keeping v{self._version}")
