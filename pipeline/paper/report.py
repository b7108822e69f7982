"""The report stage: ``REPORT.md`` and PNG plots from the stages' result files.

For every claim: the paper's number and hardware, ours with our hardware and the scaled
configuration (the scaling rule's notes beside the figure), and the ratio of the two where they
are comparable (not_comparable says when they are not)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.escape import markdown_text
from pipeline.outputs import check_output_file, write_output_file
from pipeline.paper.claims import CLAIMS, STAGES
from pipeline.paper.hardware import Hardware
from pipeline.paper.results import load_stage_result
from pipeline.paper.scaling import PAPER_MODEL
from pipeline.tracking.provenance import git_info
from pipeline.units import gib


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 100:+.1f}%"


def commit_label() -> str:
    """This checkout's commit (12 hex digits, "-dirty" with uncommitted changes to tracked files;
    MOE_GIT_COMMIT where the tree was copied without .git), from pipeline.tracking.provenance.git_info."""
    if os.environ.get("MOE_GIT_COMMIT"):
        return os.environ["MOE_GIT_COMMIT"][:12]
    info = git_info()
    if info["git.commit"] == "unknown":
        return "unknown"
    return info["git.commit"][:12] + ("-dirty" if info.get("git.dirty") == "true" else "")


def hardware_label(result: dict[str, Any]) -> str:
    """A stage's hardware in words: rebuilt from its fields where the result holds them all (results
    before issue 49 described a GPU's GiB as "GB"), else as the result describes it."""
    hw = result["hardware"]
    memory = gib(hw, "memory_gib")
    fields = hw.get("kind") in ("cpu", "gpu") and isinstance(hw.get("name"), str) and type(hw.get("count")) is int
    if fields and (memory is None or type(memory) in (int, float)):
        return Hardware.from_record(hw).describe()
    return hw["describe"]


# A ratio to the paper's figure means something only on the paper's class of hardware (GPUs) and
# a model of about its width: the scaling rule may halve the width twice and drop layers, which
# changes the numbers by a measured, stated amount, not by orders of magnitude.
MIN_WIDTH_FRACTION = 1 / 4


def not_comparable(result: dict[str, Any]) -> str | None:
    """Why a stage's figures cannot be set against the paper's as a ratio (None: they can)."""
    from moe.config.presets import model_preset

    paper_width = model_preset(PAPER_MODEL)["d_model"]
    width = (result.get("scaling", {}).get("model") or {}).get("d_model")
    claim = CLAIMS[result["stage"]] if result.get("stage") in CLAIMS else None
    theirs = f"the paper's {claim.paper_hardware if claim else 'GPUs'} and d={paper_width}"
    if result["hardware"].get("kind") != "gpu":
        return f"{hardware_label(result)} and a d={width or '?'} model against {theirs}"
    if not isinstance(width, int) or width < paper_width * MIN_WIDTH_FRACTION:
        return f"a d={width or '?'} model against {theirs}"
    return None


