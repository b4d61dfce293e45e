"""text-generation-server: a wire-compatible TGI v3 shard with input-adaptive layer skipping."""

__version__ = "3.3.6.post1"
