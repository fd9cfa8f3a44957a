#!/usr/bin/env bash
# Install moetier on a Jetson Orin and run `moetier serve` as a systemd service.
#
#   sudo deploy/jetson/install.sh --model /nvme/models/qwen3-30b-a3b.gguf --store /nvme/models/qwen3.experts
#
# Steps: checks the board (JetPack 6 = L4T R36, CUDA 12.2-12.6, an Orin module; JetPack 5 and other
# machines are refused), the memory and swap (swap on eMMC is a cliff), where the model and store
# live (an NVMe: its O_DIRECT read rate is measured; eMMC, SD cards and USB disks are warned about),
# builds moetier for the Orin's GPU (sm_87) into a virtual environment with the board's own CUDA,
# writes the settings to /etc/moetier/moetier.env and a unit /etc/systemd/system/moetier.service
# (restart on failure, locked memory allowed for the dense weights), and starts it. nvpmodel and
# jetson_clocks are advised, never run. --dry-run prints every step, command and file and changes
# nothing.
#
# Tests: MOETIER_JETSON_ROOT points the reads of /proc, /sys and /etc at a fake tree, and
# MOETIER_JETSON_STORAGE names the block device the model lives on (tests/test_jetson_deploy.py).
set -euo pipefail

root=${MOETIER_JETSON_ROOT:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source_dir=$(cd "$here/../.." && pwd)
prefix=/opt/moetier
etc_dir=/etc/moetier
unit_file=/etc/systemd/system/moetier.service
model=""
store=""
cache=auto
host=127.0.0.1
port=8080
extra=""
dry_run=0
service=1
min_read_mbps=500

usage() {
    cat <<EOF
usage: $0 --model GGUF [--store DIR] [--cache SIZE|auto] [--host ADDR] [--port N]
          [--extra "SERVE ARGS"] [--prefix DIR] [--source DIR] [--no-service] [--dry-run]

  --model GGUF     the model moetier serves (on an NVMe)
  --store DIR      its expert store (written by moetier pack), if any
  --cache SIZE     expert cache size, e.g. 6G, or auto: what unified memory leaves once the dense
                   weights, KV cache and compute buffers are loaded (default: auto)
  --host ADDR      address the server binds (default: 127.0.0.1)
  --port N         its port (default: 8080)
  --extra ARGS     more moetier serve / llama-server options, e.g. "-ngl 99 -c 8192"
  --prefix DIR     where the virtual environment goes (default: /opt/moetier)
  --source DIR     the moetier checkout to build (default: the one this script is in)
  --no-service     build and install only: no env file, no systemd unit
  --dry-run        print every step, command and file, change nothing
EOF
}

die() {
    echo "error: $*" >&2
    exit 1
}

warn() {
    echo "warning: $*" >&2
}

step() {
    echo "==> $*"
}

# run a command, or print it under --dry-run
run() {
    if [ "$dry_run" = 1 ]; then
        echo "would run: $*"
    else
        echo "+ $*"
        "$@"
    fi
}

# write stdin to a file, or print it under --dry-run
write_file() {
    local path=$1 text
    text=$(cat)
    if [ "$dry_run" = 1 ]; then
        echo "would write $path:"
        printf '%s\n' "$text" | sed 's/^/    /'
    else
        mkdir -p "$(dirname "$path")"
        printf '%s\n' "$text" >"$path"
        echo "wrote $path"
    fi
}

while [ $# -gt 0 ]; do
    case $1 in
        --model) model=${2:?--model needs a path}; shift 2 ;;
        --store) store=${2:?--store needs a path}; shift 2 ;;
        --cache) cache=${2:?--cache needs a size}; shift 2 ;;
        --host) host=${2:?--host needs an address}; shift 2 ;;
        --port) port=${2:?--port needs a number}; shift 2 ;;
        --extra) extra=${2?--extra needs options}; shift 2 ;;
        --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
        --source) source_dir=${2:?--source needs a directory}; shift 2 ;;
        --no-service) service=0; shift ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option '$1'" ;;
    esac