def ours_and_ratio(stage: str, derived: dict[str, Any]) -> tuple[str, str]:
    """Our headline figure for a claim and its ratio to the paper's."""
    ref = CLAIMS[stage].reference
    if not derived:
        return "not measured", "n/a"
    if stage == "resident":
        s = derived.get("speedup")
        a, b = _fmt(derived.get("tokens_per_s_per_device")), _fmt(derived.get("baseline_tokens_per_s_per_device"))
        ours = f"{a} vs {b} tokens/s/device ({_fmt(s)}x)"
        if proj := derived.get("projection"):
            lo, hi = proj["speedup_full_overlap"], proj["speedup_no_overlap"]
            ours += f"; projected at {proj['gpus']} GPUs: {lo:.2f}-{hi:.2f}x (transfers hidden / not)"
        return ours, _fmt(s / ref["speedup"]) if s else "n/a"
    if stage == "experts":
        d = derived.get("drop")
        ours = f"{_pct(-d if d is not None else None)} from {derived['experts_from']} to {derived['experts_to']} experts (random routing)"
        if derived.get("drop_learned") is not None:
            ours += f"; learned routing {_pct(-derived['drop_learned'])}"
        proj = derived.get("projection")
        if proj:
            ours += f"; projected at EP={proj['gpus']}: {_pct(-proj['drop_projected'])} (kernel time, all-to-all not modelled)"
        return ours, "within the paper's bound" if d is not None and d < ref["drop"] else f"drop {_pct(d)} vs < 5%"
    if stage == "fp8":
        s = derived.get("speedup")
        ours = (
            f"{_pct(s - 1 if s else None)} throughput ({derived.get('recipe')}), peak {_fmt(gib(derived, 'baseline_peak_gib'))} -> "
            f"{_fmt(gib(derived, 'peak_gib'))} GiB"
        )
        if proj := derived.get("projection"):
            ours += f"; about {_pct(proj['speedup_bound_at_gpus'] - 1)} at {proj['gpus']} GPUs (estimated from the profile)"
        return ours, f"{_fmt((s - 1) / (ref['speedup'] - 1)) if s else 'n/a'} of the paper's gain"
    if stage == "recompute":
        parts, ratios = [], []
        for mode, r in derived.items():
            parts.append(
                f"{mode}: peak above rest x{_fmt(r.get('above_rest_ratio', r.get('activation_ratio')))}, peak x{_fmt(r.get('peak_ratio'))}, "
                f"throughput x{_fmt(r.get('throughput_ratio'))}"
            )
            if r.get("throughput_ratio"):
                ratios.append(f"{mode}: throughput ratio {_fmt(r['throughput_ratio'] / ref['throughput_ratio'])} of the paper's")
        return "; ".join(parts), "; ".join(ratios) or "n/a"
    if stage == "ep":
        return (
            "; ".join(f"{k}: {_fmt(v['step_time_s'] * 1e3)} ms/step (x{_fmt(v['relative_to_ep1'])} of EP=1)" for k, v in derived.items()),
            "n/a (no paper figure)",
        )
    if stage == "gerrymander":
        return (
            f"balance loss {_fmt(derived.get('lb_loss_first'))} -> {_fmt(derived.get('lb_loss_last'))}, busiest expert "
            f"{_fmt(derived.get('max_over_mean_first'))} -> {_fmt(derived.get('max_over_mean_last'))}x mean; "
            f"alarm: {derived.get('alarm', 'diverging' if derived.get('diverging') else 'quiet')}",
            "qualitative",
        )
    return "", ""


def _dropped(v: dict[str, Any]) -> str:
    frac = v.get("tokens_dropped_fraction")
    kind = "dropless" if v.get("dropless", True) else "capacity"
    return f"{kind}, {frac * 100:.2f}% measured" if frac is not None else kind


def regime_label(variants: list[dict[str, Any]]) -> str:
    """The regime of a stage's runs, in words: tokens per step, routing, drops, accumulation."""
    ok = [v for v in variants if v.get("status") == "ok" and v.get("tokens_per_step_per_device") is not None]
    if not ok:
        return ""
    v = ok[0]
    routings = sorted({x["routing"] for x in ok})
    accum = sorted({x.get("expert_grad_accum", "fp32") for x in ok})
    drops = [x["tokens_dropped_fraction"] for x in ok if x.get("tokens_dropped_fraction") is not None]
    dropless = all(x.get("dropless", True) for x in ok)
    return (
        f"{v['tokens_per_step_per_device']:,.0f} tokens/step/device ({v['micro_batch_size']} x {v['accumulation']} micro-batches); "
        f"routing {' + '.join(routings)}; {'dropless' if dropless else 'capacity-bound'}"
        + (f" (dropped, measured: max {max(drops) * 100:.2f}%)" if drops else "")
        + f"; expert gradients accumulate in {'/'.join(accum)}"
    )


