"""Functions run on every rank of a local process group by the distributed tests, one module a
feature (module level, so that spawned processes import them)."""
