"""The offline layer-skip toolchain: `text-generation-server layerskip profile|sweep|calibrate|verify|consistency`.

Unlike the `layerskip` library this package imports the server's loaders and runner, since it
measures real models the way the shard runs them.
"""

from .app import app

__all__ = ["app"]
