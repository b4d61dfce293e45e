"""HTTP stage: the FastAPI app and its routes (native, OpenAI, cloud), bodies read as upstream reads
them, SSE, the OpenAPI document, errors mapped to HTTP answers, and the uvicorn server with its drain.

May import engine and the shared top-level modules (config, env, layer_skip); only cli imports it.
"""
