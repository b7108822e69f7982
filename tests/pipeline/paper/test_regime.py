"""The paper's regime in every stage: tokens per step by accumulation, the routing and the
accumulation mode chosen per recipe, and the projection to the paper's GPU count."""

import pytest

from moe.config import ConfigError
from moe.spans import CATEGORIES
from pipeline.paper.config import load_paper_params
from pipeline.paper.hardware import Hardware
from pipeline.paper.report import profile_table, regime_label
from pipeline.paper.scaling import Scaled
from pipeline.paper.stages import Context, project_expert_parallel

H200 = Hardware("gpu", "H200", 1, 139.8, (9, 0))


def context(tmp_path, hw, *sets):
    p = tmp_path / "params.yaml"
    p.write_text("paper: {}\n")
    return Context(load_paper_params(p, list(sets)), hw)


def shape(micro=1, seq=8192):
    return Scaled({"moe": {"num_experts": 8, "routing": "random"}}, seq, micro, [])


def test_gpu_stages_step_on_the_paper_batch_by_accumulation(tmp_path):
    ctx = context(tmp_path, H200)
    s = ctx.sections(shape(), {"ep": 1, "shard_optimizer": True})
    assert s["train"]["micro_batch_size"] == 1 and s["train"]["global_batch_size"] == 32  # 32 x 8192 = 262,144
    assert s["optim"]["expert_grad_accum"] == "bf16"
    # A micro-batch that does not divide the target rounds up to whole micro-batches.
    assert ctx.sections(shape(micro=3), {"ep": 1})["train"]["global_batch_size"] == 3 * 11
    # FSDP2's fp32 shards under autocast cannot hold a bf16 gradient: fp32 there.
    assert ctx.sections(shape(), {"data_parallel": "fsdp"}, recipe="amp_bf16")["optim"]["expert_grad_accum"] == "fp32"
    # The learned-routing stage measures quality of routing, not the paper's batch.
    assert ctx.sections(shape(micro=8, seq=1024), {"ep": 1}, accumulate=False)["train"]["global_batch_size"] == 8
    two = context(tmp_path, Hardware("gpu", "H200", 2, 139.8, (9, 0)), "paper.tokens_per_step=65536", "paper.expert_grad_accum=fp32")
    s = two.sections(shape(), {"ep": 2})
    assert s["train"]["global_batch_size"] == 2 * 8 and s["optim"]["expert_grad_accum"] == "fp32"


def test_cpu_stages_accumulate_two_micro_batches_in_fp32(tmp_path):
    ctx = context(tmp_path, Hardware("cpu", "cpu", 2, None))
    s = ctx.sections(shape(micro=2, seq=64), {"ep": 2})
    assert s["train"]["global_batch_size"] == 2 * 2 * 2 and s["optim"]["expert_grad_accum"] == "fp32"


def test_regime_keys_are_checked(tmp_path):
    p = tmp_path / "params.yaml"
    for text, key in (
        ("paper: {tokens_per_step: 0}\n", "paper.tokens_per_step: must be >= 1"),
        ("paper: {learned_routing: [gerrymander]}\n", "paper.learned_routing: unknown stage 'gerrymander'"),
        ("paper: {expert_grad_accum: fp16}\n", "paper.expert_grad_accum"),
    ):
        p.write_text(text)
        with pytest.raises(ConfigError, match=key):
            load_paper_params(p)


def variant(experts, parts, step_ms=None):
    profile = {c: parts.get(c, 0.0) for c in CATEGORIES}
    profile["total"] = sum(profile.values())
    return {
        "name": f"experts-{experts}",
        "status": "ok",
        "model": {"moe": {"num_experts": experts}},
        "profile": profile,
        "step_time_s": (step_ms or profile["total"] + 5) / 1e3,
        "tokens_per_step_per_device": 262144,
        "micro_batch_size": 1,
        "accumulation": 32,
        "routing": "random",
        "dropless": True,
        "tokens_dropped_fraction": 0.0,
        "expert_grad_accum": "bf16",
        "tokens_per_s_per_device": 1.0,
        "tflops_per_device": 1.0,
    }


def test_projection_spreads_the_expert_proportional_parts_over_the_paper_gpus():
    # optimizer: 1 ms per expert; expert GEMMs: 100 ms + 0.5 ms per expert; the rest constant.
    vs = [variant(e, {"optimizer": 1.0 * e, "expert_gemm": 100 + 0.5 * e, "other": 50.0}) for e in (8, 32, 128)]
    p = project_expert_parallel(vs, 8, 128, 8)
    assert p["per_category_ms_per_expert"]["optimizer"] == pytest.approx(1.0)
    assert p["per_category_ms_per_expert"]["expert_gemm"] == pytest.approx(0.5)
    assert p["kernel_ms_one_gpu"]["8"] == pytest.approx(150 + 1.5 * 8)
    assert p["kernel_ms_ep"]["128"] == pytest.approx(150 + 1.5 * 16)  # 16 experts held per GPU
    assert p["drop_projected"] == pytest.approx(1 - (150 + 1.5) / (150 + 24))
    assert p["drop_one_gpu_fit"] == pytest.approx(1 - 162 / 342)
    r = {"stage": "experts", "variants": vs, "derived": {"projection": p}}
    text = "\n".join(profile_table(r))
    assert "| optimizer step (AdamW, master -> bf16) | 8 | 32 | 128 | +24.0 | +120.0 |" in text
    assert "EP=8" in text and "+1" in text  # ms per expert held
    assert "262,144 tokens/step/device (1 x 32 micro-batches); routing random; dropless (dropped, measured: max 0.00%)" in regime_label(vs)


def test_resident_projection_counts_the_bytes_each_layout_moves():
    from pipeline.paper.stages import LINK_GB_S, project_resident

    model = {"preset": "tiny", "n_layers": 2, "vocab_size": 256}
    ours = {"model": model, "accumulation": 4, "micro_batch_size": 2, "seq_len": 64, "step_time_s": 1.0}
    fsdp = {**ours, "step_time_s": 1.2}
    p = project_resident(ours, fsdp, 8)
    from moe.config import ModelConfig
    from moe.plan.accounting import param_counts

    cfg = ModelConfig.from_dict(model)
    total = param_counts(cfg).total
    assert p["fsdp_transfer_s"] == pytest.approx(4 * 12 * total * 7 / 8 / LINK_GB_S / 1e9)
    assert p["speedup_no_overlap"] == pytest.approx((1.2 + p["fsdp_transfer_s"]) / (1.0 + p["resident_transfer_s"]))
    assert p["speedup_full_overlap"] == pytest.approx(1.2)  # transfers this small hide under compute


def test_fp8_projection_bounds_the_gain_from_the_profiles():
    from pipeline.paper.stages import project_fp8

    bf16 = {"step_time_s": 1.0, "profile": {"expert_gemm": 200.0}}
    fp8 = {"step_time_s": 0.95, "profile": {"expert_gemm": 120.0, "fp8_quantize": 40.0}}
    p = project_fp8(bf16, fp8, 4)
    assert p["expert_gemm_speedup"] == pytest.approx(200 / 120) and p["expert_gemm_share_bf16"] == pytest.approx(0.2)
    assert p["speedup_bound_at_gpus"] == pytest.approx(1000 / (950 - 30))
    assert p["speedup_ceiling_expert_gemms_free"] == pytest.approx(1000 / 800)
