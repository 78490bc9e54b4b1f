"""KV slot allocators: which rows of the model's KV tensors are free.

A slot is one row of the per-layer K and V tensors (`[num_slots, kv_heads, head_dim]`). The model
side owns the tensors; these allocators own only the slot numbers. Slot 0 (page 0 for the paged
allocator) is never handed out, so a model may write padding tokens there: the KV tensors need
`allocator.num_slots` rows.

Every call is O(number of slots it touches); nothing scans the pool. Double frees and frees of
slots outside the pool raise `SlotAllocationError` and leave the allocator unchanged.
"""

from __future__ import annotations

import numpy as np

from radixserve.errors import InvalidArgumentError, SlotAllocationError

SLOT_DTYPE = np.int64
"""Slot indices are int64, the dtype that torch indexing takes without a copy."""


def as_slot_array(indices: object, what: str = "indices") -> np.ndarray:
    """Return `indices` as a 1-D int64 array, raising `InvalidArgumentError` for anything else."""
    arr = np.asarray(indices)
    if arr.ndim != 1:
        if arr.size == 0:
            return np.empty(0, dtype=SLOT_DTYPE)
        raise InvalidArgumentError(f"{what} must be a 1-D array of slot indices, got {arr.ndim}-D")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.empty(0, dtype=SLOT_DTYPE)
        raise InvalidArgumentError(f"{what} must be integers, got dtype {arr.dtype}")
    return arr.astype(SLOT_DTYPE, copy=False)


