#!/usr/bin/env bash
# The Python 3.12 wheels a lent GPU machine lacks (the device tool's README: it has torch,
# triton, transformers, tokenizers, safetensors, pytest, httpx, numpy, jinja2, ... but not
# these), downloaded into .whl/ (git-ignored locally) at the versions this project is tested
# with. A device call then carries .whl and starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    msgspec==0.22.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 \
    pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 uvicorn==0.54.0 \
    gguf==0.19.0 openai==3.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
du -sh .whl
