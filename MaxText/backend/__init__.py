"""The bottom of the package: what depends on the JAX installation itself — the one platform
choice of the hot path (`hot_path`) and every private name taken from a library (`compat`)."""
