#!/usr/bin/env bash
# The SGLang test environment: a venv with SGLang, the torch and transformers it pins, megatron-core,
# and megarl's own dependencies (megarl itself is not installed in it: the caller puts its clone
# on PYTHONPATH, so a reused environment always runs the clone's code).
#
#   tools/sglang_env.sh            # build it if missing; print its python on the last line
#
# The pins are docker/requirements-gpu.txt's (the GPU image's), so the CPU tests exercise the
# SGLang the GPU image runs.  The environment lives outside the clone, under
# $MEGARL_SGLANG_ENVS (default ~/.cache/megarl/sglang-envs), in a directory named by a hash of
# everything that decides its contents (the Python, the pins, setup.py's requirements): a later
# run on the same machine reuses it, and a changed pin builds a new one.  The first build takes
# about 8.5 minutes and 11 GB.  It is built in <dir>.partial and renamed when complete, so an
# interrupted build is never taken for a finished one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
reqs="$root/docker/requirements-gpu.txt"
py=${PYTHON:-python3}

pin() {  # the exact pin of $1 in requirements-gpu.txt, or a clear error
  local line
  line=$(grep -E "^$1==" "$reqs" | sed 's/[[:space:]]*#.*//' | head -n1 || true)
  if [ -z "$line" ]; then
    echo "tools/sglang_env.sh: $reqs has no '$1==<version>' pin" >&2
    exit 2
  fi
  echo "$line"
}
pins="$(pin sglang) $(pin torch) $(pin transformers) $(pin megatron-core)"

# megarl's requirements (install_requires and the dev extra), read from setup.py without running it;
# torch, transformers and megatron-core come from the pins above
deps=$("$py" - "$root/setup.py" <<'EOF'
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
pinned = ("torch", "transformers", "megatron-core")
reqs = [r for r in kw["install_requires"] + kw["extras_require"]["dev"]
        if not any(r == p or r.startswith(p) and not r[len(p)].isalnum() and r[len(p)] not in "-_" for p in pinned)]
print(" ".join(reqs))
EOF
)

key=$(printf '%s\n' "$("$py" -c 'import sys; print(sys.version)')" "$pins" "$deps" | sha256sum | cut -c1-16)
base=${MEGARL_SGLANG_ENVS:-$HOME/.cache/megarl/sglang-envs}
env_dir="$base/$key"
if [ -x "$env_dir/bin/python" ] && [ -f "$env_dir/READY" ]; then
  echo "SGLang test environment: reusing $env_dir ($pins)" >&2
  echo "$env_dir/bin/python"
  exit 0
fi

mkdir -p "$base"
partial="$env_dir.partial"
rm -rf "$partial"
echo "SGLang test environment: building $env_dir ($pins; about 8.5 minutes and 11 GB the first time)" >&2
step() { echo "tools/sglang_env.sh: step '$1' failed; the partial environment is left in $partial" >&2; exit 1; }
"$py" -m venv "$partial" || step "python -m venv"
# shellcheck disable=SC2086  # the pins and requirements are words
"$partial/bin/pip" install -q $pins $deps >&2 || step "pip install $pins"
"$partial/bin/python" -c "import sglang, megatron.core, transformers, torch" >&2 || step "import sglang"
printf '%s\n' "$pins" "$deps" > "$partial/READY"
# a venv's scripts name its directory: build under the final name's parent, then move in one rename,
# and rewrite the shebangs and activate scripts that still say .partial
grep -rlF "$partial" "$partial/bin" 2>/dev/null | xargs -r sed -i "s#$partial#$env_dir#g"
sed -i "s#$partial#$env_dir#g" "$partial/pyvenv.cfg" 2>/dev/null || true
rm -rf "$env_dir"
mv "$partial" "$env_dir"
echo "$env_dir/bin/python"
