"""shard: the functional ZeRO core."""

__all__: list[str] = []