done

[ -n "$model" ] || { usage >&2; die "--model is required"; }
[ -f "$model" ] || die "--model $model: no such file"
[ -z "$store" ] || [ -f "$store/manifest.json" ] || die "--store $store: not an expert store (no manifest.json; write one with moetier pack)"
[[ $port =~ ^[0-9]+$ ]] && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] || die "--port $port: not a port number"
[[ $cache == auto || $cache =~ ^[0-9]+(\.[0-9]+)?[KMGkmg]?$ ]] || die "--cache $cache: expected a size such as 6G, or auto"
[ -f "$source_dir/pyproject.toml" ] || die "--source $source_dir: not a moetier checkout (no pyproject.toml)"
if [ "$dry_run" = 0 ] && [ "$(id -u)" != 0 ]; then
    die "run as root (it writes $prefix, $etc_dir and $unit_file), or with --dry-run to see what it would do"
fi

# ---- the board -------------------------------------------------------------------------------
step "board"
board=""
if [ -r "$root/proc/device-tree/model" ]; then
    board=$(tr -d '\0' <"$root/proc/device-tree/model")
fi
case $board in
    *Orin*) ;;
    *Jetson*) die "$board: not an Orin module; moetier supports Jetson Orin (Nano, NX, AGX) on JetPack 6" ;;
    "") die "not a Jetson ($root/proc/device-tree/model is missing); on other machines install with: pip install $source_dir" ;;
    *) die "$board: not a Jetson; on other machines install with: pip install $source_dir" ;;
esac
release_file=$root/etc/nv_tegra_release
[ -r "$release_file" ] || die "$release_file is missing: JetPack (L4T) not installed?"
# "# R36 (release), REVISION: 4.3, GCID: ..., BOARD: generic, EABI: aarch64, DATE: ..."
l4t_major=$(sed -n 's/^# R\([0-9]*\) (release).*/\1/p' "$release_file" | head -n 1)
l4t_rev=$(sed -n 's/.*REVISION: \([0-9.]*\).*/\1/p' "$release_file" | head -n 1)
[ -n "$l4t_major" ] && [ -n "$l4t_rev" ] || die "$release_file: no '# R<major> (release), REVISION: <rev>' line"
l4t="R$l4t_major.$l4t_rev"
case $l4t_major in
    36) ;;
    34 | 35) die "L4T $l4t is JetPack 5 (CUDA 11.4): not supported; moetier needs JetPack 6 (L4T R36, CUDA 12.2-12.6): upgrade with NVIDIA's SDK Manager or flash a JetPack 6 image" ;;
    *) die "L4T $l4t: not supported; moetier needs JetPack 6 (L4T R36, CUDA 12.2-12.6)" ;;
esac
cuda_json=$root/usr/local/cuda/version.json
[ -r "$cuda_json" ] || die "$cuda_json is missing: the CUDA toolkit is not installed (sudo apt install nvidia-jetpack)"
cuda=$(sed -n 's/.*"cuda"[^}]*"version" *: *"\([0-9]*\.[0-9]*\)[^"]*".*/\1/p' "$cuda_json" | head -n 1)
if [ -z "$cuda" ]; then
    # the file spans lines: join them first
    cuda=$(tr -d '\n' <"$cuda_json" | sed -n 's/.*"cuda" *: *{[^}]*"version" *: *"\([0-9]*\.[0-9]*\)[^"]*".*/\1/p')
fi
[ -n "$cuda" ] || die "$cuda_json: no CUDA version in it"
case $cuda in
    12.2 | 12.3 | 12.4 | 12.5 | 12.6) ;;
    *) die "CUDA $cuda ($cuda_json): moetier on a Jetson is built and supported with JetPack 6's CUDA 12.2-12.6" ;;
esac
echo "$board, L4T $l4t (JetPack 6), CUDA $cuda, GPU sm_87"

