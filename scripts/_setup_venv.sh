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
    # --no-compile: pip would compile all of torch, most of which is never imported (two thirds of
    # the set-up time). Instead two processes compile, side by side, what the training processes
    # and the tests import, so that the many processes started next do not each compile it again.
    "$venv/bin/python" -m pip install --quiet --no-compile "${constraints[@]}" -e "$root[$extras]"
    compile_imports() { PYTHONDONTWRITEBYTECODE='' "$venv/bin/python" -c "$(printf 'import %s\n' "$@")"; }
    compile_imports torch.distributed.fsdp torch.distributed.checkpoint torch._inductor.compile_fx \
        torch.nn.parallel multigpu.session multigpu.cli.main &
    torch_side=$!
    compile_imports sklearn.datasets matplotlib.pyplot rich.table pytest hypothesis
    wait "$torch_side"
    touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
unset PYTHONDONTWRITEBYTECODE  # Python caches the bytecode of what else is imported, in the venv
