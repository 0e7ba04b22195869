#!/usr/bin/env bash
# Print the machine a run happens on (CPU model, family/model, SIMD flags, cores, memory), so a red CI log or a
# benchmark figure always says where it ran. Linux only; prints what it can read and never fails.
set -u
cpu() { grep -m1 "^$1[[:space:]]*:" /proc/cpuinfo 2>/dev/null | sed 's/^[^:]*:[[:space:]]*//'; }
echo "machine: $(cpu 'model name') ($(cpu vendor_id), family $(cpu 'cpu family') model $(cpu model) stepping $(cpu stepping))"
flags=$(cpu flags)
simd=$(tr ' ' '\n' <<<"$flags" | grep -E '^(sse4_2|avx|avx2|fma|f16c|avx_vnni|avx512.*|amx.*)$' | tr '\n' ' ')
echo "machine: SIMD ${simd:-none reported}"
echo "machine: $(nproc 2>/dev/null || echo '?') cores usable, $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo 2>/dev/null) memory, $(uname -sr)$(grep -q hypervisor <<<"$flags" && echo ', virtual machine')"
if [ -x .venv/bin/python ]; then  # what PyTorch makes of it (its kernels' ISA level), once installed
  .venv/bin/python - <<'PY' 2>/dev/null || true
import torch
print(f"machine: torch {torch.__version__} CPU capability {torch.backends.cpu.get_cpu_capability()}, "
      f"{torch.get_num_threads()} threads, oneDNN {'on' if torch.backends.mkldnn.is_available() else 'off'}")
PY
fi
