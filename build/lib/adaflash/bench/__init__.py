"""Benchmarks and experiments: the serving bench, the governance bench, the online-adaptation
experiment and the quick method comparison. Each writes its results as files (JSON, markdown,
plots); none is imported by the running system."""
