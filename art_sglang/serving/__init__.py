"""Serving: the inference servers (`servers/`, the control plane), the gateway rollouts talk to (`gateway/`, the
data plane) and the adapter table joining them (`adapters.py`)."""
