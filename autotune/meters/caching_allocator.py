"""A model of PyTorch's CUDA caching allocator: what it would reserve for an allocation trace, on any machine.

On CUDA the figure that runs out is not what tensors hold (``max_memory_allocated``, the tensor meter's count)
but what the caching allocator took from the driver (``max_memory_reserved``): it rounds every request, packs
small ones into 2 MiB segments and mid-sized ones into 20 MiB segments, keeps freed blocks cached for reuse, and
gives whole free segments back only when an allocation fails. :func:`replay` runs an allocation trace (the
tensor meter's, ``TensorMeter(trace=True)``) through those rules and returns the peaks torch's statistics would
report; :func:`nvml_bytes` adds what NVML sees besides.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (read at pytorch/pytorch commit 001074d2; torch 2.8
and later keep them and move the constants to ``c10/core/AllocatorConfig.h``), named here by its functions:
``round_size``, ``get_pool``, ``get_allocation_size``, ``get_free_block``, ``should_split``,
``alloc_found_block``, ``free_block``/``try_merge_blocks``, ``alloc_block``, ``release_available_cached_blocks``,
``release_cached_blocks``/``release_blocks``, and for expandable segments ``find_expandable_block``,
``try_allocate_expandable_block``, ``map_block`` and ``unmap_block``.

Streams are modelled the way torch keys its pools (``BlockComparatorSize``: stream, size, address): a segment is
the stream's that asked for it, and a block freed on a stream is reused only there (``record_stream``'s delay is the
caller's to replay: free a block when torch's trace says ``free_completed``). Not modelled: CUDA graphs' private pools,
``garbage_collection_threshold`` and ``roundup_power2_divisions`` (off by default), and a driver that runs out
before the budget does: capacity is checked as under ``set_per_process_memory_fraction``, on reserved bytes plus
the segment asked for (a subclass may refuse more, and place segments: :mod:`autotune.meters.allocator_record`
replays the driver's answers from a GPU's record). Addresses are a model's: new segments follow each other, so
among equal sizes the older segment is picked first. Torch-free.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable

from autotune.errors import AutotuneError
from autotune.meters.cuda_overheads import CUDA_CONTEXT_BYTES, cublas_workspace_bytes, nvml_bytes, workspace_trace

__all__ = ["AllocatorSettings", "Replay", "CachingAllocator", "AllocatorOutOfMemory", "replay", "round_size",
           "segment_size", "cublas_workspace_bytes", "workspace_trace", "nvml_bytes", "CUDA_CONTEXT_BYTES"]

MiB = 1 << 20
MIN_BLOCK_BYTES = 512  # kMinBlockSize: every request is rounded up to a multiple of 512 bytes
SMALL_SIZE_BYTES = 1 * MiB  # kSmallSize: requests up to 1 MiB are served from the small pool
SMALL_BUFFER_BYTES = 2 * MiB  # kSmallBuffer: the small pool's segments (and its expandable pages)
LARGE_BUFFER_BYTES = 20 * MiB  # kLargeBuffer (large_segment_size_mb in torch 2.8+): segments for 1-10 MiB requests
MIN_LARGE_ALLOC_BYTES = 10 * MiB  # kMinLargeAlloc: from here on a request gets a segment of its own size...
ROUND_LARGE_BYTES = 2 * MiB  # kRoundLarge: ...rounded up to 2 MiB
_VA_PAGES = 1 << 20  # an expandable segment's address space, in pages (torch reserves 1.125 x the device's memory)


@dataclasses.dataclass(frozen=True)
class AllocatorSettings:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings the model follows; the defaults are torch's."""

    expandable_segments: bool = False  # expandable_segments:True: one segment per pool that grows page by page
    max_split_bytes: int | None = None  # max_split_size_mb; None: unlimited (torch's default), every block splits
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES  # max_non_split_rounding_mb (kLargeBuffer before it)
    large_segment_bytes: int = LARGE_BUFFER_BYTES  # large_segment_size_mb (torch 2.8+): the 1-10 MiB requests' segment


