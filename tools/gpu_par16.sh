#!/usr/bin/env bash
# Issue 16 on ONE H200 (< 3 min): NCCL with world size 1 through the parallel code paths (k3 collectives,
# a rank model vs the whole model, DCP partial attention + LSE merge on CUDA, P9's collective op), the
# gloo LSE-merge tests, and a rank launch through runtime/parallel/launch.py with NCCL (spawn).
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/model_def/parallel/test_parallel_gpu.py \
    tests/model_def/parallel/test_lse_merge.py 2>&1 | tail -15 | tee $OUT/gpu_par16_tests.txt
timeout 40 python3 tools/nccl_launch_check.py 1 2>&1 | grep -v Warning | tail -3 | tee -a $OUT/gpu_par16_tests.txt
timeout 20 k3compile plan --model k3-mini-6b --gpus 2 --gpu-memory 141GB 2>&1 | tee $OUT/plan_mini6b_2gpu.txt
