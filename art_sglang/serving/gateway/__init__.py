"""The gateway (data plane): the loopback HTTP server rollouts talk to, its rules, and how each request reaches a
server replica."""
