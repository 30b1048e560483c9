# Sourced by every device command after prepare.sh: where each stack lives on the GPU machine.
#   the test process and the trainer worker: the machine's torch/transformers + /tmp/tsite (Unsloth stack)
#     + /tmp/usite (the project's own needs: openai, fastapi, pytest-asyncio)
#   the SGLang server: /tmp/sglang-python, a wrapper that runs python3 with PYTHONPATH=/tmp/site only
#   the vLLM server (benchmarks): /tmp/vllm-python, the same with /tmp/vsite
# shellcheck shell=bash
test -d /tmp/site/sglang -a -x /tmp/sglang-python || { echo "COLD: run stage.sh/prepare.sh first"; exit 3; }
export PYTHONPATH="$PWD:/tmp/usite:/tmp/tsite"
export ART_SGLANG_SERVER_PYTHON=/tmp/sglang-python
# vLLM (benchmarks only), once stage.sh vllm has installed it
if [ -x /tmp/vllm-python ]; then export ART_SGLANG_VLLM_PYTHON=/tmp/vllm-python; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
export ART_SGLANG_GPU_TINY=/root/models/tiny ART_SGLANG_GPU_REALISTIC=/root/models/qwen2.5-1.5b-shape
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
