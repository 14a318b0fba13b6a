"""The inference service model, one module per concern: services (a service with its defaults, its
fields' problems), placement (nodes, GPUs, workers, upstreams), gateway and keys, memory (a model's
need of a GPU), checks (what preflight runs) and engines (a worker's command line)."""
