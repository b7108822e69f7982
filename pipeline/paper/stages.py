"""One function per claim of the paper: build the variants, measure them, derive the figure.

Each stage writes ``<results>/<stage>.json``: the claim, the hardware, the scaled shape and
the rule's notes, every variant measured (or why it was not run), and the derived figures the
report compares with the paper's."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe.config import ConfigError
from moe.hardware import RECIPES as RECIPE_FACTS
from moe.hardware import capability_problem, recipe_on
from moe.reader import MIB, read_bytes
from pipeline.errors import JobFailed, PipelineError
from pipeline.outputs import write_output_file
from pipeline.paper.claims import CLAIMS
from pipeline.paper.config import PaperParams
from pipeline.paper.hardware import Hardware, detect
from pipeline.paper.measure import measure
from pipeline.paper.report import commit_label
from pipeline.paper.scaling import Scaled, paper_shape, predict_peak_gib
from pipeline.stages.tokenize import read_manifest
from pipeline.units import gib


@dataclasses.dataclass
class Context:
    params: PaperParams
    hw: Hardware
    tracker: Any = None

    @property
    def work(self) -> Path:
        return Path(self.params.paper.work_dir)

    @property
    def steps(self) -> int:
        return self.params.paper.steps

    def accumulation(self, shape: Scaled) -> int:
        """Micro-batches per optimizer step: ``paper.tokens_per_step`` per GPU where it runs on
        GPUs (rounded up to whole micro-batches), two on CPUs."""
        if self.hw.kind != "gpu":
            return 2
        return max(1, math.ceil(self.params.paper.tokens_per_step / (shape.micro_batch_size * shape.seq_len)))

    def sections(self, shape: Scaled, parallel: dict[str, Any], accumulate: bool = True, **extra: Any) -> dict[str, Any]:
        micro = shape.micro_batch_size
        accum = self.accumulation(shape) if accumulate else 1
        train = {
            "micro_batch_size": micro,
            "global_batch_size": micro * accum * self.hw.count,
            "device": "cuda" if self.hw.kind == "gpu" else "cpu",
            **extra.pop("train", {}),
        }
        recipe = extra.pop("recipe", "auto")
        # bf16 accumulation needs bf16 weights over fp32 masters: not FSDP2's fp32 shards
        # under autocast (amp_bf16), nor CPUs (fp32); those accumulate in fp32.
        bf16_weights = self.hw.kind == "gpu" and RECIPE_FACTS[recipe_on(recipe, gpu=True)].master_weights
        return {
            "model": shape.model,
            "data": {"seq_len": shape.seq_len},
            "train": train,
            "parallel": parallel,
            "precision": {"recipe": recipe, **extra.pop("precision", {})},
            "optim": {"expert_grad_accum": self.params.paper.expert_grad_accum if bf16_weights else "fp32", **extra.pop("optim", {})},
            **extra,
        }

    def learned(self, stage: str) -> bool:
        return stage in self.params.paper.learned_routing

    def run(self, name: str, sections: dict[str, Any], **kw: Any) -> dict[str, Any]:
        """Measure one variant; a variant this setup cannot run is recorded with the reason.

        On GPUs `moe plan` checks the variant first: one predicted not to fit is not launched."""
        predicted = None
        if self.hw.kind == "gpu":
            try:
                predicted = predict_peak_gib(
                    sections["model"],
                    sections["data"]["seq_len"],
                    sections["train"]["micro_batch_size"],
                    self.hw.count,
                    sections["parallel"],
                    sections["train"].get("recompute", "none"),
                )
            except ConfigError as exc:
                return {"name": name, "status": "not run", "reason": str(exc).splitlines()[0]}
            if predicted > self.hw.memory_gib:
                return {
                    "name": name,
                    "status": "not run",
                    "predicted_peak_gib": predicted,
                    "reason": f"moe plan predicts {predicted:.1f} GiB, over the {self.hw.memory_gib:.1f} GiB of one GPU",
                }
        kw.setdefault("profile", self.params.paper.profile)
        try:
            m = measure(self.params.base, name, sections, self.work, self.steps, tracker=self.tracker, **kw)
        except ConfigError as exc:  # this setup cannot express the variant (e.g. FP8 on a CPU)
            return {"name": name, "status": "not run", "reason": str(exc).splitlines()[0]}
        except JobFailed as exc:  # recorded, and shown as a failure in the report
            return {"name": name, "status": "failed", "reason": str(exc).splitlines()[0]}
        m["status"] = "ok"
        m["predicted_peak_gib"] = predicted
        return m


def _ok(v: dict[str, Any]) -> bool:
    return v.get("status") == "ok"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def resident(ctx: Context) -> dict[str, Any]:
    w = ctx.hw.count
    ours = {"ep": w, "shard_optimizer": True}
    fsdp = {"data_parallel": "fsdp"}
    p = ctx.params.paper
    shape = paper_shape(ctx.hw, 64, p.seq_len, p.micro_batch_size, [ours, fsdp], p.memory_fraction)
    a = ctx.run("resident-ddp-ep-zero1", ctx.sections(shape, ours))
    # FSDP2 keeps fp32 shards and computes in bf16 under autocast (amp_bf16), as the paper's baseline did.
    b = ctx.run("resident-fsdp2", ctx.sections(shape, fsdp, recipe="amp_bf16" if ctx.hw.kind == "gpu" else "auto"))
    derived = {}
    if _ok(a) and _ok(b):
        derived = {
            "speedup": _ratio(a["tokens_per_s_per_device"], b["tokens_per_s_per_device"]),
            "tokens_per_s_per_device": a["tokens_per_s_per_device"],
            "baseline_tokens_per_s_per_device": b["tokens_per_s_per_device"],
            "peak_ratio": _ratio(gib(a, "peak_mem_gib"), gib(b, "peak_mem_gib")),
        }
    note = "with one GPU both layouts hold everything; the comparison is meaningful from 2 GPUs on" if w == 1 else ""
    if derived and w == 1 and a.get("profile") and b.get("profile"):
        derived["projection"] = project_resident(a, b, CLAIMS["resident"].gpus)
    return {"shape": shape, "variants": [a, b], "derived": derived, "note": note}


# NCCL all-to-all between two H200s of our machines (shared/docs/platform.md): the link rate
# the projections assume for every collective.
LINK_GB_S = 258.0


def project_resident(ours: dict[str, Any], fsdp: dict[str, Any], gpus: int) -> dict[str, Any]:
    """What the paper's GPU count adds to each layout's one-GPU step: the bytes each must move.

    FSDP2 (fp32 shards, no mixed-precision policy, reshard after forward) all-gathers every
    weight for the forward and again for the backward and reduce-scatters every gradient, each
    micro-batch: 3 x 4 bytes x parameters x (G-1)/G per GPU. The resident layout moves token
    rows instead (all-to-all to the experts and back, forward and backward: 4 x tokens x k x
    d_model x 2 bytes x (G-1)/G per micro-batch) and reduces the dense gradients once per step
    (ZeRO-1: reduce-scatter + all-gather, 2 x 4 bytes x dense parameters). Both at the measured
    link rate; 'no overlap' adds the transfer to the step, 'full overlap' hides it under
    compute (the truth lies between)."""
    from moe.config import ModelConfig
    from moe.plan.accounting import param_counts

    cfg = ModelConfig.from_dict(ours["model"])
    counts = param_counts(cfg)
    expert_params = sum(cfg.moe.num_experts * 3 * cfg.d_model * cfg.moe.expert_hidden for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
    moe_layers = sum(1 for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
    share = (gpus - 1) / gpus
    accum, rows = ours["accumulation"], ours["micro_batch_size"] * ours["seq_len"]
    fsdp_bytes = accum * 12 * counts.total * share
    ours_bytes = accum * 4 * rows * cfg.moe.top_k * cfg.d_model * 2 * moe_layers * share + 8 * (counts.total - expert_params) * share
    t_fsdp, t_ours = fsdp_bytes / LINK_GB_S / 1e9, ours_bytes / LINK_GB_S / 1e9
    c_fsdp, c_ours = fsdp["step_time_s"], ours["step_time_s"]
    return {
        "gpus": gpus,
        "link_gb_s": LINK_GB_S,
        "fsdp_transfer_s": t_fsdp,
        "resident_transfer_s": t_ours,
        "speedup_no_overlap": (c_fsdp + t_fsdp) / (c_ours + t_ours),
        "speedup_full_overlap": max(c_fsdp, t_fsdp) / max(c_ours, t_ours),
        "model": "FSDP2: 12 B x params x (G-1)/G per micro-batch; resident: 4 all-to-alls of k bf16 rows per token, MoE layer and "
        "micro-batch, + dense ZeRO-1 once",
    }


def experts(ctx: Context) -> dict[str, Any]:
    p = ctx.params.paper
    w = ctx.hw.count
    layout = {"ep": w, "shard_optimizer": True}
    counts = sorted(e for e in p.experts if e % w == 0)
    if not counts:
        raise ConfigError(f"paper.experts: no count divisible by the {w} expert-parallel ranks")
    # The largest count decides the shape; every count then runs that same shape.
    shape = paper_shape(ctx.hw, counts[-1], p.seq_len, p.micro_batch_size, [layout], p.memory_fraction)

    def variant(e: int, routing: str) -> dict[str, Any]:
        model = {**shape.model, "moe": {**shape.model["moe"], "num_experts": e, "routing": routing}}
        name = f"experts-{e}" + ("-learned" if routing == "learned" else "")
        return ctx.run(name, ctx.sections(dataclasses.replace(shape, model=model), layout))

    variants = [variant(e, "random") for e in counts]
    # Learned routing (labelled rows): the two ends of the sweep, the router's own imbalance in.
    learned = [variant(e, "learned") for e in sorted({counts[0], counts[-1]})] if ctx.learned("experts") and len(counts) > 1 else []
    ok = [v for v in variants if _ok(v)]
    derived: dict[str, Any] = {}
    if len(ok) >= 2:
        first, last = ok[0], ok[-1]
        derived = {
            "drop": 1 - first_last_ratio(first, last),
            "experts_from": first["model"]["moe"]["num_experts"],
            "experts_to": last["model"]["moe"]["num_experts"],
            "tokens_per_s_per_device": {str(v["model"]["moe"]["num_experts"]): v["tokens_per_s_per_device"] for v in ok},
        }
        if len(learned) == 2 and all(_ok(v) for v in learned):
            derived["drop_learned"] = 1 - first_last_ratio(*learned)
        if all(v.get("profile") for v in ok):
            e_from, e_to = first["model"]["moe"]["num_experts"], last["model"]["moe"]["num_experts"]
            derived["projection"] = project_expert_parallel(ok, e_from, e_to, CLAIMS["experts"].gpus)
    return {"shape": shape, "variants": variants + learned, "derived": derived}


def project_expert_parallel(variants: list[dict[str, Any]], e_from: int, e_to: int, gpus: int) -> dict[str, Any]:
    """What spreading the experts over ``gpus`` GPUs (EP = ``gpus``) would do to the drop.

    The model: with balanced (random) routing each GPU then holds E/G experts and computes
    the same number of rows as one GPU alone does (its share of every GPU's tokens), so a cost
    that grows with the experts a GPU holds (optimizer step and gradient folds over their
    weights, smaller GEMM groups) is the one-GPU cost at E/G experts; everything else is
    unchanged. Per profile category, a least-squares line in the expert count through our
    one-GPU measurements gives that cost. Not modelled: the all-to-all the paper pays at both
    ends of the sweep (it leaves the ratio near where this puts it only if it is small or the
    same at both ends) and the gaps between kernels."""
    from moe.spans import CATEGORIES

    xs = [float(v["model"]["moe"]["num_experts"]) for v in variants]

    def line(ys: list[float]) -> tuple[float, float]:
        b = _slope(xs, ys) or 0.0
        return sum(ys) / len(ys) - b * sum(xs) / len(xs), b

    fits = {c: line([v["profile"][c] for v in variants]) for c in CATEGORIES}

    def step_ms(experts_per_gpu: float) -> float:
        return sum(a + b * experts_per_gpu for a, b in fits.values())

    one_from, one_to = step_ms(e_from), step_ms(e_to)
    ep_from, ep_to = step_ms(e_from / gpus), step_ms(e_to / gpus)
    return {
        "gpus": gpus,
        "model": "per category: ms = a + b * experts held per GPU (least squares over the measured counts); EP=G holds E/G",
        "per_category_ms_per_expert": {c: b for c, (_, b) in fits.items()},
        "kernel_ms_one_gpu": {str(e_from): one_from, str(e_to): one_to},
        "kernel_ms_ep": {str(e_from): ep_from, str(e_to): ep_to},
        "drop_one_gpu_fit": 1 - one_from / one_to,
        "drop_projected": 1 - ep_from / ep_to,
    }


def first_last_ratio(first: dict[str, Any], last: dict[str, Any]) -> float:
    return last["tokens_per_s_per_device"] / first["tokens_per_s_per_device"]


def fp8_recipe(ctx: Context) -> tuple[str | None, str]:
    choice = ctx.params.paper.fp8_recipe
    need = RECIPE_FACTS["fp8_rowwise"].min_capability
    if ctx.hw.kind != "gpu":
        return None, f"FP8 needs a CUDA GPU (compute capability >= {need[0]}.{need[1]}); this run is on CPUs"
    if choice != "auto":
        return choice, ""
    cap = ctx.hw.capability or (0, 0)
    fp8_recipes = sorted((n for n, f in RECIPE_FACTS.items() if f.fp8), key=lambda n: RECIPE_FACTS[n].min_capability, reverse=True)
    for recipe in fp8_recipes:  # the best the device runs (the newest hardware's first)
        if capability_problem(recipe, cap, ctx.hw.name) is None:
            return recipe, ""
    return None, f"FP8 needs compute capability >= {need[0]}.{need[1]}; {ctx.hw.name} has {cap[0]}.{cap[1]}"


def fp8(ctx: Context) -> dict[str, Any]:
    p = ctx.params.paper
    layout = {"ep": ctx.hw.count, "shard_optimizer": True}
    shape = paper_shape(ctx.hw, 64, p.seq_len, p.micro_batch_size, [layout], p.memory_fraction)
    base_recipe = "bf16" if ctx.hw.kind == "gpu" else "auto"
    a = ctx.run("fp8-baseline-" + base_recipe, ctx.sections(shape, layout, recipe=base_recipe))
    recipe, why = fp8_recipe(ctx)
    if recipe is None:
        b = {"name": "fp8", "status": "not run", "reason": why}
    else:
        # Every expert GEMM in FP8 (fp8_min_dim 0): the stage measures the format, not the
        # per-shape fallback rule, which would keep these shapes in bf16 (moe/layers/gemm_fp8.py).
        b = ctx.run(f"fp8-{recipe}", ctx.sections(shape, layout, recipe=recipe, precision={"fp8_min_dim": 0}))
    derived = {}
    if _ok(a) and _ok(b):
        derived = {
            "speedup": _ratio(b["tokens_per_s_per_device"], a["tokens_per_s_per_device"]),
            "peak_ratio": _ratio(gib(b, "peak_mem_gib"), gib(a, "peak_mem_gib")),
            "recipe": recipe,
            "peak_gib": gib(b, "peak_mem_gib"),
            "baseline_peak_gib": gib(a, "peak_mem_gib"),
        }
        if a.get("profile") and b.get("profile"):
            derived["projection"] = project_fp8(a, b, CLAIMS["fp8"].gpus)
    return {"shape": shape, "variants": [a, b], "derived": derived}


def project_fp8(bf16: dict[str, Any], fp8: dict[str, Any], gpus: int) -> dict[str, Any]:
    """What the paper's GPU count (EP = G) would change in the FP8 gain, from the profiles.

    Under EP every GPU computes as many expert rows as one GPU alone, so the expert GEMMs and
    the activation and gradient quantisation keep their measured times; only quantising the
    weights (part of the measured FP8 quantisation, not separated) shrinks to 1/G. The estimate
    takes all of it to be weights (generous to FP8) and the rest of both steps as measured (the
    optimizer and gradient adds over the experts shrink with G in both, which would raise the
    ratio a little). And the ceiling: FP8 covers the expert GEMMs only, so even
    expert GEMMs of zero time would give step / (step - expert GEMMs)."""
    pb, pf = bf16["profile"], fp8["profile"]
    step_b, step_f = bf16["step_time_s"] * 1e3, fp8["step_time_s"] * 1e3
    quant = pf.get("fp8_quantize", 0.0)
    return {
        "gpus": gpus,
        "expert_gemm_speedup": pb["expert_gemm"] / pf["expert_gemm"] if pf.get("expert_gemm") else None,
        "expert_gemm_share_bf16": pb["expert_gemm"] / step_b,
        "quantize_ms": quant,
        "speedup_bound_at_gpus": step_b / (step_f - quant * (1 - 1 / gpus)),
        "speedup_ceiling_expert_gemms_free": step_b / (step_b - pb["expert_gemm"]),
    }


def recompute(ctx: Context) -> dict[str, Any]:
    p = ctx.params.paper
    layout = {"ep": ctx.hw.count, "shard_optimizer": True}
    shape = paper_shape(ctx.hw, 64, p.seq_len, p.micro_batch_size, [layout], p.memory_fraction)
    if ctx.hw.kind == "gpu" and p.micro_batch_size is None:
        # Recompute trades activations for time: measure it where activations matter, at the
        # largest micro-batch that `moe plan` says fits without recompute.
        budget = ctx.hw.memory_gib * p.memory_fraction
        for micro in (8, 4, 2):
            if predict_peak_gib(shape.model, shape.seq_len, micro, ctx.hw.count, layout) <= budget:
                shape = dataclasses.replace(
                    shape, micro_batch_size=micro, notes=[*shape.notes, f"micro-batch {micro} (the largest that fits without recompute)"]
                )
                break
    variants = [ctx.run(f"recompute-{mode}", ctx.sections(shape, layout, train={"recompute": mode})) for mode in p.recompute]
    base = variants[0]
    derived: dict[str, Any] = {}
    if _ok(base):
        for v in variants[1:]:
            if _ok(v):
                mode = v["name"].removeprefix("recompute-")
                derived[mode] = {
                    "above_rest_ratio": _ratio(gib(v, "above_rest_gib"), gib(base, "above_rest_gib")),
                    "peak_ratio": _ratio(gib(v, "peak_mem_gib"), gib(base, "peak_mem_gib")),
                    "throughput_ratio": _ratio(v["tokens_per_s_per_device"], base["tokens_per_s_per_device"]),
                }
    return {"shape": shape, "variants": variants, "derived": derived}


def ep(ctx: Context) -> dict[str, Any]:
    p = ctx.params.paper
    w = ctx.hw.count
    sizes = [e for e in range(1, w + 1) if w % e == 0]
    layouts = [{"ep": e, "shard_optimizer": True} for e in sizes]
    shape = paper_shape(ctx.hw, 64, p.seq_len, p.micro_batch_size, layouts, p.memory_fraction)
    variants = []
    for e in sizes:
        for backend in p.ep_backends if e > 1 else p.ep_backends[:1]:
            par = {"ep": e, "shard_optimizer": True, "ep_backend": backend}
            variants.append(ctx.run(f"ep{e}-{backend}", ctx.sections(shape, par)))
    ok = {v["name"]: v for v in variants if _ok(v)}
    base = ok.get(f"ep1-{p.ep_backends[0]}")
    derived = {
        name: {"step_time_s": v["step_time_s"], "relative_to_ep1": _ratio(v["step_time_s"], base["step_time_s"]) if base else None}
        for name, v in ok.items()
    }
    return {"shape": shape, "variants": variants, "derived": derived}


MAX_LOG_BYTES = 256 * MIB  # a rank's log of the measured run (a few MB)


def gerrymander(ctx: Context) -> dict[str, Any]:
    """Learned routing on the tokenised corpus: the balance loss and the measured load together."""
    p, base = ctx.params.paper, ctx.params.base
    vocab = read_manifest(base.tokenize.output)["tokenizer"]["vocab_size"]
    if ctx.hw.kind == "gpu":
        model = {"preset": "olmoe-1b-7b", "n_layers": 4, "vocab_size": max(vocab, 256), "max_seq_len": 1024}
        seq, micro = 1024, 8
        note = "OLMoE-1B-7B width, 4 layers, sequence 1024, on the tokenised corpus"
    else:
        model = {"preset": "tiny", "vocab_size": vocab, "max_seq_len": 64}
        seq, micro = 64, 4
        note = "CPU scale: the tiny model on the tokenised corpus"
    from moe.config import ModelConfig

    shape = Scaled(ModelConfig.from_dict(model).to_dict(), seq, micro, [note])
    steps = p.gerrymander_steps
    sections = ctx.sections(shape, {"ep": 1}, accumulate=False, train={"max_steps": steps})
    sections["schedule"] = {"warmup_steps": max(1, steps // 10)}
    sections["optim"]["lr"] = 3e-3 if ctx.hw.kind == "cpu" else 4e-4
    from pipeline.paper.measure import measure as _measure

    log_every = max(1, steps // 20)
    sections["train"]["log_every"] = log_every
    v = _measure(
        base, "gerrymander", sections, ctx.work, log_every, data_dir=Path(base.tokenize.output) / "train", tracker=ctx.tracker, profile=False
    )
    v["status"] = "ok"
    rows = [r for r in v["rows"] if "lb_loss" in r]
    derived = load_trends(rows)
    fired = sorted(
        {k.removeprefix("load_alarm/layer_") for r in v["rows"] for k, x in r.items() if k.startswith("load_alarm/layer_") and x > 0}, key=int
    )
    derived["alarm"] = f"fired (layers {', '.join(fired)})" if fired else "quiet"
    logs = Path(ctx.work) / "gerrymander" / "logs"
    derived["alarm_lines"] = [
        line.split("token gerrymandering alarm: ", 1)[1].strip()
        for f in sorted(logs.glob("*.log"))
        for line in read_bytes(f, MAX_LOG_BYTES).decode(errors="replace").splitlines()  # the job's log, as text
        if "token gerrymandering alarm: " in line
    ]
    v["history"] = [{k: r.get(k) for k in ("step", "loss", "lb_loss", "expert_load_max_over_mean")} for r in rows]
    return {"shape": shape, "variants": [v], "derived": derived}


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


def load_trends(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Least-squares trends (per 1000 steps) of the balance loss and the busiest expert's load
    over the second half of the run; 'diverging' when the loss improves while the load worsens."""
    half = rows[len(rows) // 2 :]
    steps = [float(r["step"]) for r in half]
    lb = [r["lb_loss"] for r in half]
    load = [r.get("expert_load_max_over_mean") for r in half]
    lb_slope = _slope(steps, lb)
    load_slope = _slope(steps, load) if all(x is not None for x in load) else None
    out: dict[str, Any] = {
        "lb_loss_first": rows[0]["lb_loss"] if rows else None,
        "lb_loss_last": rows[-1]["lb_loss"] if rows else None,
        "max_over_mean_first": rows[0].get("expert_load_max_over_mean") if rows else None,
        "max_over_mean_last": rows[-1].get("expert_load_max_over_mean") if rows else None,
        "lb_loss_trend_per_1k": lb_slope * 1000 if lb_slope is not None else None,
        "max_over_mean_trend_per_1k": load_slope * 1000 if load_slope is not None else None,
    }
    out["diverging"] = bool(lb_slope is not None and load_slope is not None and lb_slope <= 0 < load_slope)
    return out


STAGE_FUNCS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "resident": resident,
    "experts": experts,
    "fp8": fp8,
    "recompute": recompute,
    "ep": ep,
    "gerrymander": gerrymander,
}


def _is_stage_result(path: Path) -> bool:
    """A result file a stage wrote (what the report reads, checked the report's way)."""
    from pipeline.paper.results import load_stage_result

    try:
        load_stage_result(path)
    except PipelineError:
        return False
    return True


def run_stage(stage: str, params: PaperParams, tracker=None) -> Path:
    if stage not in STAGE_FUNCS:
        raise ConfigError(f"stage: unknown stage {stage!r}; known: {', '.join(STAGE_FUNCS)}")
    hw = detect(params)
    ctx = Context(params, hw, tracker)
    try:
        out = STAGE_FUNCS[stage](ctx)
    except ValueError as exc:  # the scaling rule found no shape that fits
        if isinstance(exc, ConfigError):
            raise
        raise PipelineError(f"paper stage {stage}: {exc}") from None
    claim = CLAIMS[stage]
    shape: Scaled = out.pop("shape")
    result = {
        "stage": stage,
        "claim": dataclasses.asdict(claim),
        "hardware": dataclasses.asdict(hw) | {"describe": hw.describe()},
        "scaling": {
            "shape": shape.describe(),
            "notes": shape.notes,
            "model": shape.model,
            "seq_len": shape.seq_len,
            "micro_batch_size": shape.micro_batch_size,
        },
        "steps_per_measurement": ctx.steps,
        "commit": commit_label(),
        **out,
    }
    for v in result["variants"]:
        v.pop("rows", None)  # the per-step rows stay in the run directory (metrics.jsonl)
    path = Path(params.paper.results) / f"{stage}.json"
    write_output_file(path, json.dumps(result, indent=2, default=str) + "\n", "paper.results", _is_stage_result)
    if tracker is not None:
        flat = {}
        for k, v in result["derived"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                flat[f"derived/{k}"] = v
            elif isinstance(v, dict):
                flat.update({f"derived/{k}/{kk}": vv for kk, vv in v.items() if isinstance(vv, (int, float)) and not isinstance(vv, bool)})
        tracker.log_metrics(flat)
        tracker.set_tags({"paper.hardware": hw.describe(), "paper.scaling": shape.describe()[:4900]})
        tracker.log_artifact(path)
    return path
