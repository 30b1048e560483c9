#!/usr/bin/env bash
# Build the two Python environments art_sglang runs with (run it again at any time; it is idempotent):
#   .venv                 this project with its trainer (torch, transformers, peft, Unsloth)
#   .venv-sglang-server   SGLang only, pinned to the tested release; the project is NOT installed in it, so
#                         SGLang's dependency pins and the trainer's never meet. The backend finds its
#                         bin/python by itself (art_sglang.config.find_server_python).
set -euo pipefail

SGLANG_SPEC="sglang[srt]==0.5.17"   # the release verified on a GPU (docs/verification.md)
ROUTER_SPEC="sglang-router==0.3.2"  # SGLang's router, for several server replicas (inference_devices)
CPU_TORCH_SPEC="torch==2.13.0"      # CPU runs: the release the CPU suite is tested with

usage() {
  cat <<'EOF'
Usage: scripts/setup_sglang.sh [--cpu] [--system-site-packages] [--python PYTHON] [-h|--help]

Creates (or updates) the environments in the project root:
  .venv                 the project with extras [train,dev]          (with --cpu: [reference,dev] + CPU torch)
  .venv-sglang-server   sglang[srt]==0.5.17 and sglang-router==0.3.2, isolated from the project
                        (skipped with --cpu)

Options:
  --cpu                   machine without a GPU: no SGLang server venv; the backend then uses its
                          reference engine (transformers + peft on CPU)
  --system-site-packages  let .venv see the interpreter's installed packages (reuses them; fast)
  --python PYTHON         interpreter to build the venvs from (default: python3)
  -h, --help              show this help

Uses uv when it is on PATH, else python -m venv + pip. Environment: TORCH_INDEX_URL (extra index for
torch, e.g. https://download.pytorch.org/whl/cpu), PIP_* / UV_* as usual.
EOF
}

cpu=0
system_site=0
python=python3
while [ $# -gt 0 ]; do
  case $1 in
    --cpu) cpu=1 ;;
    --system-site-packages) system_site=1 ;;
    --python)
      [ $# -ge 2 ] || { echo "--python needs a value" >&2; exit 2; }
      python=$2
      shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
command -v "$python" >/dev/null || { echo "no interpreter '$python' on PATH (use --python)" >&2; exit 2; }
if command -v uv >/dev/null; then tool=uv; else tool=pip; fi
done_lines=()

say() { printf '[setup_sglang] %s\n' "$*"; }

# make_venv DIR SYSTEM_SITE: create DIR unless it already holds a working interpreter.
make_venv() {
  local dir=$1 site=$2 flags=()
  if "$dir/bin/python" -c 'import sys' 2>/dev/null; then
    say "$dir exists, reusing it"
    return
  fi
  [ "$site" = 1 ] && flags+=(--system-site-packages)
  say "creating $dir ($tool)"
  if [ $tool = uv ]; then
    uv venv -q --seed --python "$python" "${flags[@]}" "$dir"
  else
    "$python" -m venv "${flags[@]}" "$dir"
  fi
  done_lines+=("created $dir")
}

# install DIR ARGS...: install into DIR's interpreter with uv or pip.
install() {
  local dir=$1
  shift
  local extra=()
  [ -z "${TORCH_INDEX_URL:-}" ] || extra+=(--extra-index-url "$TORCH_INDEX_URL")
  if [ $tool = uv ]; then
    uv pip install -q --python "$dir/bin/python" "${extra[@]}" "$@"
  else
    "$dir/bin/python" -m pip install -q --disable-pip-version-check "${extra[@]}" "$@"
  fi
}

# ---- .venv: the project ------------------------------------------------------------------------------
make_venv .venv "$system_site"
if [ $cpu = 1 ]; then
  if .venv/bin/python -c 'import torch' 2>/dev/null; then
    say "torch already importable in .venv, keeping it"
  else
    say "installing $CPU_TORCH_SPEC"
    install .venv "$CPU_TORCH_SPEC"
  fi
  extras="reference,dev"
else
  extras="train,dev"
fi
say "installing the project (-e .[$extras]) into .venv"
install .venv -e ".[$extras]"
done_lines+=("installed art_sglang[$extras] (editable) into .venv")
.venv/bin/python -c 'import art_sglang, torch; print("  .venv: art_sglang OK, torch", torch.__version__)'

# ---- .venv-sglang-server: SGLang alone ------------------------------------------------------------------
if [ $cpu = 1 ]; then
  say "--cpu: no SGLang server venv; the backend uses the reference engine"
else
  make_venv .venv-sglang-server 0
  # Install spec $2 into the server venv unless the Python check $1 already passes there ($3: a note).
  server_package() {
    if .venv-sglang-server/bin/python -c "$1" 2>/dev/null; then
      say ".venv-sglang-server already has $2"
    else
      say "installing $2 into .venv-sglang-server${3:-}"
      install .venv-sglang-server "$2"
      done_lines+=("installed $2 into .venv-sglang-server")
    fi
  }
  server_package 'import sglang, sys; sys.exit(sglang.__version__ != "0.5.17")' "$SGLANG_SPEC" \
    " (large: torch, flashinfer, kernels)"
  server_package 'import sglang_router' "$ROUTER_SPEC"
  .venv-sglang-server/bin/python - <<'PY'
import importlib.util, sys
import sglang
if importlib.util.find_spec("art_sglang") is not None:
    sys.exit(".venv-sglang-server must not contain the project (art_sglang is importable there)")
print("  .venv-sglang-server: sglang", sglang.__version__, "OK, isolated from the project")
PY
fi

say "done (${#done_lines[@]} changes):"
for line in "${done_lines[@]}"; do say "  - $line"; done
cat <<EOF

Next:
  .venv/bin/python scripts/demo.py        # the demo: trains a tiny model, mean reward rises
  .venv/bin/python -m pytest              # the test suite
EOF
[ $cpu = 1 ] || echo "  (the backend finds $root/.venv-sglang-server/bin/python without configuration)"
