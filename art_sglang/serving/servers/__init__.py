"""The inference servers (control plane): launching, talking to, restarting and health-checking SGLang (or the
CPU reference engine) processes, one or several replicas as a group."""

from art_sglang.serving.servers.client import ModelCard, ServerClient
from art_sglang.serving.servers.process import ServerProcess

__all__ = ["ModelCard", "ServerClient", "ServerProcess"]
