#!/usr/bin/env bash
# On the GPU machine, after both stacks are installed (stage.sh): the project's own few packages, the
# server-python wrapper, the test models, and a record of the versions. Carry `.whl` (pytest 9 +
# pytest-asyncio + pytest-timeout wheels).
set -euo pipefail
test -d /tmp/site/sglang || { echo "COLD: SGLang stack not installed"; exit 3; }
# The contract suite needs only SGLang; the trainer suites check for their stack themselves.
test -d /tmp/tsite/unsloth || echo "note: trainer stack not installed (stage.sh train 0..1): trainer suites will fail"
# openai/fastapi/uvicorn/pydantic come from the SGLang bundle's wheels (same interpreter), kept apart from its pins.
wheels=()
for name in openai jiter distro sniffio fastapi starlette uvicorn python_multipart pydantic pydantic_core annotated_types typing_inspection orjson; do
  wheels+=(/root/b.wheels/"$name"-*.whl)
done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/usite "${wheels[@]}" .whl/*.whl 2>&1 \
  | grep -v '^WARNING' || true
# SGLang with its own stack only (the two venvs of setup_sglang.sh, on this machine), plus the plugin folder
# ServerProcess puts on its path (art_sglang/serving/servers/sglang_site: nothing but the plugin), as a venv's
# python would keep it.
cat > /tmp/sglang-python <<'WRAPPER'
#!/bin/sh
plugin=$(printf '%s' "${PYTHONPATH:-}" | tr ':' '\n' | grep '/sglang_site$' | head -n 1)
PYTHONPATH=/tmp/site${plugin:+:$plugin} exec python3 "$@"
WRAPPER
chmod +x /tmp/sglang-python
# shellcheck source=scripts/device/env.sh
source scripts/device/env.sh
python3 tests/gpu/gpu_models.py /root/models
python3 scripts/device/versions.py | tee "$OUT/versions.json"
# MODELS="models-random models-random-7b": those suites build their models in the background (CPU, ~2 min at
# 7B) while the next kit parts arrive; measure.sh waits for /tmp/models.done. setsid: the call's end spares it.
if [ -n "${MODELS:-}" ]; then
  setsid nohup bash -c "bash scripts/device/suite.sh $MODELS > /tmp/models.log 2>&1; touch /tmp/models.done" \
    > /dev/null 2>&1 < /dev/null &
  echo "building in the background: $MODELS (/tmp/models.log)"
fi