@dataclasses.dataclass(frozen=True)
class Replay:
    """What the allocator's statistics say after a trace, in bytes."""

    peak_allocated_bytes: int  # max_memory_allocated: blocks handed out, each at the size the allocator gave it
    peak_reserved_bytes: int  # max_memory_reserved: segments (expandable: mapped pages) taken from the driver
    peak_requested_bytes: int  # the requests themselves, unrounded: the tensor meter's peak for the same trace
    allocated_bytes: int  # at the end of the trace (or where it ran out of memory)
    reserved_bytes: int
    segments: int  # segments held at the end (expandable: expandable segments); cudaMalloc'd segments
    peak_segments: int
    retries: int  # allocations that failed, gave the cache back and were tried again (num_alloc_retries)
    oom_request_bytes: int | None = None  # the segment no retry could get ("Tried to allocate"): the trace stopped

    # True when an allocation failed even after the cache was given back: the run raises OutOfMemoryError
    oom = property(lambda self: self.oom_request_bytes is not None)


class AllocatorOutOfMemory(AutotuneError):
    """The modelled allocator could not get a segment of ``request_bytes`` even after giving its cache back."""

    def __init__(self, request_bytes: int, reserved_bytes: int) -> None:
        super().__init__(f"modelled CUDA allocator: a segment of {request_bytes} bytes not got, {reserved_bytes} held")
        self.request_bytes, self.reserved_bytes = request_bytes, reserved_bytes


def round_size(nbytes: int) -> int:
    """Return the bytes the allocator hands out for a request of ``nbytes`` (``round_size``): a multiple of 512."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_size(size: int, *, large_segment_bytes: int = LARGE_BUFFER_BYTES) -> int:
    """Return the segment, in bytes, asked of the driver for a rounded request of ``size`` bytes that no cached
    block serves (``get_allocation_size``): 2 MiB up to 1 MiB, 20 MiB below 10 MiB, else the size rounded to 2 MiB."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return large_segment_bytes
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class _Block:
    """A piece of a segment, free or handed out; ``prev`` and ``next`` are its neighbours in the segment.
    ``segment`` is an expandable segment's (base address, page size), ``None`` for a cudaMalloc'd one; ``stream``
    is the segment's, the stream that asked for it."""

    __slots__ = ("address", "size", "small", "segment", "mapped", "stream", "allocated", "requested", "prev", "next")

    def __init__(self, address: int, size: int, small: bool, segment: tuple[int, int] | None,
                 mapped: bool = True, stream: int = 0) -> None:
        self.address, self.size, self.small, self.segment, self.mapped = address, size, small, segment, mapped
        self.stream = stream
        self.allocated, self.requested = False, 0
        self.prev: _Block | None = None
        self.next: _Block | None = None

    split = property(lambda self: self.prev is not None or self.next is not None)
    # its size with the unmapped pages after it, which it could grow into: get_free_block's best fit sizes by it
    growable_size = property(lambda self: self.size + (self.next.size if self.next and not self.next.mapped else 0))


