#!/usr/bin/env bash
# bench/gpu_check.py on a GPU machine that has python3 with torch (CUDA), accelerate and peft but no network, from
# wheels carried in the repository's .whl/ folder (git-ignored; about 25 MB).
#
#   bench/gpu_check.sh fetch            # here, with a package registry: fill .whl/ (builds deepspeed's wheel, ~1 min,
#                                       # with $PYTHON, default .venv/bin/python: it needs torch)
#   bench/gpu_check.sh [OUT_DIR] [ARGS] # there: install .whl/ into /tmp/site, run the check (ARGS go to gpu_check.py)
#
# transformers 5.24.0, not 5.25: on the H200 image 5.25 asked for the `kernels` package (BENCHMARKS.md section 7).
# deepspeed is on the registry as source only: its wheel is built here without ops (ZeRO-3 needs none of them).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == fetch ]]; then
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
    python=${PYTHON:-.venv/bin/python}
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        trl==1.16.0 transformers==5.24.0 datasets==5.2.0 huggingface_hub==2.4.0 tokenizers==0.23.3 \
        safetensors==0.8.0 dill==0.4.1 multiprocess==0.70.19 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
        hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    "$python" -m pip download -q --no-deps --no-binary=:all: -d .whl/sdist deepspeed==0.19.8
    DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w .whl .whl/sdist/deepspeed-0.19.8.tar.gz
    rm -r .whl/sdist
    du -sh .whl
    exit 0
fi

out=${1:-${OUT:-bench/results/gpu_check}}
shift || true
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export DS_ACCELERATOR=cuda  # the deepspeed wheel was built on a machine without a GPU
python3 -c "import torch, transformers, trl, accelerate; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
    'transformers', transformers.__version__, 'trl', trl.__version__, 'accelerate', accelerate.__version__)"
mkdir -p "$out"
set -o pipefail
python3 bench/gpu_check.py "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
