"""The CPU reference engine: a small real HTTP server speaking SGLang 0.5.17's HTTP subset on
transformers + peft, run as `python -m art_sglang.server.reference <sglang launch flags>`."""