# The profile categories in the order the report lists them (moe.spans.CATEGORIES).
_PROFILE_ROWS = (
    ("expert_gemm", "expert GEMMs"),
    ("dense_gemm", "dense GEMMs (attention projections, router, head)"),
    ("attention", "attention (SDPA)"),
    ("dispatch", "dispatch (permute, combine, all-to-all)"),
    ("fp8_quantize", "FP8 quantisation"),
    ("grad_accumulation", "gradient accumulation"),
    ("grad_sync", "gradient sync (reduction, norm, FSDP collectives)"),
    ("optimizer", "optimizer step (AdamW, master -> bf16)"),
    ("other", "the rest (norms, SwiGLU, loss, copies)"),
)


def profile_table(r: dict[str, Any]) -> list[str]:
    """Where each variant's step goes (ms, one profiled step), and each variant's difference
    from the stage's first: the claim's gap split into measured parts."""
    ok = [v for v in r["variants"] if v.get("status") == "ok" and v.get("profile")]
    if not ok:
        return []
    base = ok[0]
    head = " | ".join(v["name"] for v in ok)
    deltas = " | ".join(f"{v['name']} - {base['name']}" for v in ok[1:])
    lines = [
        "Where the time goes: kernel time of one more step run under torch.profiler after the timed ones (ms; "
        "moe.train.step_profile; on CPUs each op's own CPU time), and each variant's difference from the first. 'kernel gaps' "
        "is the timed step minus the profiled kernel total (time the GPU waited; one profiled step against the timed mean: noisy).",
        "",
        f"| part | {head}" + (f" | {deltas}" if deltas else "") + " |",
        "| --- |" + " --- |" * (len(ok) + len(ok) - 1),
    ]

    def row(label: str, values: list[float]) -> str:
        cells = [_fmt(x) for x in values] + [f"{x - values[0]:+,.1f}" for x in values[1:]]
        return f"| {label} | " + " | ".join(cells) + " |"

    for key, label in _PROFILE_ROWS:
        values = [v["profile"].get(key, 0.0) for v in ok]
        if any(values):
            lines.append(row(label, values))
    lines.append(row("kernel total", [v["profile"]["total"] for v in ok]))
    lines.append(row("kernel gaps", [v["step_time_s"] * 1e3 - v["profile"]["total"] for v in ok]))
    lines.append(row("timed step", [v["step_time_s"] * 1e3 for v in ok]))
    lines.append("")
    lines += projection_lines(r.get("stage", ""), r.get("derived", {}))
    return lines