# ---- memory and swap -------------------------------------------------------------------------
step "memory"
meminfo=$root/proc/meminfo
[ -r "$meminfo" ] || die "$meminfo is missing"
mem_kib() { awk -v k="$1:" '$1 == k { print $2 }' "$meminfo"; }
total_kib=$(mem_kib MemTotal)
avail_kib=$(mem_kib MemAvailable)
[ -n "$total_kib" ] && [ -n "$avail_kib" ] || die "$meminfo: no MemTotal or MemAvailable line"
gib() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1048576 }'; }
echo "unified memory: $(gib "$total_kib") GiB, $(gib "$avail_kib") GiB available now (CPU and GPU share it)"
if [ -r "$root/proc/swaps" ]; then
    while read -r dev _; do
        case $dev in
            Filename | "") ;;
            /dev/mmcblk* | *mmcblk*) warn "swap on $dev (eMMC or SD card): once the model swaps, decoding falls from tens of tokens per second to under 2; turn it off (sudo swapoff $dev) and let the expert cache stream from the NVMe instead" ;;
            /dev/zram*) ;;
            *) echo "swap: $dev (a safety net only: the expert cache, not swap, should hold what does not fit)" ;;
        esac
    done <"$root/proc/swaps"
fi

# ---- storage ---------------------------------------------------------------------------------
step "storage"
# the block device a path lives on: nvme0n1p1, mmcblk0p1, sda1, ...
device_of() {
    if [ -n "${MOETIER_JETSON_STORAGE:-}" ]; then
        echo "$MOETIER_JETSON_STORAGE"
        return
    fi
    basename "$(findmnt -n -o SOURCE --target "$1" 2>/dev/null || echo unknown)"
}
# its kind: nvme, emmc, sd, usb or other
kind_of() {
    local dev=$1 disk
    case $dev in
        nvme*) echo nvme ;;
        mmcblk*)
            disk=${dev%%p[0-9]*}
            if [ "$(cat "$root/sys/block/$disk/device/type" 2>/dev/null)" = SD ]; then echo sd; else echo emmc; fi
            ;;
        sd*)
            disk=${dev%%[0-9]*}
            if readlink -f "$root/sys/block/$disk" 2>/dev/null | grep -q /usb; then echo usb; else echo other; fi
            ;;
        *) echo other ;;
    esac
}
for path in "$model" ${store:+"$store/experts.bin"}; do
    [ -e "$path" ] || continue
    dev=$(device_of "$path")
    kind=$(kind_of "$dev")
    case $kind in
        nvme) echo "$path: on $dev (NVMe)" ;;
        emmc) warn "$path is on $dev, the eMMC: expert reads there run at a few hundred MB/s at best; move the model and store to an NVMe" ;;
        sd) warn "$path is on $dev, an SD card: streaming experts from it is hopeless (tens of MB/s); move the model and store to an NVMe" ;;
        usb) warn "$path is on $dev, a USB disk: expert reads are limited by the USB link; an NVMe is several times faster" ;;
        *) warn "$path is on $dev: not an NVMe; expert streaming runs at this disk's speed" ;;
    esac
done
read_from=${store:+$store/experts.bin}
read_from=${read_from:-$model}
if [ "$dry_run" = 1 ]; then
    echo "would measure the O_DIRECT read rate of $read_from: dd if=$read_from of=/dev/null bs=8M count=64 iflag=direct"
else
    rate=$(dd if="$read_from" of=/dev/null bs=8M count=64 iflag=direct 2>&1 | awk '/copied/ { print $(NF-1), $NF }')
    echo "O_DIRECT read rate of $read_from: ${rate:-unknown}"
    case ${rate:-} in
        *kB/s | *MB/s)
            mbps=${rate%% *}
            if [ "${rate##* }" = kB/s ] || awk -v r="$mbps" -v m="$min_read_mbps" 'BEGIN { exit !(r < m) }'; then
                warn "the disk reads at $rate: experts that miss the cache wait on it; HOBBIT's Orin numbers came from an NVMe at ~3 GB/s"
            fi
            ;;
    esac
