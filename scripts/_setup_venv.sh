# Sourced by scripts/demo and scripts/test: create .venv next to the repository (once) and
# install multigpu into it. On a machine without CUDA the CPU build of torch is pinned
# (requirements/cpu.txt); with CUDA, torch comes from the user's usual index.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
extras="${1:-dev}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
stamp="$venv/.installed-$extras"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    constraints=()
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        constraints=(-c "$root/requirements/cpu.txt")
    fi
    "$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    # --no-compile: pip would compile every module of torch (two thirds of the set-up time);
    # Python compiles the modules that are imported instead, once, into the venv (below).
    "$venv/bin/python" -m pip install --quiet --no-compile "${constraints[@]}" -e "$root[$extras]"
    touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
unset PYTHONDONTWRITEBYTECODE  # the venv keeps the bytecode it compiles: later processes start faster