def projection_lines(stage: str, derived: dict[str, Any]) -> list[str]:
    """The written model of what the paper's GPU count would change, with its numbers."""
    if stage == "recompute" and derived:
        return [
            "Projection to the paper's GPU count: recompute trades each GPU's own activations for its own compute, and under "
            "data and expert parallelism a GPU's activations and FLOPs per token do not change with the GPU count, so these "
            "ratios carry over as measured; what differs is the denominator ('peak above rest' here includes gradients and "
            "transients, the paper's 'activation memory' does not, and a longer model holds more activations per weight).",
            "",
        ]
    proj = derived.get("projection")
    if not proj:
        return []
    lines: list[str] = []
    if stage == "resident":
        return [
            f"Projection to the paper's {proj['gpus']} GPUs: on one GPU neither layout moves data. At G GPUs FSDP2 (fp32 shards, "
            "no mixed-precision policy) all-gathers every weight for the forward and again for the backward and reduce-scatters "
            "every gradient, each micro-batch: 12 B x parameters x (G-1)/G per GPU; the resident layout moves token rows (all-to-all "
            "there and back, forward and backward: 4 x tokens x k x d_model x 2 B x (G-1)/G per MoE layer and micro-batch) and "
            "reduces the dense gradients once per step (ZeRO-1, 8 B per dense parameter). At the NCCL rate measured between two "
            f"H200s ({proj['link_gb_s']:.0f} GB/s, platform.md): FSDP2 moves {proj['fsdp_transfer_s']:.2f} s per step, the resident "
            f"layout {proj['resident_transfer_s']:.2f} s. Projected speed-up: {proj['speedup_no_overlap']:.2f}x with no overlap, "
            f"{proj['speedup_full_overlap']:.2f}x with the transfers fully hidden under compute (the paper: 2.7x).",
            "",
        ]
    if stage == "fp8":
        return [
            f"Projection to the paper's {proj['gpus']} GPUs (EP = {proj['gpus']}): each GPU computes as many expert rows as one does "
            "alone, so the expert GEMMs and the activation and gradient quantisation keep their measured times; only the weights' "
            f"quantisation shrinks to 1/G. Measured: the FP8 expert GEMMs run {_fmt(proj['expert_gemm_speedup'])}x the bf16 ones, "
            f"but those are {proj['expert_gemm_share_bf16'] * 100:.0f}% of the bf16 step, and quantisation adds "
            f"{proj['quantize_ms']:.0f} ms. Estimate at {proj['gpus']} GPUs (all quantisation taken as weights; the optimizer and gradient "
            "adds over the experts, which shrink with G in both recipes, would raise it a little): "
            f"{_pct(proj['speedup_bound_at_gpus'] - 1)}; ceiling with expert GEMMs of zero time: "
            f"{_pct(proj['speedup_ceiling_expert_gemms_free'] - 1)} (the paper: +21%, with MXFP8 on B300).",
            "",
        ]
    if stage != "experts":
        return []
    per = proj["per_category_ms_per_expert"]
    e_from, e_to = list(proj["kernel_ms_one_gpu"])
    lines += [
        f"Projection to the paper's {proj['gpus']} GPUs (expert parallelism over all of them): each GPU then holds E/{proj['gpus']} "
        "experts and, with random routing, computes as many rows as one GPU alone does; a cost that grows with the experts "
        "a GPU holds is the one-GPU cost at E/G experts. Model: per part, ms = a + b x experts held (least squares over "
        "the measured counts, extrapolated below the smallest); the all-to-all at both ends and the kernel gaps are not modelled.",
        "",
        "| | " + " | ".join(label for key, label in _PROFILE_ROWS if per.get(key)) + " |",
        "| --- |" + " --- |" * sum(1 for key, _ in _PROFILE_ROWS if per.get(key)),
        "| ms per expert held | " + " | ".join(f"{per[key]:+.3g}" for key, _ in _PROFILE_ROWS if per.get(key)) + " |",
        "",
        f"Kernel time {e_from} -> {e_to} experts: one GPU (the fit) {_fmt(proj['kernel_ms_one_gpu'][e_from])} -> "
        f"{_fmt(proj['kernel_ms_one_gpu'][e_to])} ms ({_pct(-proj['drop_one_gpu_fit'])} throughput); EP={proj['gpus']} "
        f"{_fmt(proj['kernel_ms_ep'][e_from])} -> {_fmt(proj['kernel_ms_ep'][e_to])} ms ({_pct(-proj['drop_projected'])}).",
        "",
    ]
    return lines


PLOT_NAMES = ("experts.png", "fp8.png", "resident.png", "recompute.png", "ep.png", "gerrymander.png")


