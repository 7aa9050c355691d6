"""Many cores, one engine: frontend worker processes that do the protocol work and one engine process that owns
the repository, schedulers and backends (`naiad serve --frontend-workers N`)."""