fi

# ---- the cache budget ------------------------------------------------------------------------
step "expert cache"
model_bytes=$(stat -c %s "$model")
echo "model file: $(awk -v b="$model_bytes" 'BEGIN { printf "%.1f", b / 1073741824 }') GiB"
if [ "$cache" = auto ]; then
    echo "cache: auto. At load moetier takes MemAvailable (the GPU allocates from the same memory on an"
    echo "Orin), subtracts the dense weights, the KV cache and the compute buffers, and caches experts in the"
    echo "rest; \`moetier stats\` and the server's /metrics show the budget it chose and the hit rate."
    echo "Leave room for other programs with --extra \"--cache-reserve 1G\"."
else
    echo "cache: $cache (given)"
fi

# ---- build -----------------------------------------------------------------------------------
step "build (sm_87, CUDA $cuda)"
venv=$prefix/venv
run python3 -m venv "$venv"
run "$venv/bin/pip" install --upgrade pip
# GGML_CUDA_NO_VMM: the Orin's driver refuses ggml's virtual memory pool (allocation errors);
# FORCE_MMQ: the quantized matmul kernels, faster than cuBLAS at an Orin's batch sizes
run env CUDACXX=/usr/local/cuda/bin/nvcc "$venv/bin/pip" install "$source_dir" \
    -C cmake.define.MOETIER_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=87 \
    -C cmake.define.GGML_CUDA_NO_VMM=ON -C cmake.define.GGML_CUDA_FORCE_MMQ=ON
# the build sees the GPU: CUDA0 (Orin) in the list
run "$venv/bin/moetier" tool llama-server --list-devices

# ---- the service -----------------------------------------------------------------------------
if [ "$service" = 1 ]; then
    step "service"
    write_file "$etc_dir/moetier.env" <<EOF
# moetier serve's settings (read by $unit_file); restart with: sudo systemctl restart moetier
MOETIER_MODEL=$model
MOETIER_STORE=$store
MOETIER_CACHE=$cache
MOETIER_HOST=$host
MOETIER_PORT=$port
MOETIER_EXTRA=$extra
EOF
    write_file "$unit_file" <<EOF
[Unit]
Description=moetier serve (OpenAI-compatible server with an SSD-backed expert cache)
After=network-online.target local-fs.target
Wants=network-online.target

[Service]
EnvironmentFile=$etc_dir/moetier.env
# \$\$: a dollar for the shell (systemd expands single ones itself, and knows no \${VAR:+...})
ExecStart=/bin/sh -c 'exec $venv/bin/moetier serve -m "\$\$MOETIER_MODEL" \$\${MOETIER_STORE:+--store "\$\$MOETIER_STORE"} --cache "\$\$MOETIER_CACHE" --host "\$\$MOETIER_HOST" --port "\$\$MOETIER_PORT" \$\$MOETIER_EXTRA'
Restart=on-failure
RestartSec=5
# the dense weights may be locked in memory (lock_weights): allow it
LimitMEMLOCK=infinity
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
EOF
    run systemctl daemon-reload
    run systemctl enable --now moetier
    echo "the server answers on http://$host:$port/v1 once the model is loaded (journalctl -u moetier -f)"
    if [ "$host" != 127.0.0.1 ] && [ "$host" != localhost ]; then
        warn "the server binds $host and has no authentication: keep it on a private network"
    fi
fi

# ---- advice ----------------------------------------------------------------------------------
step "power and memory (advice: nothing here was changed)"
echo "  sudo nvpmodel -m 0 && sudo jetson_clocks   # MAXN power mode and fixed clocks; 3-4x slower without"
echo "  sudo systemctl set-default multi-user.target   # no desktop: about 1.5 GB more for the cache"