def _plots(results: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig, name: str) -> None:
        assert name in PLOT_NAMES, name  # (checked before any work)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        made.append(write_output_file(out / name, buf.getvalue(), "paper report", _is_matplotlib_png))

    def ok(stage: str) -> list[dict[str, Any]]:
        return [v for v in results.get(stage, {}).get("variants", []) if v.get("status") == "ok"]

    if v := ok("experts"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for routing in sorted({x.get("routing", "random") for x in v}):
            line = [x for x in v if x.get("routing", "random") == routing]
            experts = [x["model"]["moe"]["num_experts"] for x in line]
            ax.plot(experts, [x["tokens_per_s_per_device"] for x in line], "o-", label=f"{routing} routing")
        ax.legend()
        ax.set_xscale("log", base=2)
        ax.set(xlabel="experts (top-4, constant active parameters)", ylabel="tokens/s/device", title="Throughput against experts")
        save(fig, "experts.png")
    for stage, fname, title in (("fp8", "fp8.png", "BF16 against FP8"), ("resident", "resident.png", "Resident experts against FSDP2")):
        if v := ok(stage):
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(7, 3.5))
            names = [x["name"] for x in v]
            a1.bar(names, [x["tokens_per_s_per_device"] for x in v])
            a1.set(ylabel="tokens/s/device")
            a2.bar(names, [gib(x, "peak_mem_gib") or gib(x, "peak_rss_gib") or 0 for x in v])
            a2.set(ylabel="peak memory (GiB; RSS on CPU)")
            for a in (a1, a2):
                a.tick_params(axis="x", labelrotation=20, labelsize=7)
            fig.suptitle(title)
            save(fig, fname)
    if v := ok("recompute"):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(7, 3.5))
        names = [x["name"].removeprefix("recompute-") for x in v]
        a1.bar(names, [gib(x, "peak_mem_gib") or gib(x, "peak_rss_gib") or 0 for x in v], label="peak")
        a1.bar(names, [gib(x, "above_rest_gib") or 0 for x in v], label="peak above rest", alpha=0.7)
        a1.set(ylabel="GiB", title="memory per recompute mode")
        a1.legend()
        a2.bar(names, [x["tokens_per_s_per_device"] for x in v])
        a2.set(ylabel="tokens/s/device", title="throughput")
        save(fig, "recompute.png")
    if v := ok("ep"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar([x["name"] for x in v], [x["step_time_s"] * 1e3 for x in v])
        ax.set(ylabel="ms per step", title="Expert parallelism: step time")
        save(fig, "ep.png")
    if v := ok("gerrymander"):
        hist = v[0].get("history", [])
        if hist:
            fig, a1 = plt.subplots(figsize=(5.5, 3.5))
            steps = [h["step"] for h in hist]
            a1.plot(steps, [h["lb_loss"] for h in hist], color="tab:blue")
            a1.set(xlabel="step", ylabel="balance loss", title="Balance loss against measured load")
            a2 = a1.twinx()
            a2.plot(steps, [h["expert_load_max_over_mean"] for h in hist], color="tab:red")
            a2.set_ylabel("busiest expert / mean", color="tab:red")
            save(fig, "gerrymander.png")
    return made


def _markdown_safe(value: Any) -> Any:
    """A result with every text in it escaped for markdown (pipeline.escape.markdown_text), once,
    before any line of the report is built: a variant name, a hardware description or a shape
    from a result file is shown as itself, never as a heading, a table cell break or HTML."""
    if isinstance(value, str):
        return markdown_text(value)
    if isinstance(value, dict):
        return {k: _markdown_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_markdown_safe(v) for v in value]
    return value


def write_report(results_dir: str | Path, out_dir: str | Path = ".") -> Path:
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    check_report_dir(out_dir)
    results = {}
    for stage in STAGES:
        path = results_dir / f"{stage}.json"
        if os.path.lexists(path):  # (a FIFO or a folder there: an error naming it, not a stage "not run")
            results[stage] = load_stage_result(path)
    missing = [s for s in STAGES if s not in results]
    plots_dir = out_dir / "plots"
    if plots_dir.is_symlink():
        raise PipelineError(f"paper report: {plots_dir} is a symlink; refusing to write plots through it")
    check_output_file(out_dir / "REPORT.md", "paper report", _is_our_report)
    for name in PLOT_NAMES:
        check_output_file(plots_dir / name, "paper report", _is_matplotlib_png)
    plots_dir.mkdir(parents=True, exist_ok=True)
    plots = _plots(results, plots_dir)
    results = _markdown_safe(results)  # the report's text from here on
    hw = sorted({hardware_label(r) for r in results.values()})
    lines = [
        "# Reproducing the paper's system claims",
        "",
        f"Generated by `moe paper report` at commit `{commit_label()}` (each stage names the commit it was measured at) "
        f"on: {', '.join(hw) or 'nothing measured'}.",
        "Source of the paper's numbers: `shared/docs/paper.md` (Olmo-core 3 technical report). Each stage is the library's",
        "own training step launched through the executor seam; each figure is the throughput of the second half of a",
        "run's steps, timed between two device synchronisations (the first half is warm-up). Memory is the CUDA peak",
        "(on CPUs the process RSS, not comparable); 'peak above rest' is the peak minus the memory held between steps",
        "(activations, gradients and transients, not activations alone). Where our hardware cannot hold the paper's shape, the scaling rule",
        "(`pipeline/paper/scaling.py`) shrank it and the 'configuration' column says how. A ratio to the paper is given only",
        f"for runs on GPUs with a model at least {MIN_WIDTH_FRACTION:.0%} of the paper's width; otherwise the column says why not.",
        "",
        "| claim | paper (hardware) | ours | ratio to the paper | our hardware and configuration |",
        "| --- | --- | --- | --- | --- |",
    ]
    for stage in STAGES:
        claim = CLAIMS[stage]
        if stage not in results:
            lines.append(f"| {claim.title} | {claim.paper} ({claim.paper_hardware}) | not run | n/a | |")
            continue
        r = results[stage]
        ours, ratio = ours_and_ratio(stage, r.get("derived", {}))
        if (why := not_comparable(r)) and ratio != "n/a":
            ratio = f"not comparable: {why}"
        regime = regime_label(r["variants"])
        lines.append(
            f"| {claim.title} | {claim.paper} ({claim.paper_hardware}) | {ours} | {ratio} | "
            f"{hardware_label(r)}; {r['scaling']['shape']}{'; ' + regime if regime else ''} |"
        )
    lines += ["", "## Every variant", ""]
    for stage, r in results.items():
        lines += [f"### {CLAIMS[stage].title}", ""]
        if r.get("commit"):
            lines += [f"Measured at commit `{r['commit']}`.", ""]
        if r.get("note"):
            lines += [f"Note: {r['note']}.", ""]
        lines += [
            "| variant | status | routing | tokens/step/device (micro x accum) | dropped | tokens/s/device | TFLOP/s/device | step (ms) "
            "| peak GiB (plan) | peak above rest GiB | final loss |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for v in r["variants"]:
            if v.get("status") != "ok":
                lines.append(f"| {v['name']} | {v.get('status')}: {v.get('reason', '')} | | | | | | | | | |")
                continue
            peak, predicted = gib(v, "peak_mem_gib"), gib(v, "predicted_peak_gib")
            peak_s = _fmt(peak) if peak is not None else f"{_fmt(gib(v, 'peak_rss_gib'))} (RSS)"
            if predicted is not None:
                peak_s += f" ({_fmt(predicted)})"
            batch = "n/a"
            if v.get("tokens_per_step_per_device") is not None:
                batch = f"{v['tokens_per_step_per_device']:,.0f} ({v['micro_batch_size']} x {v['accumulation']})"
            lines.append(
                f"| {v['name']} | ok | {v.get('routing', 'n/a')} | {batch} | {_dropped(v)} | {_fmt(v['tokens_per_s_per_device'])} | "
                f"{_fmt(v['tflops_per_device'])} | {_fmt(v['step_time_s'] * 1e3)} | {peak_s} | "
                f"{_fmt(gib(v, 'above_rest_gib'))} | {_fmt(v.get('final_loss'))} |"
            )
        lines.append("")
        lines += profile_table(r)
    if missing:
        lines += [f"Stages without results: {', '.join(missing)}.", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    return write_output_file(out_dir / "REPORT.md", "\n".join(lines), "paper report", _is_our_report)


# ---------------------------------------------------------------- what is read and what is written

REPORT_TITLE = "# Reproducing the paper's system claims"


def _is_our_report(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.readline().rstrip(b"\r\n") == REPORT_TITLE.encode()


def _is_matplotlib_png(path: Path) -> bool:
    """Our plots are matplotlib PNGs (it names itself in a tEXt chunk near the start)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"Software\x00Matplotlib" in head


def check_report_dir(out_dir: Path) -> None:
    """The report goes beside the results folder, which must lie inside this project (the
    working directory): ``paper.results=/etc`` would otherwise write /REPORT.md."""
    here = Path.cwd().resolve()
    where = out_dir.resolve()
    if where != here and here not in where.parents:
        raise PipelineError(
            f"paper.results: the report goes to its parent folder, {out_dir}, which is outside this project ({here}); "
            "choose a results folder inside it"
        )
