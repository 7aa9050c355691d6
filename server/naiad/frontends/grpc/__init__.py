"""gRPC: the KServe v2 service with Triton's extensions, on Naiad's own HTTP/2 server (h2/) or grpc.aio."""
