#!/usr/bin/env bash
# Session 14, helper bs8k14 (issue 9): Kimi-Linear-48B at batch 8, 250 kernels a step (9.3 a layer) -> <= 216 (8).
# Where the 42 kernels more than at batch 1 come from (traces/h200_s13/call2, engine-after, 208 -> 250):
#   28  cuBLAS split-K GEMM + splitKreduce pairs: the 27 KDA/MLA o_proj (2304 x 4096) and the dense down (2304 x 9216),
#       which P8's GEMV covers only up to M = 2 / 1 (the rows tile; above it k3.gemv runs aten.mm). The engine-before
#       trace (r04, batch 1) has 28 splitKreduce_kernel a step: 27 nvjet 64x8 splitK + 1 nvjet 128x8 splitK
#   14  MLA W_UV at batch > 4 (kernels.mla_decode.OUT_MAX_TOKENS): plain merge + cuBLAS bmm + the flatten's copy
#       (+7 GEMM, +7 copy kernels) where the merge + W_UV kernel is one launch at batch <= 4
# The options (both OFF by default), as --variant arms of one 48B ladder at batch 1 and 8, timed interleaved with
# engine-after and gated by the ladder's pinned accuracy gate:
#   v-up    p08_small_m_gemm.upper_tier=true: k3.gemv gets a second configuration above the M = 1 winner's reach
#           (measured at build time like the first; upper_min_gain -0.03). On the recorded timings of sessions 12-13
#           the o_proj and down get the split-K dot tile 64x128x8 up to M = 8-16: -28 kernels at batch 8 expected
#   v-w8    p15_mla_decode.w_uv_max_tokens=8: the whole-row merge + W_UV kernel at batch 8: -14 kernels expected
#   v-both  both: 250 -> 208 expected at batch 8; batch 1 unchanged (208; the options act above M = 2 / 4 only)
#   EXTRA_VARIANTS="name:pass.opt=v,... ..." adds arms (session 14's next call: P8 rows_programs and P6 latent_prewait +
#   down_early_release, see traces/h200_s14/README.md; raise TL by ~25 s per batch size and variant)
#   UP3=1 adds v-up3 (upper_tier with upper_min_gain 0.03: the first tier's margin; the o_proj may stay cuBLAS at 8)
# Then: kernels/step per arm and batch from the ladder JSON, and the GEMM / copy kernel names per step in the batch-8
# traces of engine-after and the variants (splitKreduce, nvjet, gemv, merge, copy); with TESTS=1 the GPU tests.
#   run: bash tools/gpu_bs8k14.sh   (carry .whl/ as for the other gpu_*.sh); TL=185 (the ladder's time budget; session
#        13 call 1's 48B ladder at batch 1,8 with 3 variants, same arm count, ran 170 s): ~200 s in all.
#        TESTS=1 adds the GPU tests of both options after the ladder (~60-90 s, TEST_EACH=90 per file)
# Back in $OUT: ladder_kimi-linear-48b_bf16.{md,json,png}, call.log, kernels.txt, logs.tar (ladder.log, tests.log)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
mkdir -p $OUT/logs
P8=p08_small_m_gemm; P15=p15_mla_decode
VARIANTS="up:$P8.upper_tier=true w8:$P15.w_uv_max_tokens=8 both:$P8.upper_tier=true,$P15.w_uv_max_tokens=8"
[ "${UP3:-0}" = 1 ] && VARIANTS="$VARIANTS up3:$P8.upper_tier=true,$P8.upper_min_gain=0.03"
VARIANTS="$VARIANTS ${EXTRA_VARIANTS:-}"  # more arms in the same run, e.g. k3-mini's winners (traces/h200_s14/README.md)
VARGS=(); for v in $VARIANTS; do VARGS+=(--variant "$v"); done
timeout $(( ${TL:-185} + 25 )) k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 1,8 \
  --context 512 --device cuda --quick --time-budget ${TL:-185} --keep-traces all "${VARGS[@]}" --out $OUT/l48 \
  > $OUT/logs/ladder.log 2>&1
say "ladder: exit $?"
python3 - $OUT/l48 > $OUT/kernels.txt 2>&1 <<'EOF'
import collections, glob, gzip, json, os, re, sys
root = sys.argv[1]
doc = json.load(open(glob.glob(os.path.join(root, "ladder_*.json"))[0]))
print("arm                    batch   ms     kernels/step  per layer  GEMM  copy  other")
for r in doc["results"]:
    if r["arm"].startswith(("r16", "r14", "v-")) and r.get("status") == "ok":
        c = r.get("kernels_by_category") or {}
        print(f"{r['arm']:<22} {r['batch']:>5} {r['median_ms']:7.3f} {r.get('kernels_per_step')!s:>12} "
              f"{r.get('kernels_per_layer') or 0:9.1f} {c.get('GEMM')!s:>5} {c.get('copy')!s:>5} {c.get('other')!s:>5}")
# kernel names per step in the batch-8 traces (GEMM-ish and copy-ish only)
profiled = {r["arm"]: r.get("profiled_steps") for r in doc["results"] if r["batch"] == 8}
pat = re.compile(r"splitk|nvjet|gemv|gemm|merge|copy|elementwise|index", re.I)
for path in sorted(glob.glob(os.path.join(root, "traces", "*_bs8.json.gz"))):
    arm = re.sub(r".*bf16_(.*)_bs8\.json\.gz", r"\1", path)
    if not arm.startswith(("r16", "v-")):
        continue
    tr = json.load(gzip.open(path))
    ev = [e for e in tr.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    steps = max(1, profiled.get(arm) or 3)
    names = collections.Counter(re.sub(r"<.*", "", e["name"])[:70] for e in ev if pat.search(e["name"]))
    print(f"== {arm} (batch 8, {steps} steps): " + "; ".join(f"{n / steps:g} {k}" for k, n in names.most_common(12)))
EOF
say "kernels: exit $?"
mv $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
for md in $OUT/ladder_*.md; do grep -E "^\| (arm|r04|r09|r1[46]|v-)|^- (batch|routing|tolerance|v-)" "$md" | cut -c1-220; done
cat $OUT/kernels.txt
grep -E "upper|w_uv_max" $OUT/logs/ladder.log | head -5
if [ "${TESTS:-0}" = 1 ]; then
  run_gpu_tests ${TEST_EACH:-90} \
    "tests/passes/test_p08_small_m_gemm.py::upper_tier" \
    "tests/passes/kernels/test_mla_decode.py::w_uv or output_gate"
fi
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"
