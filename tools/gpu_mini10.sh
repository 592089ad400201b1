#!/usr/bin/env bash
# Issue 9, k3-mini-6b latent MoE launch sweep (helper mini10): one device call, <= 120 s.
#   1. tools/bench_moe10mini.py: k3-mini-6b MoE layer bf16 (latent path, shared expert in kernel C), batch 1, 8, 2, 4,
#      PDL on: today's launches vs moe_launch.ROWS_CANDIDATES (kernel A), LATENT_SPLIT_CANDIDATES (B'),
#      LATENT_CANDIDATES (C), one kernel at a time, then the best combination; op µs (CUDA-graph replays over 4 cycled
#      routings + weight copies), kernel µs and % of the same-run copy bandwidth, rel err; per batch the fastest arm
#      and the ROWS_TUNED / SPLIT_TUNED / LATENT_TUNED entries that make it the default
#      -> $OUT/mini10.md, $OUT/mini10.json (saved after every arm), $OUT/bench.log
#   2. the gpu test that every candidate matches the reference at that shape (batch 1, 8) -> $OUT/gpu_tests.log
#   run: bash tools/gpu_mini10.sh      (carry .whl/ as for the other gpu_*.sh)
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 86 python3 tools/bench_moe10mini.py $OUT 58 2>&1 | grep -v -i warn | tee $OUT/bench.log | grep -v '^{' | tail -60
timeout 24 python3 -m pytest -q -m gpu -p no:cacheprovider tests/passes/kernels/test_moe_launch_tables.py 2>&1 \
  | tee $OUT/gpu_tests.log | tail -6
