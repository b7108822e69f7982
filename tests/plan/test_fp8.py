"""The FP8 lines of a plan come from the code that runs FP8: the weights the recipe releases and
the copies its caches hold equal a built model's after a step (FP8 emulated on CPU), each GEMM's
choice is the trainer's rule's, and ZeRO-1 over several ranks keeps the bf16 weights."""

import pytest
import torch

from moe.config import ExperimentConfig
from moe.layers.experts import GroupedExperts
from moe.nn.fp8_linear import Fp8Linear
from moe.nn.fp8_policy import Fp8Gemms, Fp8Rule
from moe.plan.fp8 import saved_delta, weight_copy_bytes
from moe.plan.planner import make_plan
from moe.plan.ranks import rank_states
from moe.train.trainer import Trainer
from tests.helpers import tiny_config

FP8_LINES = ("FP8: bf16 expert weights released", "FP8 weight copies", "FP8: bf16 expert rows not saved", "FP8 expert backward")


def cached_bytes(cache) -> int:
    """Bytes of every copy a WeightCache holds (its rowwise, columnwise and bf16 tables)."""
    return sum(t.nbytes for table in (cache._rows, cache._cols, cache._dense) for _, *tensors in table.values() for t in tensors)


def built_fp8(trainer: Trainer) -> tuple[int, int]:
    """(bf16 bytes the optimizer released, bytes of the copies the caches hold) after one
    forward and backward of the built model."""
    trainer.model.train()
    trainer.layout.forward_backward(trainer.model, trainer.loader.next_batch(), lambda: trainer.recipe.autocast(trainer.device))
    params = {id(p): p for p in trainer.model.parameters()}
    released = sum(2 * params[i].numel() for i in trainer.opt.released)
    caches = [m.gemm.cache for m in trainer.model.modules() if isinstance(m, GroupedExperts) and hasattr(m.gemm, "cache")]
    caches += [m._fp8_cache for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    return released, sum(cached_bytes(c) for c in caches)


@pytest.mark.parametrize("min_dim", [0, 1 << 20], ids=["every-gemm-fp8", "rule-keeps-bf16"])
def test_released_weights_and_copies_equal_the_built_model(tmp_path, corpus, min_dim):
    precision = {"recipe": "fp8_rowwise", "emulate": True, "fp8_min_dim": min_dim, "fp8_dense": True, "fp8_dense_min_dim": 0}
    cfg = tiny_config(corpus, tmp_path / "ck", precision=precision, train={"max_steps": 1}, schedule={"warmup_steps": 1})
    (state,) = rank_states(cfg, cfg.resolve(1))
    released, copies = built_fp8(Trainer(cfg))
    # where the rule keeps every expert GEMM bf16 the layers run the bf16 GEMM: nothing released
    assert copies > 0 and (released > 0) == (min_dim == 0)
    assert (state.fp8.released, state.fp8.copies) == (released, copies)


def olmoe_fp8(micro: int, **precision) -> ExperimentConfig:
    return ExperimentConfig.load(
        {
            "model": {"preset": "olmoe-1b-7b", "n_layers": 2, "vocab_size": 8192, "max_seq_len": 4096},
            "data": {"seq_len": 4096},
            "train": {"global_batch_size": 2 * micro, "micro_batch_size": micro},
            "precision": {"recipe": "fp8_rowwise", **precision},
            "schedule": {"warmup_steps": 1},
        }
    )


def test_each_expert_gemm_follows_the_trainers_rule():
    """OLMoE width: 4,096 rows per expert (micro-batch 8) run every expert GEMM in FP8 and the
    FP8 pair replaces the bf16 weights byte for byte; at 1,024 (micro-batch 2) the rule runs none
    (Fp8Rule's tiers), so the layers run the bf16 GEMM and the plan has no FP8 terms."""
    m = olmoe_fp8(8).model
    rows, experts, d, hid = 8 * 4096 * m.moe.top_k, m.moe.num_experts, m.d_model, m.moe.expert_hidden
    (state,) = rank_states(olmoe_fp8(8), olmoe_fp8(8).resolve(1))
    e = state.fp8.experts
    assert e.up == Fp8Rule().plan(rows, experts, 2 * hid, d) and e.up.fwd
    assert e.down == Fp8Rule().plan_down(rows, experts, d, hid)
    assert state.fp8.copies == state.fp8.released + 4 * experts * (2 * hid + d + d + hid) * m.n_layers
    # the gathered bf16 rows are not saved where the up projection gathers FP8 rows itself
    assert saved_delta(m, e) == 16 * m.moe.top_k - 2 * m.moe.top_k * d - 2 * m.moe.top_k * hid
    assert Fp8Rule().plan(rows // 4, experts, 2 * hid, d).any is False
    (state,) = rank_states(olmoe_fp8(2), olmoe_fp8(2).resolve(1))
    assert state.fp8.experts is None and state.fp8.released == state.fp8.copies == 0


def test_fp8_min_dim_reaches_the_plan():
    """precision.fp8_min_dim above every dimension keeps every GEMM bf16: the layers run the bf16
    GEMM, and the plan is bf16's (no FP8 line)."""
    plain, kept = make_plan(olmoe_fp8(8), "h200", 1, knobs=False), make_plan(olmoe_fp8(8, fp8_min_dim=1 << 20), "h200", 1, knobs=False)
    assert plain.memory_gib["FP8: bf16 expert rows not saved"] < 0
    assert all(kept.memory_gib[k] == 0 for k in FP8_LINES)


def test_zero1_over_several_ranks_keeps_the_bf16_weights_and_adds_the_copies():
    cfg = ExperimentConfig.load(olmoe_fp8(8).to_dict(), ["parallel.shard_optimizer=true", "train.global_batch_size=16"])
    state = rank_states(cfg, cfg.resolve(2))[0]
    assert state.fp8.released == 0 and state.fp8.copies > 0
    lines = make_plan(cfg, "h200", 2, knobs=False).memory_gib
    assert lines["FP8: bf16 expert weights released"] == 0 and lines["FP8 weight copies"] > 0


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_recipes_without_fp8_gemms_have_no_fp8_lines(recipe):
    """mxfp8 runs MX fake quantisation on bf16 weights and saves bf16 operands: planned as bf16."""
    cfg = ExperimentConfig.load(olmoe_fp8(8).to_dict(), [f"precision.recipe={recipe}"])
    lines = make_plan(cfg, "b200", 1, knobs=False).memory_gib
    assert all(lines[k] == 0 for k in FP8_LINES)


def test_copies_are_one_byte_an_element_and_a_scale_a_row_or_column():
    both, fwd_only = Fp8Gemms(True, True, True), Fp8Gemms(True, False, False)
    assert weight_copy_bytes((4, 32, 16), both, released=True) == 2 * 4 * 32 * 16 + 4 * 4 * (32 + 16)
    assert weight_copy_bytes((4, 32, 16), fwd_only, released=True) == 3 * 4 * 32 * 16 + 4 * 4 * 32  # bf16 copy for dgrad
    assert weight_copy_bytes((32, 16), fwd_only, released=False) == 32 * 16 + 4 * 32
    assert weight_copy_bytes((32, 16), Fp8Gemms(False, False, False), released=False) == 0
    assert torch.empty((), dtype=torch.float8_e4m3fn).element_size() == 1
