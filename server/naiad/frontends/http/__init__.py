"""HTTP: the KServe v2 REST app (aiohttp) and its fast HTTP/1.1 path, Triton's generate extension, SSE."""
