"""The user's data as training meets it: how large its items are, the worst batch, representative batches.

A limit is only worth reporting if it holds for every batch of every epoch. With per-batch
padding (a ``collate_fn`` that pads to the longest item), a batch's shape is, dimension by
dimension, the largest of its items'; so the worst batch of ``b`` items holds the items that are
largest in each dimension that varies, and then the largest items by size. Trials measure memory
on that batch, and time their steps on batches drawn at random from the whole dataset (the same
draws for every configuration of one batch size), so samples/s is what an epoch sees.

Item sizes come from a ``lengths`` attribute of the dataset when it has one (one number per item,
as length-grouped samplers use), else from the items' tensor shapes, read item by item: every
item up to ``MAX_SCAN``, else a random sample of that many (the report says which). Memory that
depends on the content rather than the shapes (a mixture of experts' routing, data-dependent
control flow) is not covered.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Sequence

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from autotune.units import quantile

__all__ = ["ItemSizes", "scan_items", "worst_indices", "random_indices", "real_tokens", "loader_notes", "MAX_SCAN"]

MAX_SCAN = 20_000  # items read to find the largest; above this, a random sample of this many


@dataclasses.dataclass(frozen=True)
class ItemSizes:
    """How large the dataset's items are, as far as they were read."""

    n_items: int  # len(dataset)
    method: str  # "lengths" (the dataset's attribute), "exhaustive" (every item read) or "sample"
    indices: tuple[int, ...]  # the items read, dataset indices
    sizes: tuple[int, ...]  # per item read: its size (elements of its largest tensor, or its length)
    shapes: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per item read: the shape of each of its tensors

    def quantiles(self) -> dict[str, int]:
        """p50, p90 and the largest item size."""
        return {"p50": quantile(self.sizes, 0.5), "p90": quantile(self.sizes, 0.9), "max": max(self.sizes)}

    @property
    def shapes_vary(self) -> bool:
        """Whether a batch's shape may change with the items in it (and so with its size): sizes or shapes differ
        between the items read, or not every item was read."""
        return self.method == "sample" or len(set(self.sizes)) > 1 or len(set(self.shapes)) > 1

    def to_dict(self) -> dict[str, Any]:
        return {"items": self.n_items, "read": len(self.indices), "method": self.method,
                "size_unit": "length" if self.method == "lengths" else "elements of the item's largest tensor",
                **self.quantiles(), "shapes_vary": self.shapes_vary}


def _shapes(item: Any) -> tuple[tuple[int, ...], ...]:
    """The shape of every tensor in an item (dicts, tuples and lists walked; a list of numbers is one 1-D sequence)."""
    if isinstance(item, torch.Tensor):
        return (tuple(item.shape),)
    if hasattr(item, "shape") and hasattr(item, "dtype"):  # a NumPy array
        return (tuple(item.shape),)
    if isinstance(item, Mapping):
        return tuple(s for key in item for s in _shapes(item[key]))
    if isinstance(item, (list, tuple)):
        if item and all(isinstance(v, (int, float, bool)) for v in item):
            return ((len(item),),)
        return tuple(s for v in item for s in _shapes(v))
    return ()


def scan_items(dataset: Any, *, seed: int = 0, max_scan: int = MAX_SCAN) -> ItemSizes:
    """Read the sizes of ``dataset``'s items (see the module docstring)."""
    n = len(dataset)
    lengths = getattr(dataset, "lengths", None)
    if isinstance(lengths, Sequence) and not isinstance(lengths, str) and len(lengths) == n:
        try:
            return ItemSizes(n, "lengths", tuple(range(n)), tuple(int(v) for v in lengths))
        except (TypeError, ValueError):
            pass  # not a list of numbers: read the items
    if n <= max_scan:
        indices, method = list(range(n)), "exhaustive"
    else:
        g = torch.Generator().manual_seed(seed)
        indices, method = sorted(torch.randperm(n, generator=g)[:max_scan].tolist()), "sample"
    shapes = tuple(_shapes(dataset[i]) for i in indices)
    sizes = tuple(max((math.prod(s) for s in shape), default=0) for shape in shapes)
    return ItemSizes(n, method, tuple(indices), sizes, shapes)


def worst_indices(items: ItemSizes, batch_size: int) -> list[int]:
    """The ``batch_size`` items whose collated batch is the largest the data can make.

    First, for every tensor dimension that varies between items, an item where it is largest
    (so that padding to the longest meets each dimension's maximum); then the largest items by
    size. Dataset indices, largest first.
    """
    order = sorted(range(len(items.indices)), key=lambda k: -items.sizes[k])
    chosen: list[int] = []
    if items.shapes and len(set(items.shapes)) > 1:
        ranks = [len(s) for s in items.shapes[0]]
        same_layout = all(len(s) == len(items.shapes[0]) and [len(d) for d in s] == ranks for s in items.shapes)
        if same_layout:
            for t, rank in enumerate(ranks):
                for d in range(rank):
                    extents = [shape[t][d] for shape in items.shapes]
                    if len(set(extents)) > 1:
                        best = max(order, key=lambda k: (extents[k], items.sizes[k]))
                        if best not in chosen:
                            chosen.append(best)
    chosen = chosen[:batch_size]
    chosen += [k for k in order if k not in chosen][: batch_size - len(chosen)]
    return [items.indices[k] for k in chosen]


def random_indices(n_items: int, batch_size: int, draw: int, *, seed: int = 0) -> list[int]:
    """The ``draw``-th random batch of ``batch_size`` distinct items: the same for every configuration."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + batch_size) * 1_000_033 + draw)
    return torch.randperm(n_items, generator=g)[:batch_size].tolist()


def real_tokens(batch: Any) -> int | None:
    """The batch's real tokens: the sum of its ``attention_mask``, else its ``labels`` (or ``targets``) that are
    not -100; None where the batch says neither."""
    if not isinstance(batch, Mapping):
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Mapping):
            batch = {**batch[0], **(batch[1] if len(batch) > 1 and isinstance(batch[1], Mapping) else {})}
        else:
            return None
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    for key in ("labels", "targets"):
        labels = batch.get(key)
        if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.ndim >= 2:
            return int((labels != -100).sum())
    return None


def loader_notes(loader: DataLoader) -> tuple[str, ...]:
    """What a loader's own sampler means for the limits: trials and the probe draw fixed batches of b items."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return (f"the loader's batch_sampler ({type(batch_sampler).__name__}) is not used: trials draw batches of b items "
                f"from the whole dataset and measure memory on the worst of them, so a limit holds for any batch of at most "
                f"b items, however the sampler groups them (bucketing only makes batches smaller); batches of more than b "
                f"items, or sized by a token budget, are not covered: tune with --batch-sizes up to its largest batch",)
    sampler = loader.sampler
    if type(sampler) not in (RandomSampler, SequentialSampler):
        return (f"the loader's sampler ({type(sampler).__name__}) is not used: trials draw batches of b items from the "
                f"whole dataset; the worst batch bounds any batch of b items it can make, and samples/s is measured on "
                f"random batches, not on its groups",)
    return ()
