"""Sharded sources: a data set of S shards (files, blocks) of n_0, ..., n_{S-1} rows.

Rows are numbered shard after shard in the order the shards are listed (for files: sorted by
path), so row r of shard k is sample `sum(n_0..n_{k-1}) + r`. The public order of epoch e:

- the shards in the order `shard_order(S, seed, e)`
  = `torch.randperm(S, generator=torch.Generator().manual_seed(seed + e))`;
- within shard k, its rows in the order `row_order(n_k, seed, e, k)`
  = `torch.randperm(n_k, generator=torch.Generator().manual_seed(forward_seed(seed, e, k)))`;

and a step takes the next B samples of that sequence, exactly as with a map-style data set
(the cursor, the ledger and the rest of the step contract are unchanged). A step's global
batch therefore comes from one shard, or two at a shard boundary, and a rank reads only the
rows of its share: the shard's part that holds them (a row group of a parquet file, a block),
cached so that the next steps, which read the same shard, find it in memory. Memory is the
cached parts, not the data set.
"""

from __future__ import annotations

import bisect
import glob as _glob
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from elastic.adapt.groups import forward_seed


def shard_order(num_shards: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which epoch `epoch` visits the shards."""
    return torch.randperm(num_shards, generator=torch.Generator().manual_seed(seed + epoch))


def row_order(num_rows: int, seed: int, epoch: int, shard: int) -> torch.Tensor:
    """The order in which epoch `epoch` visits the rows of shard `shard`."""
    generator = torch.Generator().manual_seed(forward_seed(seed, epoch, shard))
    return torch.randperm(num_rows, generator=generator)


class ShardedSource(torch.utils.data.Dataset):
    """A map-style data set over shards, with the public order of the module docstring.

    Subclasses give the shards' row counts and `read(shard, rows)`; this class maps sample
    indices to shards, applies `transform` to each row and defines `epoch_indices`, which the
    step uses instead of a permutation of all samples (none of size N is ever built).

    Args:
        sizes: rows per shard, in shard order.
        transform: `row -> sample`, run where the row is read (a loader process when there are
            some), after the step's generators are seeded: random augmentation belongs here.
    """

    def __init__(self, sizes: Sequence[int], transform: Callable[[Any], Any] | None = None) -> None:
        if not sizes or any(int(n) < 0 for n in sizes):
            raise ValueError(f"a sharded source needs one or more shards, got sizes {list(sizes)}")
        self.sizes = [int(n) for n in sizes]
        self.transform = transform
        self._starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._orders: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()
        self._epochs: OrderedDict[tuple[int, int], tuple[torch.Tensor, np.ndarray]] = OrderedDict()

    def read(self, shard: int, rows: np.ndarray) -> list[Any]:
        """The rows `rows` (positions within shard `shard`), in that order."""
        raise NotImplementedError

    def layout(self) -> str:
        """A digest of the shards' row counts, in order: sample `i` is row `i` of the shards
        laid end to end, so a checkpoint's place in an epoch means the same rows only over
        the same layout (the same total over shards of other sizes does not)."""
        return hashlib.sha256(",".join(map(str, self.sizes)).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        where = np.asarray([int(i) for i in indices], dtype=np.int64)
        if where.size and (where.min() < 0 or where.max() >= len(self)):
            raise IndexError(f"sample index out of range for a source of {len(self)} rows")
        shards = np.searchsorted(self._starts, where, side="right") - 1
        out: list[Any] = [None] * len(where)
        for shard in np.unique(shards):
            positions = np.flatnonzero(shards == shard)
            rows = self.read(int(shard), where[positions] - self._starts[shard])
            for position, row in zip(positions, rows, strict=True):
                out[position] = self.transform(row) if self.transform is not None else row
        return out

    def epoch_indices(self, seed: int, epoch: int, start: int, stop: int) -> torch.Tensor:
        """Sample indices at positions `start` to `stop` of epoch `epoch`'s order."""
        order, ends = self._epoch(seed, epoch)
        positions = np.arange(start, stop, dtype=np.int64)
        slots = np.searchsorted(ends, positions, side="right")
        out = torch.empty(len(positions), dtype=torch.int64)
        for slot in np.unique(slots):
            shard = int(order[slot])
            mask = slots == slot
            within = positions[mask] - (ends[slot] - self.sizes[shard])
            rows = self._rows(seed, epoch, shard)[torch.from_numpy(within)]
            out[torch.from_numpy(mask)] = rows + int(self._starts[shard])
        return out

    def _epoch(self, seed: int, epoch: int) -> tuple[torch.Tensor, np.ndarray]:
        key = (seed, epoch)
        if key not in self._epochs:
            order = shard_order(len(self.sizes), seed, epoch)
            ends = np.cumsum([self.sizes[int(k)] for k in order]).astype(np.int64)
            self._epochs[key] = (order, ends)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[key]

    def _rows(self, seed: int, epoch: int, shard: int) -> torch.Tensor:
        key = (seed, epoch, shard)
        rows = self._orders.get(key)
        if rows is None:
            rows = self._orders[key] = row_order(self.sizes[shard], seed, epoch, shard)
            while len(self._orders) > 4:  # a batch spans at most two shards; reading ahead one more
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(key)
        return rows

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_orders"], state["_epochs"] = OrderedDict(), OrderedDict()
        return state


class ParquetSource(ShardedSource):
    """Parquet files as shards (through pyarrow and fsspec: local paths and URLs alike).

    A row is a dict of column values (`transform` turns it into a sample). Each file's row
    counts come from its footer; rows are read a row group at a time, and the last
    `cache_row_groups` row groups read are kept.

    Args:
        paths: a file, a directory (its `*.parquet` files), a glob, or a list of them; shards
            are the files sorted by path.
        columns: the columns to read (default: all).
        transform: `row dict -> sample`.
        cache_row_groups: row groups kept in memory per process.
        storage_options: passed to fsspec (credentials, endpoints).
    """

    def __init__(self, paths: str | Sequence[str], columns: Sequence[str] | None = None,
                 transform: Callable[[dict[str, Any]], Any] | None = None,
                 cache_row_groups: int = 16,
                 storage_options: dict[str, Any] | None = None) -> None:
        import fsspec
        import pyarrow.parquet as pq

        self.columns = list(columns) if columns is not None else None
        self.cache_row_groups = cache_row_groups
        self.storage_options = dict(storage_options or {})
        self.files = _expand(paths, self.storage_options)
        groups: list[list[int]] = []
        for path in self.files:
            fs, local = fsspec.core.url_to_fs(path, **self.storage_options)
            with fs.open(local, "rb") as f:
                meta = pq.ParquetFile(f).metadata
                groups.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        self._group_starts = [list(np.cumsum([0, *g])) for g in groups]
        self._cache: OrderedDict[tuple[int, int], Any] = OrderedDict()
        super().__init__([sum(g) for g in groups], transform)

    def read(self, shard: int, rows: np.ndarray) -> list[Any]:
        starts = self._group_starts[shard]
        out: list[Any] = [None] * len(rows)
        groups = [bisect.bisect_right(starts, int(r)) - 1 for r in rows]
        for group in sorted(set(groups)):
            table = self._group(shard, group)
            positions = [i for i, g in enumerate(groups) if g == group]
            picked = table.take([int(rows[i]) - int(starts[group]) for i in positions]).to_pylist()
            for i, row in zip(positions, picked, strict=True):
                out[i] = row
        return out

    def _group(self, shard: int, group: int) -> Any:
        import fsspec
        import pyarrow.parquet as pq

        key = (shard, group)
        table = self._cache.get(key)
        if table is not None:
            self._cache.move_to_end(key)
            return table
        fs, local = fsspec.core.url_to_fs(self.files[shard], **self.storage_options)
        with fs.open(local, "rb") as f:
            table = pq.ParquetFile(f).read_row_group(group, columns=self.columns)
        self._cache[key] = table
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return table

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cache"] = OrderedDict()
        return state


def _expand(paths: str | Sequence[str], storage_options: dict[str, Any]) -> list[str]:
    """Files named by `paths` (files, directories, globs), sorted, each once, with the URL
    scheme kept."""
    import fsspec

    found: set[str] = set()
    for path in [paths] if isinstance(paths, str) else list(paths):
        fs, local = fsspec.core.url_to_fs(path, **storage_options)
        if _glob.has_magic(local):
            matches = fs.glob(local)
        elif fs.isdir(local):
            matches = fs.glob(local.rstrip("/") + "/**/*.parquet")
        else:
            matches = [local] if fs.exists(local) else []
        if not matches:
            raise FileNotFoundError(f"no parquet file at {path!r}")
        found.update(fs.unstrip_protocol(m) if "://" in path else m for m in matches)
    return sorted(found)
