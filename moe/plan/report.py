"""The plan as `moe plan` prints it: the layout, the parameters, the worst rank's memory line by
line (lines that are zero for this job are left out; the JSON keeps them), FLOPs and the
predicted step time, the verdict, the other knobs that help and the other data-parallel
flavours that fit on the GPU count the verdict names."""

from __future__ import annotations

from moe.hardware import GPUS
from moe.plan.planner import Plan, scale_out_text


def count(n: int) -> str:
    """A parameter count a reader can see at any scale: 1.884 B, 12.35 M, 98.3 K."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return str(n)


def format_plan(plan: Plan) -> str:
    lay = plan.layout
    lines = [
        f"plan: {plan.gpus} x {GPUS[plan.gpu].name}; pp={lay['pp']} dp={lay['dp']} ep={lay['ep']} "
        f"zero1={str(lay['zero1']).lower()} {lay['data_parallel']}; micro-batch {lay['micro_batch_size']} x {lay['seq_len']} tokens, "
        f"{lay['grad_accum']} per step; recompute={lay['recompute']}",
        f"parameters: {count(plan.params_total)} total, {count(plan.params_active)} active",
        f"memory of rank {plan.worst_rank} (GiB; activations from {plan.calibration}):",
    ]
    width = max(len(k) for k in plan.memory_gib)
    for k, v in plan.memory_gib.items():
        if v:
            lines.append(f"  {k.ljust(width)}  {v:8.2f}")
    lines.append(f"  {'peak'.ljust(width)}  {plan.peak_gib:8.2f}   of {plan.capacity_gib:.1f}")
    lines.extend(f"  {note}" for note in plan.notes)
    lines.append(
        f"FLOPs/token {plan.flops_per_token / 1e9:.4g} G; {plan.tokens_per_step} tokens/step; "
        f"predicted step {plan.step_time_s:.3g} s at {plan.mfu:.0%} MFU "
        f"({GPUS[plan.gpu].peak_bf16_tflops:.0f} TFLOP/s dense bf16 per GPU)"
    )
    lines.append(f"verdict: {plan.verdict()}")
    for k in plan.knobs[1:4]:
        lines.append(f"  also: {k['set']} (-{k['saves_gib']:.1f} GiB{', fits' if k['fits'] else ''})")
    for option in (plan.scale_out or [])[1:]:
        lines.append(f"  also {scale_out_text(option)}")
    return "\n".join(lines)
