#!/usr/bin/env bash
# One device call for the scans' figures: GPU tests of both key formats and both v2 scans,
# then backend_batch.py on the tensor-core scan against the ALU scans in the same call (at 65,536,
# 2^20 and mainnet pages: where each wins, so where the dispatch sends a batch).
#   bash benchmarks/device_mma.sh tests|bench|ncu|variants|layout|wgmma|v1frag|v1alu|sustained|all   (CSVs and logs under $OUT)
# (ncu: LAYOUT=fragments profiles the scan over the fragments layout, NCU_KEYS the key counts;
#  KEY_FORMAT=v1 LAYOUT=fragments NCU_KERNEL=dpf_scan_v1_frag NCU_KEYS="96 24": the v1 scan of that layout;
#  NCU_DEFINE="V1_FRAG_ALU_KEYS=3 V1F_XOR_PREFETCH=0" profiles a kernel variant, as --define does for backend_batch.py;
#  NCU_METRICS adds metrics, e.g. the smsp__pcsamp_warps_issue_stalled_* counts docs/SCANS.md quotes)
set -u
export PYTHONUNBUFFERED=1
stage=${1:-all}
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
MAINNET=16817159
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$stage" = tests ] || [ "$stage" = all ]; then
    timeout ${TEST_LIMIT:-500} python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu_engine/test_cuda_backend.py \
        tests/gpu_engine/test_kernels_compile.py tests/gpu_engine/test_cuda_overlap.py tests/gpu_engine/test_cuda_placement.py ${TEST_K:+-k "$TEST_K"} 2>&1 | tail -25 | tee "$OUT/tests.log"
fi
[ "$stage" = tests ] && exit 0
if [ "$stage" = ncu ]; then  # what binds the tensor-core scan, 96 and 3 keys (docs/SCANS.md)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    ncu_defines=$(for d in ${NCU_DEFINE:-}; do printf -- '--define %s ' "$d"; done)  # NCU_DEFINE's items as options,
    ncu_tag=$(for d in ${NCU_DEFINE:-}; do printf -- '-%s' "$d"; done)  # and in the logs' names
    for keys in ${NCU_KEYS:-96 3}; do
        timeout 200 "$NCU" --clock-control none -k "regex:${NCU_KERNEL:-dpf_scan_(wg)?mma}" --launch-skip 1 --launch-count 1 \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --section Occupancy --section WarpStateStats --section LaunchStats --section InstructionStats \
            --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__t_sector_hit_rate.pct,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_imma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum${NCU_METRICS:+,$NCU_METRICS} \
            python3 benchmarks/profile_scan.py --pages 1048593 --domain-bits 25 --keys $keys --key-format ${KEY_FORMAT:-v2} \
            --v2-scan mma --layout ${LAYOUT:-pages} $ncu_defines \
            > "$OUT/ncu-mma-${LAYOUT:-pages}-k$keys$ncu_tag.log" 2>&1
        grep -E "Duration|Throughput|Pipe|Busy|Hit Rate|Occupancy|Registers|Shared Memory Config|dram__|lts__|alu|Stall|Warp Cycles|Eligible|Issued" \
            "$OUT/ncu-mma-${LAYOUT:-pages}-k$keys$ncu_tag.log" | head -60
    done
    exit 0
fi
if [ "$stage" = variants ]; then  # kernel alternatives (-D options a kernel reads) at mainnet
    for v in ${VARIANTS:?VARIANTS: the -D options to time, e.g. VARIANTS="V1F_XOR_PREFETCH=1 V1F_XOR_PREFETCH=2"}; do
        timeout 200 python3 benchmarks/backend_batch.py --backend cuda --pages $MAINNET --domain-bits 25 --gpu-matrix \
            --key-format v2 --v2-scan mma --q ${VARIANT_Q:-24,32,40} --repeat 3 --define $v \
            --dispatch=micro_batch=0,streams=1,graph=1 --out "$OUT/variant_$v.csv" 2>&1 | tail -3
    done
    exit 0
fi
bench() {  # bench NAME ARGS...
    timeout 300 python3 benchmarks/backend_batch.py --backend cuda --out "$OUT/$1.csv" "${@:2}" 2>&1 | tee "$OUT/$1.log"
}
G1=--dispatch=micro_batch=0,streams=1,graph=1
if [ "$stage" = layout ]; then  # v2 keys over the pages layout, the fragments layout's baseline (layout_*_pages.csv)
    bench layout_mainnet_pages --pages $MAINNET --domain-bits 25 --gpu-matrix --key-format v2 --q 8,32,58 --repeat 3 $G1
    bench layout_65536_pages --pages 65536 --domain-bits 16 --key-format v2 --q 1,8,16,32,42,58 --repeat 9 $G1
    exit 0
