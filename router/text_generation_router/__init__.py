"""HTTP router and launcher speaking upstream TGI's REST API to any generate.v3 shard.

Packages by stage of the request path: http -> engine -> pb (the shard's stubs); launcher apart.
At top level: cli (`text-generation-router`, which wires http and engine together) and config,
env, layer_skip, which any stage may import and which import nothing of the router.
"""

__version__ = "3.3.6-dev0"
