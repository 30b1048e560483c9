"""Launching and talking to an inference server (SGLang, or the CPU reference engine)."""

from art_sglang.server.client import ModelCard, ServerClient
from art_sglang.server.process import ServerProcess

__all__ = ["ModelCard", "ServerClient", "ServerProcess"]
