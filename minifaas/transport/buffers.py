"""Receive buffers that are used again instead of freshly mapped for every transfer.

Receiving into new memory makes the kernel fault in and zero every page first;
on a busy host that costs about as much as the copy itself. A consumer that
is done with a received state (a decode node copies it into its own cache)
gives it back with ``KVReceiver.release``, and the next transfer receives into
the same pages. Nothing is recycled unless it is given back, so forgetting to
release only costs speed; releasing a state that is still in use is a bug
(its bytes will be overwritten).

``pinned``: a decode node on a GPU receives into page-locked memory, from which
its copies to the device run asynchronously (``model.host_copy.to_device``).
Such a state is given back only once those copies are done (a stream sync).
"""

from __future__ import annotations

import bisect

import torch


class ReceiveBuffers:
    def __init__(self, max_bytes: int, pinned: bool = False):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0 (0: recycle nothing)")
        self.max_bytes, self.pinned = max_bytes, pinned
        self.held_bytes = 0
        self._sizes: list[int] = []  # sorted, parallel to _buffers
        self._buffers: list[torch.Tensor] = []
        self._held: set[int] = set()  # data pointers, so a double release cannot hand one buffer out twice
        self.reused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly ``nbytes``: a view of a pooled buffer at most twice as large, or new memory."""
        i = bisect.bisect_left(self._sizes, nbytes)
        if nbytes and i < len(self._sizes) and self._sizes[i] <= 2 * nbytes:
            size, buf = self._sizes.pop(i), self._buffers.pop(i)
            self.held_bytes -= size
            self._held.discard(buf.data_ptr())
            self.reused += 1
            return buf[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def give(self, tensor: torch.Tensor) -> None:
        """Return the memory behind ``tensor`` (a slot of a received state) to the pool."""
        storage = tensor.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        size, ptr = whole.numel(), whole.data_ptr()
        if size == 0 or ptr in self._held or self.held_bytes + size > self.max_bytes:
            return
        i = bisect.bisect_left(self._sizes, size)
        self._sizes.insert(i, size)
        self._buffers.insert(i, whole)
        self._held.add(ptr)
        self.held_bytes += size
