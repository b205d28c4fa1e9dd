#!/usr/bin/env bash
# Create .venv (once, or again when pyproject.toml changes) and install specray into it.
# torch==2.13.0 goes first: on our machines it is a CPU build already on disk, whereas a
# bare "torch" requirement in a fresh venv would pull a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.specray-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$venv/bin/python" -m pip install -q "torch==${SPECRAY_TORCH_VERSION:-2.13.0}"
"$venv/bin/python" -m pip install -q -e "$root[test]"
echo "$want" > "$stamp"
