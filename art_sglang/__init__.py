"""art_sglang: ART-style RL training backend with inference on SGLang."""