class _Pool:
    """One pool's free, mapped blocks, in the order best fit searches them: by stream, size, then address."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[int, _Block] = {}

    def add(self, block: _Block) -> None:
        bisect.insort(self.keys, (block.stream, block.size, block.address))
        self.blocks[block.address] = block

    def remove(self, block: _Block) -> None:
        del self.keys[bisect.bisect_left(self.keys, (block.stream, block.size, block.address))]
        del self.blocks[block.address]

    def fit(self, size: int, stream: int) -> int:
        """The index of the smallest block of at least ``size`` bytes on ``stream`` (``len(keys)`` where none is)."""
        index = bisect.bisect_left(self.keys, (stream, size, -1))
        return index if index < len(self.keys) and self.keys[index][0] == stream else len(self.keys)

    def at(self, index: int) -> _Block:
        return self.blocks[self.keys[index][2]]


class CachingAllocator:
    """One device's caching allocator: :meth:`malloc` (on a stream) and :meth:`free` by key, and its statistics.

    ``capacity_bytes`` is what reserved memory may reach (``set_per_process_memory_fraction``'s fraction of the
    device; ``None``: no limit). An allocation that would pass it gives the cache back and tries again, as torch's
    does, and raises :class:`AllocatorOutOfMemory` where that does not help.
    """

    def __init__(self, settings: AllocatorSettings = AllocatorSettings(), *, capacity_bytes: int | None = None) -> None:
        self.settings, self.capacity_bytes = settings, capacity_bytes
        self._pools = {True: _Pool(), False: _Pool()}  # small, large: free mapped blocks
        self._unmapped: dict[bool, dict[int, _Block]] = {True: {}, False: {}}  # expandable: unmapped pages, by address
        self._live: dict[int, _Block] = {}
        self._empty: set[int] = set()  # keys of 0-byte requests: torch's allocate() hands them no memory
        self._next_address = 0
        self.allocated = self.reserved = self.requested = self.segments = self.retries = 0
        self.peak_allocated = self.peak_reserved = self.peak_requested = self.peak_segments = 0

    def malloc(self, key: int, nbytes: int, *, stream: int = 0) -> None:
        """Allocate ``nbytes`` under ``key`` on ``stream`` (``malloc``): a cached block of the stream's if one fits,
        else a new segment."""
        if nbytes == 0:
            self._empty.add(key)
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE_BYTES  # get_pool
        asked = segment_size(size, large_segment_bytes=self.settings.large_segment_bytes)
        block = self._cached_block(size, small, stream)
        if block is None:
            block = (self._new_block(size, asked, small, stream)
                     or (self._release_available(size, small, stream) and self._new_block(size, asked, small, stream))
                     or self._retry(size, asked, small, stream))
        if not block:
            raise AllocatorOutOfMemory(asked, self.reserved)
        block = self._hand_out(block, size)
        block.requested = nbytes
        self._live[key] = block
        self.allocated += block.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)

    def free(self, key: int) -> None:
        """Free the block allocated under ``key`` into its pool, merged with free neighbours (``free_block``)."""
        if key in self._empty:
            self._empty.discard(key)
            return
        block = self._live.pop(key)
        self.allocated -= block.size
        self.requested -= block.requested
        block.allocated = False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._pools[block.small].add(block)

    def release_cached(self) -> None:
        """Give every wholly free segment back to the driver, large pool first (``release_cached_blocks``: what
        ``torch.cuda.empty_cache()`` does, and a failed allocation before its last try); expandable segments unmap
        their free whole pages; stream by stream, smallest first, as torch's pools are ordered."""
        for small in (False, True):
            pool = self._pools[small]
            unmap = []
            for block in [pool.at(i) for i in range(len(pool.keys))]:
                if block.segment is not None:
                    unmap.append(block)
                elif not block.split:
                    self._release_segment(block)
            for block in unmap:
                unmapped = self._unmap(block)
                if unmapped is not None and not unmapped.split:  # nothing of the segment is left mapped
                    del self._unmapped[small][unmapped.address]
                    self.segments -= 1

    def summary(self, *, oom_request_bytes: int | None = None) -> Replay:
        """The statistics so far as a :class:`Replay`."""
        return Replay(peak_allocated_bytes=self.peak_allocated, peak_reserved_bytes=self.peak_reserved,
                      peak_requested_bytes=self.peak_requested, allocated_bytes=self.allocated,
                      reserved_bytes=self.reserved, segments=self.segments, peak_segments=self.peak_segments,
                      retries=self.retries, oom_request_bytes=oom_request_bytes)

    def _cached_block(self, size: int, small: bool, stream: int) -> _Block | None:
        """The best-fitting free block of the pool on ``stream``, taken out of it (``get_free_block``), or ``None``."""
        pool = self._pools[small]
        index = pool.fit(size, stream)
        if index == len(pool.keys):
            return None
        block = pool.at(index)
        if self.settings.expandable_segments:  # sized by what it could grow to: one that ends at unmapped pages waits
            while (index + 1 < len(pool.keys) and pool.keys[index + 1][0] == stream
                   and pool.at(index + 1).growable_size < block.growable_size):
                index += 1
                block = pool.at(index)
        cut = self.settings.max_split_bytes
        if cut is not None and (size < cut <= block.size  # an oversize block is not cut for a smaller request
                                or size >= cut and block.size >= size + self.settings.max_non_split_rounding_bytes):
            return None
        pool.remove(block)
        return block

    def _hand_out(self, block: _Block, size: int) -> _Block:
        """Hand ``size`` bytes of ``block`` out, splitting the rest off into the pool where it is worth keeping
        (``should_split``: 512 bytes in the small pool and expandable segments, more than 1 MiB in the large)."""
        remaining = block.size - size
        cut = self.settings.max_split_bytes
        split = (remaining >= MIN_BLOCK_BYTES if block.small or self.settings.expandable_segments
                 else (cut is None or size < cut) and remaining > SMALL_SIZE_BYTES)
        if split:
            front = self._split_front(block, size)
            self._pools[block.small].add(block)
            block = front
        block.allocated = True  # unsplit, the whole block counts as allocated
        return block

    def _new_block(self, size: int, asked: int, small: bool, stream: int) -> _Block | None:
        """A new segment of ``asked`` bytes (``alloc_block``), or ``None`` where it would pass the capacity or the
        driver refuses it. Expandable segments check the same figure and then map only the pages ``size`` needs."""
        if self.capacity_bytes is not None and self.reserved + asked > self.capacity_bytes or self._refused(asked):
            return None
        if self.settings.expandable_segments:
            return self._expand(size, small, stream)
        block = _Block(self._address(asked, small, stream, expandable=False), asked, small, None, stream=stream)
        self._reserve(asked)
        self.segments += 1
        self.peak_segments = max(self.peak_segments, self.segments)
        self._traced("segment_alloc", block.address, asked, stream)
        return block

    def _retry(self, size: int, asked: int, small: bool, stream: int) -> _Block | None:
        """Give the cache back and try once more (``release_cached_blocks`` then ``alloc_block(isRetry)``)."""
        self.release_cached()
        self.retries += 1
        return self._new_block(size, asked, small, stream)

    def _release_available(self, size: int, small: bool, stream: int) -> bool:
        """With a ``max_split_size``: free the stream's smallest oversize cached block that covers the request, else
        its largest oversize ones until they do (``release_available_cached_blocks``); without one, nothing."""
        cut = self.settings.max_split_bytes
        if cut is None or self.settings.expandable_segments:
            return False
        pool = self._pools[small]
        wanted = max(size, cut)
        index = bisect.bisect_left(pool.keys, (stream, wanted, -1))
        if index < len(pool.keys) and pool.keys[index][0] == stream:
            self._release_segment(pool.at(index))
            return True
        released = 0
        for block_stream, block_size, address in reversed(pool.keys[:index]):
            if released >= wanted or block_size < cut or block_stream != stream:
                break
            released += block_size
            self._release_segment(pool.blocks[address])
        return released >= wanted

    def _release_segment(self, block: _Block) -> None:
        """``cudaFree`` a free, unsplit segment (``release_block``)."""
        self._pools[block.small].remove(block)
        self.reserved -= block.size
        self.segments -= 1
        self._traced("segment_free", block.address, block.size, block.stream)

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    # What the driver answers; a replay of a GPU's record overrides these three (autotune.meters.allocator_record).
    def _address(self, nbytes: int, small: bool, stream: int, *, expandable: bool) -> int:
        """The address of a new segment (``cudaMalloc``) or expandable segment's address space: the model's next."""
        self._next_address += nbytes
        return self._next_address - nbytes

    def _refused(self, nbytes: int) -> bool:
        """Whether the driver refuses a segment of ``nbytes`` (a failed ``cudaMalloc``); the model's never does."""
        return False

    def _traced(self, action: str, address: int, nbytes: int, stream: int) -> None:
        """Note a segment event of ``stream``'s, named as torch's trace names it (``segment_alloc``,
        ``segment_free``, ``segment_map``, ``segment_unmap``), after the reserved bytes changed; the model keeps no
        trace."""

    def _split_front(self, block: _Block, size: int) -> _Block:
        """Cut the first ``size`` bytes of ``block`` (in no pool) off as a block of their own, and return it."""
        front = _Block(block.address, size, block.small, block.segment, block.mapped, block.stream)
        front.prev, front.next = block.prev, block
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.address, block.size = block.address + size, block.size - size
        return front

    def _merge(self, block: _Block, other: _Block | None) -> None:
        """Absorb a free neighbour of the same mapping into ``block`` (in no pool) (``try_merge_blocks``)."""
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        if other.mapped:
            self._pools[other.small].remove(other)
        else:
            del self._unmapped[other.small][other.address]
        if other is block.prev:
            block.address, block.prev = other.address, other.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
        block.size += other.size

    def _expand(self, size: int, small: bool, stream: int) -> _Block:
        """A free block of at least ``size`` bytes made by mapping pages at the lowest address where there is room
        (``try_allocate_expandable_block``), taken out of its pool."""
        block = self._room(size, small, stream)
        if not block.mapped:
            block = self._map(block, min(block.size, size))
        while block.size < size:
            block = self._map(block.next, min(size - block.size, block.next.size))
        self._pools[small].remove(block)
        return block

    def _room(self, size: int, small: bool, stream: int) -> _Block:
        """The lowest block of the stream's from which free and unmapped blocks in a row hold ``size`` bytes; a new
        expandable segment where none does (``find_expandable_block``): 2 MiB pages for the small pool, 20 MiB for
        the large."""
        for address in sorted(a for a, b in self._unmapped[small].items() if b.stream == stream):
            block = self._unmapped[small][address]
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            room, last = 0, block
            while last is not None and not last.allocated and room < size:
                room, last = room + last.size, last.next
            if room >= size:
                return block
        page = SMALL_BUFFER_BYTES if small else self.settings.large_segment_bytes
        base = self._address(page * _VA_PAGES, small, stream, expandable=True)
        block = _Block(base, page * _VA_PAGES, small, (base, page), mapped=False, stream=stream)
        self._unmapped[small][block.address] = block
        self.segments += 1
        self.peak_segments = max(self.peak_segments, self.segments)
        return block

    def _map(self, block: _Block, size: int) -> _Block:
        """Map the whole pages that hold the first ``size`` bytes of an unmapped ``block``; return the free block
        they make, merged with free neighbours and in its pool (``map_block``)."""
        mapped = -(-size // block.segment[1]) * block.segment[1]
        del self._unmapped[block.small][block.address]
        if mapped < block.size:
            rest, block = block, self._split_front(block, mapped)
            self._unmapped[rest.small][rest.address] = rest
        block.mapped = True
        address = block.address
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._pools[block.small].add(block)
        self._reserve(mapped)
        self._traced("segment_map", address, mapped, block.stream)
        return block

    def _unmap(self, block: _Block) -> _Block | None:
        """Unmap the whole pages inside a free ``block`` (``unmap_block``); return the unmapped block they make,
        merged with unmapped neighbours, or ``None`` where no whole page is free."""
        base, page = block.segment
        begin = base + -(-(block.address - base) // page) * page
        end = base + (block.address + block.size - base) // page * page
        if begin >= end:
            return None
        pool = self._pools[block.small]
        pool.remove(block)
        if begin > block.address:  # a free, mapped piece before the first whole page
            pool.add(self._split_front(block, begin - block.address))
        if block.address + block.size > end:  # and one after the last
            unmapped = self._split_front(block, end - begin)
            pool.add(block)
            block = unmapped
        block.mapped = False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._unmapped[block.small][block.address] = block
        self.reserved -= end - begin
        self._traced("segment_unmap", begin, end - begin, block.stream)
        return block


def replay(trace: Iterable[tuple[int, ...]], *, settings: AllocatorSettings = AllocatorSettings(),
           capacity_bytes: int | None = None) -> Replay:
    """Replay an allocation trace through the caching allocator; return its statistics (peaks in bytes).

    ``trace``: ``(+nbytes, key)`` for an allocation on the default stream, ``(+nbytes, key, stream)`` on another
    (numbered from 1: its blocks are cached for it alone), ``(-nbytes, key)`` for the free of the allocation made
    under ``key``, in order (``TensorMeter(trace=True)``'s; :func:`workspace_trace` makes events to put first).
    Events of 0 bytes allocate nothing, as torch's ``allocate`` allocates nothing for them. Where an allocation fails
    even after the cache was given back, the replay stops there and ``oom_request_bytes`` says what it asked for.
    """
    allocator = CachingAllocator(settings, capacity_bytes=capacity_bytes)
    try:
        for nbytes, key, *stream in trace:
            if nbytes > 0:
                allocator.malloc(key, nbytes, stream=stream[0] if stream else 0)
            elif nbytes < 0:
                allocator.free(key)
    except AllocatorOutOfMemory as exc:
        return allocator.summary(oom_request_bytes=exc.request_bytes)
    return allocator.summary()
