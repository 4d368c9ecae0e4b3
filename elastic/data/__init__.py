"""Sources for data sets stored as shards (files or blocks): read a shard's part at a time,
in a public order that any plain loop can replay."""

from elastic.data.sharded import ParquetSource, ShardedSource, row_order, shard_order

__all__ = ["ParquetSource", "ShardedSource", "row_order", "shard_order"]
