"""A small continuous-batching server on the kvscope pool: model, engine, workload and report."""
