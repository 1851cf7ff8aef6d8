"""interop: torch, JAX and DLPack at the edge."""

__all__: list[str] = []
