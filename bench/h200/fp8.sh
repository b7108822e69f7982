#!/usr/bin/env bash
# FP8 on Hopper (issue 39), on one H200, one part per call (pass the commit: MOE_GIT_COMMIT=$(git rev-parse HEAD)).
#   bench/h200/fp8.sh parity   # 300-step loss parity bf16 vs fp8_rowwise at both widths, on real tokens
#   bench/h200/fp8.sh memory   # peak memory and speed, bf16 vs FP8 (every expert GEMM), paper and OLMoE width
#   bench/h200/fp8.sh layer    # paper width: the layer bf16 vs FP8, kernel profiles of both, the step under the default rule,
#                                  # and a 300-step parity at lr 1e-4 (routing that does not collapse)
#   bench/h200/fp8.sh sweep    # OLMoE width, 8 layers: every expert GEMM FP8 vs bf16 at micro 1/2/4 (512/1,024/2,048 rows
#                                  # per expert), and the paper width's peak breakdown at micro 1, seq 8192, random routing
#   bench/h200/fp8.sh rule     # the candidate rule (fp8_min_dim 1024: 1,024 rows per expert) against bf16 at OLMoE width,
#                                  # with FP8 dense projections too, and the paper stage's peak with bf16 expert-gradient accumulation
#   bench/h200/fp8.sh small    # the expert layer alone, FP8 vs bf16, at widths below the paper's (1,024 and 2,048 rows per
#                                  # expert), and the FP8 peak breakdown with every site listed
#   bench/h200/fp8.sh rule2    # the default rule (fp8_min_dim 1024; 2,048 rows below width 4096) against bf16 at OLMoE
#                                  # width and at a narrow width (d=1024, 64 experts of 1024)
#   bench/h200/fp8.sh rule3    # the narrow width at 2,048 rows under the default rule (two pairs), the paper width's peak
#                                  # breakdown at micro 1 after freeing dgrad's rows early, then the paper FP8 stage
#   bench/h200/fp8.sh rule4    # OLMoE width at 2,048 rows under the default rule (its down projection, 2048x1024, in bf16)
#   bench/h200/fp8.sh final    # the default rule as shipped against bf16: OLMoE width and d = h = 1024 at 2,048 rows
#   bench/h200/fp8.sh final2   # the default rule against today's best bf16 step (optim.expert_wgrad=paired, train.cuda_graph):
#                                  # FP8 eager (gemm, paired) and graphed (paired), bf16 graphed (paired) and eager, OLMoE width
#                                  # and d = h = 1024
#   bench/h200/fp8.sh paperab  # on an 80 GiB card: the paper's width at one layer, FP8 against bf16 (graphed, pairs) three
#                                  # times each alternating, then the expert layer alone bf16 against FP8
#   bench/h200/fp8.sh accum1   # one micro-batch per step (micro 4 x accum 1): the paper-width layer alone with new and the same
#                                  # weights, then FP8 against bf16 steps (graphed, pairs) at paper (x3) and OLMoE width (x2)
#   bench/h200/fp8.sh wgrad8   # the FP8 weight gradient accumulating in its GEMM: kernel sweep, then paper and OLMoE width steps
#   bench/h200/fp8.sh sinkab   # FP8 wgrad in the sink on/off at paper and OLMoE width, then the lr 1e-4 paper parity pair
#   bench/h200/fp8.sh quant    # the wgrad operands' column quantisation: launch sweep against the previous kernel, then the layer
set -uo pipefail
source "$(dirname "$0")/lib.sh"
# The paper-width expert layer alone at 16,384 tokens, bf16 against every GEMM in FP8: new weights before every call
# (FP8 remakes its weight copies every call: one micro-batch per step), then the same weights (copies made once).
paper_layer_weights() {
  run python3 -m bench.layer --shape 4096,4096,64,4 --tokens 16384 --peers ours,ours_fp8_all --iters 20
  run python3 -m bench.layer --shape 4096,4096,64,4 --tokens 16384 --peers ours,ours_fp8_all --iters 20 --same-weights
}
case "${1:-}" in
  parity)
    # The corpus: 8 MB of the Python standard library's source, a 4,096-entry BPE (bench/NOTES.md).
    if [ ! -f /tmp/ptok/manifest.json ]; then
      (cd bench/paper && python3 -m pipeline.cli paper tokenize --set tokenize.vocab_size=4096 \
        --set tokenize.max_bytes=8000000 --set tokenize.output=/tmp/ptok 2>&1 | tail -2)
    fi
    for width in paper olmoe; do
      if [ "$width" = paper ]; then shape=(--preset paper-8l --layers 2); else shape=(--preset olmoe-1b-7b --layers 8); fi
      for recipe in bf16 fp8_rowwise; do
        rm -rf "/tmp/parity/$width-$recipe"
        run python3 -m bench.parity run --recipe "$recipe" "${shape[@]}" --data /tmp/ptok --out "/tmp/parity/$width-$recipe"
        cp "/tmp/parity/$width-$recipe/metrics.jsonl" "$OUT/parity-$width-$recipe.jsonl" 2>/dev/null
        cp "/tmp/parity/$width-$recipe/run.json" "$OUT/parity-$width-$recipe.run.json" 2>/dev/null
      done
    done
    ;;
  memory)  # peak memory and tokens/s, every expert GEMM in FP8 (--fp8-min-dim 0), FP8 first (the question)
    common=(--warmup 2 --steps 3)
    fp8=(--recipe fp8_rowwise --fp8-min-dim 0)
    run python3 -m bench.model --width paper --layers 2 --micro 1 --accum 4 "${fp8[@]}" "${common[@]}"
    run python3 -m bench.model --width paper --layers 2 --micro 1 --accum 4 "${common[@]}"
    run python3 -m bench.model --width paper --layers 2 --micro 4 --accum 4 "${fp8[@]}" "${common[@]}"
    run python3 -m bench.model --width paper --layers 2 --micro 4 --accum 4 "${common[@]}"
    run python3 -m bench.model --layers 8 --micro 4 --accum 4 "${fp8[@]}" "${common[@]}"
    run python3 -m bench.model --layers 8 --micro 4 --accum 4 "${common[@]}"
    ;;
  layer)
    run python3 -m bench.layer --shape 4096,4096,64,4 --tokens 16384 --peers ours,ours_fp8_all --iters 20
    run python3 -m bench.layer --shape 4096,4096,64,4 --tokens 65536 --peers ours,ours_fp8_all --iters 10
    run python3 -m bench.profile_layer --shape 4096,4096,64,4 --tokens 16384 --recipe bf16 --rows 12
    run python3 -m bench.profile_layer --shape 4096,4096,64,4 --tokens 16384 --recipe fp8 --rows 16
    common=(--width paper --layers 2 --micro 4 --accum 4 --warmup 2 --steps 3)
    run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise   # the default rule (fp8_min_dim 4096)
    run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise --fp8-dense
    run python3 -m bench.model "${common[@]}"
    if [ ! -f /tmp/ptok/manifest.json ]; then
      (cd bench/paper && python3 -m pipeline.cli paper tokenize --set tokenize.vocab_size=4096 \
        --set tokenize.max_bytes=8000000 --set tokenize.output=/tmp/ptok 2>&1 | tail -2)
    fi
    for recipe in bf16 fp8_rowwise; do
      rm -rf "/tmp/parity/paper-lr1e-4-$recipe"
      run python3 -m bench.parity run --recipe "$recipe" --preset paper-8l --layers 2 --lr 1e-4 --data /tmp/ptok --out "/tmp/parity/paper-lr1e-4-$recipe"
      cp "/tmp/parity/paper-lr1e-4-$recipe/metrics.jsonl" "$OUT/parity-paper-lr1e-4-$recipe.jsonl" 2>/dev/null
      cp "/tmp/parity/paper-lr1e-4-$recipe/run.json" "$OUT/parity-paper-lr1e-4-$recipe.run.json" 2>/dev/null
    done
    ;;
  sweep)  # the rule's thresholds at OLMoE width after the gradient-sink change; pairs run back to back
    common=(--layers 8 --accum 4 --warmup 2 --steps 5)
    for micro in 1 2 4; do
      run python3 -m bench.model "${common[@]}" --micro "$micro" --recipe fp8_rowwise --fp8-min-dim 0
      run python3 -m bench.model "${common[@]}" --micro "$micro"
    done
    # where the paper FP8 stage's extra 63 MB comes from: what is live at the peak, FP8 then bf16
    peak=(--width paper --layers 2 --seq 8192 --micro 1 --accum 4 --routing random --warmup 2 --steps 3 --peak-breakdown)
    run python3 -m bench.model "${peak[@]}" --recipe fp8_rowwise --fp8-min-dim 0
    run python3 -m bench.model "${peak[@]}"
    ;;
  rule)
    common=(--layers 8 --accum 4 --warmup 2 --steps 5)
    for micro in 1 2 4; do
      run python3 -m bench.model "${common[@]}" --micro "$micro" --recipe fp8_rowwise --fp8-min-dim 1024
      run python3 -m bench.model "${common[@]}" --micro "$micro"
      [ "$micro" = 1 ] || run python3 -m bench.model "${common[@]}" --micro "$micro" --recipe fp8_rowwise --fp8-min-dim 1024 --fp8-dense
    done
    peak=(--width paper --layers 2 --seq 8192 --micro 1 --accum 4 --routing random --expert-grad-accum bf16 --warmup 2 --steps 3 --peak-breakdown)
    run python3 -m bench.model "${peak[@]}" --recipe fp8_rowwise --fp8-min-dim 0
    run python3 -m bench.model "${peak[@]}"
    ;;
  small)
    for shape in 1024,1024,64,8 2048,1024,64,8 1024,512,64,8; do
      for tokens in 8192 16384; do
        run python3 -m bench.layer --shape "$shape" --tokens "$tokens" --peers ours,ours_fp8_all --iters 30 --same-weights
      done
    done
    run python3 -m bench.model --width paper --layers 2 --seq 8192 --micro 1 --accum 4 --routing random \
      --expert-grad-accum bf16 --warmup 2 --steps 3 --peak-breakdown --recipe fp8_rowwise --fp8-min-dim 0
    (cd bench/results && tar -czf "$OUT/small.tgz" $(find . -name '*.json' -newer /tmp/run-start))
    rm -f "$OUT"/*.json
    ;;
  rule2)
    common=(--layers 8 --accum 4 --warmup 2 --steps 8)
    for micro in 1 2 4; do
      run python3 -m bench.model "${common[@]}" --micro "$micro" --recipe fp8_rowwise
      run python3 -m bench.model "${common[@]}" --micro "$micro"
    done
    for micro in 4 8; do
      run python3 -m bench.model "${common[@]}" --width narrow --micro "$micro" --recipe fp8_rowwise
      run python3 -m bench.model "${common[@]}" --width narrow --micro "$micro"
    done
    (cd bench/results && tar -czf "$OUT/rule2.tgz" $(find . -name '*.json' -newer /tmp/run-start))
    rm -f "$OUT"/*.json
    ;;
  rule3)
    common=(--layers 8 --accum 4 --warmup 2 --steps 8 --width narrow --micro 4)
    for pair in 1 2; do
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise
      run python3 -m bench.model "${common[@]}"
    done
    run python3 -m bench.model --width paper --layers 2 --seq 8192 --micro 1 --accum 4 --routing random \
      --expert-grad-accum bf16 --warmup 2 --steps 3 --peak-breakdown --recipe fp8_rowwise --fp8-min-dim 0
    (cd bench/results && tar -czf "$OUT/rule3.tgz" $(find . -name '*.json' -newer /tmp/run-start))
    rm -f "$OUT"/*.json
    RUN_TIMEOUT=330 run bash bench/h200/paper.sh fp8
    ;;
  rule4)
    common=(--layers 8 --accum 4 --warmup 2 --steps 8 --micro 4)
    for pair in 1 2; do
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise
      run python3 -m bench.model "${common[@]}"
    done
    ;;
  final)
    for width in olmoe narrow olmoe; do
      common=(--layers 8 --accum 4 --warmup 2 --steps 8 --micro 4 --width "$width")
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise
      run python3 -m bench.model "${common[@]}"
    done
    ;;
  final2)  # WIDTHS="olmoe narrow" by default, each WIDTH or WIDTH:LAYERS (WIDTHS="olmoe:8 paper:2" on an H200);
           # LAYERS=6 on an 80 GiB H100 (8 layers of OLMoE width at micro 4 need more)
    for spec in ${WIDTHS:-olmoe narrow}; do
      width=${spec%%:*}; layers=${LAYERS:-8}; [ "$spec" != "$width" ] && layers=${spec#*:}
      common=(--layers "$layers" --accum 4 --warmup 2 --steps 8 --micro 4 --width "$width")
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise --expert-wgrad paired --cuda-graph
      run python3 -m bench.model "${common[@]}" --expert-wgrad paired --cuda-graph
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise --expert-wgrad paired
      run python3 -m bench.model "${common[@]}"
    done
    ;;
  paperab)  # the paper's width on an 80 GiB card (two layers do not fit): one layer, FP8 against bf16 three times each,
            # alternating, both graphed with pairs (each recipe's best step); then the expert layer alone, bf16 against
            # every GEMM in FP8 at 16,384 tokens (the micro-batch; 65,536 does not fit 80 GiB), new weights every call
            # (FP8 quantises them every call: one micro-batch per step) and the same weights (quantised once)
    common=(--width paper --layers 1 --micro 4 --accum 4 --warmup 2 --steps 12 --expert-wgrad paired --cuda-graph)
    for rep in 1 2 3; do
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise
      run python3 -m bench.model "${common[@]}"
    done
    paper_layer_weights
    ;;
  accum1)  # one micro-batch per optimizer step, where FP8 quantises the expert weights every micro-batch with no
           # accumulation to share the cost: the expert layer alone at paper width, 16,384 tokens, new weights every
           # call then the same weights; then steps at micro 4 x accum 1, FP8 against bf16 alternating, each recipe's
           # best step (graphed, pairs): paper width three times each (PAPER_LAYERS, default 1: two do not fit 80 GiB),
           # OLMoE width twice each (OLMOE_LAYERS, default 6: eight do not fit 80 GiB at micro 4)
    paper_layer_weights
    for spec in "paper:${PAPER_LAYERS:-1}:3" "olmoe:${OLMOE_LAYERS:-6}:2"; do
      IFS=: read -r width layers reps <<< "$spec"
      common=(--width "$width" --layers "$layers" --micro 4 --accum 1 --warmup 3 --steps 16 --expert-wgrad paired --cuda-graph)
      for rep in $(seq "$reps"); do
        run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise
        run python3 -m bench.model "${common[@]}"
      done
    done
    ;;
  wgrad8)
    run python3 -m bench.wgrad --fp8 --configs all
    for width in paper olmoe; do
      if [ "$width" = paper ]; then shape=(--layers 2); else shape=(--layers 8); fi
      common=(--width "$width" "${shape[@]}" --micro 4 --accum 4 --warmup 2 --steps 6)
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise
      run python3 -m bench.model "${common[@]}"
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise --fp8-dense
    done
    ;;
  sinkab)
    for rep in 1 2; do
      common=(--width paper --layers 2 --micro 4 --accum 4 --warmup 2 --steps 6)
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise
      run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise --fp8-sink-wgrad-min-dim 1000000
      run python3 -m bench.model "${common[@]}"
    done
    run python3 -m bench.model --width paper --layers 2 --micro 4 --accum 4 --warmup 2 --steps 6 --recipe fp8_rowwise --fp8-dense
    common=(--width olmoe --layers 8 --micro 4 --accum 4 --warmup 2 --steps 6)
    run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise
    run python3 -m bench.model "${common[@]}" --recipe fp8_rowwise --fp8-sink-wgrad-min-dim 0
    run python3 -m bench.model "${common[@]}"
    if [ ! -f /tmp/ptok/manifest.json ]; then
      (cd bench/paper && python3 -m pipeline.cli paper tokenize --set tokenize.vocab_size=4096 \
        --set tokenize.max_bytes=8000000 --set tokenize.output=/tmp/ptok 2>&1 | tail -2)
    fi
    for recipe in fp8_rowwise bf16; do
      rm -rf "/tmp/parity/paper-lr1e-4-$recipe"
      run python3 -m bench.parity run --recipe "$recipe" --preset paper-8l --layers 2 --lr 1e-4 --data /tmp/ptok --out "/tmp/parity/paper-lr1e-4-$recipe"
      cp "/tmp/parity/paper-lr1e-4-$recipe/metrics.jsonl" "$OUT/parity-paper-lr1e-4-$recipe.jsonl" 2>/dev/null
    done
    run python3 -m bench.parity report /tmp/parity/paper-lr1e-4-bf16 /tmp/parity/paper-lr1e-4-fp8_rowwise
    ;;
  quant)
    run python3 -m bench.fp8 check
    run python3 -m bench.fp8 quant --shape 4096,4096,64,4 --tokens 16384 --iters 20
    run python3 -m bench.profile_layer --shape 4096,4096,64,4 --tokens 16384 --recipe fp8 --rows 16
    ;;
  *) echo "usage: $0 parity|memory|layer|sweep|rule|small|rule2|rule3|rule4|final|final2|wgrad8|sinkab|quant" >&2; exit 2 ;;
esac
exit $status
