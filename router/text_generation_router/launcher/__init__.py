"""`text-generation-launcher`: its flags and environment, then the shard and router processes it
starts, watches and stops.

May import only the shared top-level modules (env, layer_skip): it runs the router as a process,
never its http or engine code.
"""
