"""The inference service model, one module per concern: services (a service with its defaults, its
fields' problems), placement (nodes, GPUs, workers, upstreams), gateway and keys, memory (a model's
need of a GPU), checks (what preflight runs), engines (a worker's command line) and plan (role
inference's plan of a service on a node, filter inference_plan)."""
