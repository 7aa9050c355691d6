"""The protocol frontends in rooms by protocol: openai, http, grpc (on its h2 server), triton, transport."""
