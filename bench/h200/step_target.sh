#!/usr/bin/env bash
# Issue 49 item 2 on the H200 at HEAD (MOE_GIT_COMMIT=$(git rev-parse HEAD)), most wanted first (a call cut short
# keeps what ran): the warp-specialised wgrad kernel's GPU check (paired included; should it fail, the rest runs on
# the Triton kernel, MOE_WGRAD_KERNEL=triton), bench.model at OLMoE width (8 layers, micro 4 x accum 4) with
# optim.expert_wgrad=paired and train.cuda_graph, the same on the Triton wgrad kernel (the paired path before the
# ws kernel took pairs), the same with the norm reading the expert gradients again (MOE_EXPERT_GRAD_SQUARES=foreach; the squares
# from the epilogue are the default since 2026-12-07), the Qwen-like `moe train` run the same way with and without the squares, those three again, the router's input gradient
# added by autograd (MOE_ROUTER_INPUT_GRAD=autograd), the default expert wgrad eager and graphed, the Qwen-like run
# graphed and eager, and last the other GPU checks (the grad-add kernel, the residual in the combine, the router's
# rounding, the tests of train.cuda_graph and of the MoE layer). Each bench.model run is also timed back to back
# (step_s_pipelined). JSON and logs land in $OUT. On a GPU under 100 GiB (an H100) the step runs at 6 layers and
# the Qwen-like run at 4, else at 8 and 8.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
# the levers of 2026-12-06/07 on for every run below (the grad add and the residual in the combine are the
# defaults since 2026-12-07, the q/k/v sum in the GEMMs since its timing that day); each run that turns one off says so
export MOE_GRAD_ADD=triton MOE_SHARED_INPUT_GRAD=gemm MOE_RESIDUAL_ADD=combine
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8 qwen_layers=8; else layers=6 qwen_layers=4; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers, Qwen-like at ${qwen_layers}" | tee -a "$LOG"
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8)
RUN_TIMEOUT=150 run python3 tests/kernels/grouped_wgrad_ws_gpu_check.py  # the ws kernel, paired included, against float64 and the Triton kernel
if [ "$status" -ne 0 ]; then
  echo "the ws kernel's check failed: the runs below use the Triton wgrad kernel" | tee -a "$LOG"
  export MOE_WGRAD_KERNEL=triton
fi
run python3 -m bench.model "${step[@]}" --expert-wgrad paired --cuda-graph
run env MOE_WGRAD_KERNEL=triton python3 -m bench.model "${step[@]}" --expert-wgrad paired --cuda-graph  # pairs on the Triton kernel
run env MOE_EXPERT_GRAD_SQUARES=foreach python3 -m bench.model "${step[@]}" --expert-wgrad paired --cuda-graph  # the norm reads the expert gradients again
tokens_8k
qwen_like_train qwen-like-paired-graph 12 --set model.n_layers="$qwen_layers" --set optim.expert_wgrad=paired --set train.cuda_graph=true
MOE_EXPERT_GRAD_SQUARES=foreach qwen_like_train qwen-like-paired-graph-foreach 12 --set model.n_layers="$qwen_layers" --set optim.expert_wgrad=paired --set train.cuda_graph=true
run python3 -m bench.model "${step[@]}" --expert-wgrad paired --cuda-graph
run env MOE_WGRAD_KERNEL=triton python3 -m bench.model "${step[@]}" --expert-wgrad paired --cuda-graph
run env MOE_EXPERT_GRAD_SQUARES=foreach python3 -m bench.model "${step[@]}" --expert-wgrad paired --cuda-graph
run env MOE_ROUTER_INPUT_GRAD=autograd python3 -m bench.model "${step[@]}" --expert-wgrad paired --cuda-graph  # autograd's add of the router's input gradient
run python3 -m bench.model "${step[@]}"
run python3 -m bench.model "${step[@]}" --cuda-graph
qwen_like_train qwen-like-ws-graph 12 --set model.n_layers="$qwen_layers" --set train.cuda_graph=true
qwen_like_train qwen-like-ws 12 --set model.n_layers="$qwen_layers"
run python3 tests/kernels/grad_add_check.py  # moe.kernels.grad_add compiled: torch's values bitwise
# the residual folded into the combine, compiled: against the unfused combine + add (one bf16 rounding apart at most)
run python3 -c "
import torch
from moe.kernels.routing import combine
torch.manual_seed(0); t, k, d, e = 16384, 8, 2048, 64
inv = torch.argsort(torch.randint(0, e, (t * k,), device='cuda'), stable=True).argsort()
y = torch.randn(t * k, d, device='cuda', dtype=torch.bfloat16); w = torch.rand(t, k, device='cuda').softmax(-1); r = torch.randn(t, d, device='cuda', dtype=torch.bfloat16)
got = combine(y, inv, w, r); ref = r + combine(y, inv, w)
exact = (r.float() + (w.unsqueeze(2) * y.float()[inv].view(t, k, d)).sum(1))
err = (got.float() - exact).abs().max().item(); err_ref = (ref.float() - exact).abs().max().item()
print(f'combine + residual compiled: max err {err:.3g} (unfused {err_ref:.3g})'); assert err <= err_ref, 'the fold is less exact than the separate add'
"
# the router's input gradient rounded in its GEMM (moe.layers.router._mm_rounded) against the fp32 product cast after
run python3 -c "
import torch
from moe.layers.router import _mm_fp32, _mm_rounded
torch.manual_seed(0); g = torch.randn(16384, 64, device='cuda').bfloat16(); w = torch.randn(64, 2048, device='cuda').bfloat16()
a, b = _mm_rounded(g, w), _mm_fp32(g, w).bfloat16()
ulp = ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30) * 128).max().item()
print(f'router input gradient rounded in the GEMM: {(a != b).float().mean().item():.2e} of elements differ, at most {ulp:.2f} ulp'); assert ulp <= 1.0
"
RUN_TIMEOUT=240 run python3 -m pytest -q -x -p no:cacheprovider tests/train/test_cuda_graph.py tests/layers/test_moe_layer.py  # the captured step's GPU tests, the layer's (no host sync)
RUN_TIMEOUT=200 run env MOE_EXPERT_GRAD_SQUARES=foreach python3 -m pytest -q -x -p no:cacheprovider tests/train/test_cuda_graph.py  # the same with the norm's own pass
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
exit $status