class PagedTokenToKVPoolAllocator:
    """Hands out KV slots in whole pages of `page_size` consecutive, page-aligned slots.

    `size` usable token slots (a multiple of `page_size`) live in pages 1..size/page_size; page 0
    is the padding page. `alloc(n)` takes `n` (a multiple of `page_size`) and returns the slots
    of n/page_size whole pages, or None when fewer are free. `free(slots)` releases every page
    that any of `slots` lies in.
    """

    def __init__(self, size: int, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidArgumentError(f"page_size must be an integer >= 1, got {page_size!r}")
        if not isinstance(size, int) or size < page_size or size % page_size:
            raise InvalidArgumentError(
                f"size must be a positive multiple of page_size={page_size}, got {size!r}"
            )
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.num_slots = size + page_size
        self._page_offsets = np.arange(page_size, dtype=SLOT_DTYPE)
        self.reset()

    def reset(self) -> None:
        """Mark every slot free again."""
        # The stack holds free page numbers in [0, _top); its top end is handed out first, so a
        # fresh allocator returns low page numbers first.
        self._stack = np.arange(self.num_pages, 0, -1, dtype=SLOT_DTYPE)
        self._top = self.num_pages
        self._page_free = np.ones(self.num_pages + 1, dtype=bool)
        self._page_free[0] = False

    def available_size(self) -> int:
        """Number of free token slots."""
        return self._top * self.page_size

    def alloc(self, n: int) -> np.ndarray | None:
        """Return `n` free slots (int64, whole aligned pages), or None if fewer are free."""
        if not isinstance(n, (int, np.integer)) or n < 0 or n % self.page_size:
            raise InvalidArgumentError(
                f"alloc size must be a non-negative multiple of page_size={self.page_size}, "
                f"got {n!r}"
            )
        num_pages = int(n) // self.page_size
        if num_pages > self._top:
            return None
        start = self._top - num_pages
        pages = self._stack[start : self._top][::-1].copy()
        self._top = start
        self._page_free[pages] = False
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._page_offsets).ravel()

    def free(self, indices: object) -> None:
        """Release the pages holding `indices`; raises if one is already free or out of range."""
        slots = as_slot_array(indices)
        if slots.size == 0:
            return
        lo, hi = int(slots.min()), int(slots.max())
        if lo < self.page_size or hi >= self.num_slots:
            bad = lo if lo < self.page_size else hi
            raise SlotAllocationError(
                f"slot {bad} is outside the pool [{self.page_size}, {self.num_slots})"
            )
        if self.page_size == 1:
            pages = slots
            if pages.size > 1:
                ordered = np.sort(pages)
                dup = np.flatnonzero(ordered[1:] == ordered[:-1])
                if dup.size:
                    raise SlotAllocationError(
                        f"slot {int(ordered[dup[0]])} appears twice in one free() call"
                    )
        else:
            pages = np.unique(slots // self.page_size)
        already = self._page_free[pages]
        if already.any():
            page = int(pages[np.argmax(already)])
            raise SlotAllocationError(
                f"double free: slot {page * self.page_size} (page {page}) is already free"
            )
        self._page_free[pages] = True
        end = self._top + pages.size
        self._stack[self._top : end] = pages
        self._top = end

    def is_free(self, indices: object) -> np.ndarray:
        """A boolean array: for each slot in `indices`, whether its page is free."""
        slots = as_slot_array(indices)
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise SlotAllocationError(f"slots must lie in [0, {self.num_slots})")
        return self._page_free[slots // self.page_size]

    def free_slots(self) -> np.ndarray:
        """Every free slot, sorted."""
        pages = np.sort(self._stack[: self._top])
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._page_offsets).ravel()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()})"
        )


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Hands out single KV slots 1..size; `free` rejects a slot that appears twice."""

    def __init__(self, size: int) -> None:
        super().__init__(size, page_size=1)


class ReqToTokenPool:
    """The per-request slot table: row r, column i is the KV slot of request r's token i.

    Rows are handed out by `alloc` and returned by `free`; the table itself is a numpy int64
    array, `req_to_token`, of shape `[max_requests, max_context]`.
    """

    def __init__(self, max_requests: int, max_context: int) -> None:
        if not isinstance(max_requests, int) or max_requests < 1:
            raise InvalidArgumentError(
                f"max_requests must be an integer >= 1, got {max_requests!r}"
            )
        if not isinstance(max_context, int) or max_context < 1:
            raise InvalidArgumentError(f"max_context must be an integer >= 1, got {max_context!r}")
        self.max_requests = max_requests
        self.max_context = max_context
        self.req_to_token = np.zeros((max_requests, max_context), dtype=SLOT_DTYPE)
        self.reset()

    def reset(self) -> None:
        """Mark every row free."""
        self._free_rows = list(range(self.max_requests - 1, -1, -1))
        self._row_free = np.ones(self.max_requests, dtype=bool)

    def available_size(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def alloc(self, n: int = 1) -> list[int] | None:
        """Return `n` free row numbers, or None if fewer are free."""
        if not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"n must be a non-negative integer, got {n!r}")
        if n > len(self._free_rows):
            return None
        rows = [self._free_rows.pop() for _ in range(n)]
        self._row_free[rows] = False
        return rows

    def free(self, row: int) -> None:
        """Return `row` to the pool; raises on a double free or a row out of range."""
        if not isinstance(row, (int, np.integer)) or not 0 <= row < self.max_requests:
            raise SlotAllocationError(f"row must lie in [0, {self.max_requests}), got {row!r}")
        if self._row_free[row]:
            raise SlotAllocationError(f"double free: request row {row} is already free")
        self._row_free[row] = True
        self._free_rows.append(int(row))

    def write(self, row: int, start: int, slots: object) -> None:
        """Store `slots` as the KV slots of tokens [start, start+len(slots)) of request `row`."""
        values = as_slot_array(slots, "slots")
        if not isinstance(row, (int, np.integer)) or not 0 <= row < self.max_requests:
            raise InvalidArgumentError(f"row must lie in [0, {self.max_requests}), got {row!r}")
        if self._row_free[row]:
            raise InvalidArgumentError(f"request row {row} is not allocated")
        end = start + values.size
        if start < 0 or end > self.max_context:
            raise InvalidArgumentError(
                f"tokens [{start}, {end}) do not fit max_context={self.max_context}"
            )
        self.req_to_token[row, start:end] = values

    def read(self, row: int, end: int, start: int = 0) -> np.ndarray:
        """The KV slots of tokens [start, end) of request `row` (a read-only view)."""
        if not 0 <= start <= end <= self.max_context:
            raise InvalidArgumentError(
                f"token range [{start}, {end}) must lie in [0, {self.max_context}]"
            )
        view = self.req_to_token[row, start:end]
        view.flags.writeable = False
        return view
