#!/usr/bin/env bash
# Issue 16 part 2 on ONE H200 (< 4 min): P9's collective op (NCCL in place + P7's Triton kernel, both shapes)
# and P12's ops (grouped-GEMM rows + Triton finalize) on CUDA, the rest of the parallel GPU tests, then
# tools/bench_p9_p12.py (fused vs composite, NCCL world 1). Results in $OUT/r/.
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/model_def/parallel/test_parallel_gpu.py \
    "tests/passes/kernels/test_moe_finalize.py::test_cuda_rows_and_triton_finalize_match_the_cpu_reference" \
    2>&1 | tail -15 | tee $R/gpu_pcomm_tests.txt
timeout 240 python3 tools/bench_p9_p12.py $R 2>&1 | grep -v Warning | tail -25
