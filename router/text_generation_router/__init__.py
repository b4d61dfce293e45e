"""HTTP router and launcher speaking upstream TGI's REST API to any generate.v3 shard."""

__version__ = "3.3.6-dev0"