fi
if [ "$stage" = v1frag ]; then  # v1 keys over the fragments layout against the pages layout (v1frag_*.csv)
    V1M="--pages $MAINNET --domain-bits 25 --gpu-matrix --key-format v1 --repeat 3 $G1"
    bench v1frag_mainnet $V1M --layout fragments --q 1,8,16,32
    bench v1frag_mainnet_pages $V1M --layout pages --q 1,8,16,32
    bench v1frag_mainnet_prefetch_all $V1M --layout fragments --q 1,8,16 --define V1F_PREFETCH_MIN_GROUPS=1
    bench v1frag_mainnet_prefetch_none $V1M --layout fragments --q 16,32 --define V1F_PREFETCH_ROWS=0
    for layout in fragments pages; do
        bench v1frag_65536_$layout --pages 65536 --domain-bits 16 --key-format v1 --layout $layout \
            --q 1,8,16,32,48,64,74 --repeat 9 $G1
    done
    exit 0
fi
if [ "$stage" = v1alu ]; then  # v1 keys over the fragments layout, the default build: 1 and 2 queries on the ALU (launches of <= V1_FRAG_ALU_KEYS keys), 6 to 32 on the tensor cores (6-10: two key groups), the pages layout beside, 65,536 pages (v1alu_*.csv)
    V1M="--pages $MAINNET --domain-bits 25 --gpu-matrix --key-format v1 --repeat 5 $G1"
    bench v1alu_mainnet $V1M --layout fragments --q 1,2,6,8,10,16,32
    bench v1alu_mainnet_pages $V1M --layout pages --q 1,2
    bench v1alu_65536 --pages 65536 --domain-bits 16 --key-format v1 --layout fragments --q 1,32,74 --repeat 9 $G1
    for v in ${V1ALU_VARIANTS:-}; do  # e.g. V1ALU_VARIANTS="V1F_XOR_PREFETCH=1 V1F_XOR_PREFETCH=3": single queries of a variant
        bench "v1alu_mainnet_$v" $V1M --layout fragments --q 1 --define "$v"
    done
    exit 0
fi
if [ "$stage" = sustained ]; then  # v1 keys over the fragments layout at mainnet, each Q back to back for 5 s: the steady rate under the power cap, with the SM clock and power (sustained_mainnet.csv)
    timeout 300 python3 benchmarks/sustained.py --backend cuda --pages $MAINNET --domain-bits 25 --gpu-matrix \
        --key-format v1 --layout fragments --q ${SUSTAINED_Q:-8,32,1,8,6,10} --seconds 5 \
        --out "$OUT/sustained_mainnet.csv" 2>&1 | tee "$OUT/sustained_mainnet.log"
    exit 0
fi
if [ "$stage" = wgmma ]; then  # Hopper's warpgroup products against mma.sync, fragments layout (wgmma_*.csv)
    bench wgmma_mainnet_on --pages $MAINNET --domain-bits 25 --gpu-matrix --key-format v2 --layout fragments \
        --wgmma on --q ${WGMMA_Q:-1,8,16,32,42,58,64,74} --repeat 3 $G1
    bench wgmma_mainnet_off --pages $MAINNET --domain-bits 25 --gpu-matrix --key-format v2 --layout fragments \
        --wgmma off --q ${WGMMA_OFF_Q:-8,32,58} --repeat 3 $G1
    for w in on off; do
        bench wgmma_65536_$w --pages 65536 --domain-bits 16 --key-format v2 --layout fragments --wgmma $w \
            --q 1,8,16,32,42,58,74 --repeat 9 $G1
    done
    exit 0
fi
Q=1,2,4,8,12,16,24,32,42,48,58
SMALL=1,2,3,4,6,8
bench v2mma_mainnet --pages $MAINNET --domain-bits 25 --gpu-matrix --key-format v2 --v2-scan mma --q $Q --repeat 3 $G1
bench v2alu_mainnet --pages $MAINNET --domain-bits 25 --gpu-matrix --key-format v2 --v2-scan alu --q 1,2,4,8,12,16,32 --repeat 3 $G1
bench v1_mainnet --pages $MAINNET --domain-bits 25 --gpu-matrix --key-format v1 --q 1,8,32 --repeat 3 $G1
bench v2mma_1048576 --pages 1048576 --domain-bits 20 --gpu-matrix --key-format v2 --v2-scan mma --q $SMALL,12,16 --repeat 5 $G1
bench v2alu_1048576 --pages 1048576 --domain-bits 20 --gpu-matrix --key-format v2 --v2-scan alu --q $SMALL,12,16 --repeat 5 $G1
bench v2mma_65536 --pages 65536 --domain-bits 16 --key-format v2 --v2-scan mma --q $SMALL,12,16,24,32,42,48,58 --repeat 9 $G1
bench v2alu_65536 --pages 65536 --domain-bits 16 --key-format v2 --v2-scan alu --q $SMALL,16,32 --repeat 9 $G1
bench v1_65536 --pages 65536 --domain-bits 16 --key-format v1 --q 1,8,32 --repeat 9 $G1
