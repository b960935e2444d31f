"""Which GPU staging slot holds which offloaded layer input in backward: the buffer policy, in one place.

With ``buffers`` slots the layer registered ``seq``-th in forward is reloaded into slot ``seq % buffers``: the
backward visits layers in reverse, so consecutive layers alternate slots, and the reload of layer k-1 (slot
``(k-1) % 2``) can run while layer k's backward reads slot ``k % 2``. With one slot every reload waits for the
previous backward to finish with it. Prefetch (reload the next layer while this one computes) needs a second slot.

If a slot cannot be allocated (out of memory), the policy drops it and the remaining slots carry on.
"""

from __future__ import annotations


class SlotPolicy:
    """Round-robin assignment of offloaded inputs to ``buffers`` staging slots (1 or 2 today)."""

    def __init__(self, buffers: int):
        self.buffers = buffers
        self.slots: list[int] = list(range(buffers))   # the usable slots (fewer after an allocation failure)

    @property
    def active(self) -> int:
        """Staging buffers in use now (``buffers`` unless one could not be allocated)."""
        return len(self.slots)

    def slot_of(self, seq: int) -> int:
        """The staging slot of the input registered ``seq``-th in forward."""
        return self.slots[seq % len(self.slots)]

    def can_prefetch(self) -> bool:
        """A reload ahead needs a slot other than the one the running backward reads."""
        return len(self.slots) >= 2

    def drop(self, slot: int) -> None:
        """Stop using ``slot`` (its buffer could not be allocated)."""
        if len(self.slots) == 1:
            raise RuntimeError("cannot drop the last staging slot")
        self.slots.remove(slot)


__all__ = ["SlotPolicy"]
