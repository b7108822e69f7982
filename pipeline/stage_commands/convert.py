"""`moe convert`: a DCP checkpoint -> a Hugging Face OLMoE directory, or the reverse
(pipeline/stages/convert.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pipeline.commands import StageRun, load_config, stage_tracker
from pipeline.console import NoTrackOpt, ParamsOpt, SetOpt, console, fail, typer


def command(
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    checkpoint: Annotated[Path | None, typer.Option(help="checkpoint (default: checkpoint.dir's latest)")] = None,
    out: Annotated[Path | None, typer.Option(help="output directory (default: convert.output)")] = None,
    from_hf: Annotated[Path | None, typer.Option("--from-hf", help="convert this HF OLMoE directory to a DCP checkpoint at --out")] = None,
    no_mlflow: NoTrackOpt = False,
) -> None:
    """DCP checkpoint -> Hugging Face OLMoE directory (or --from-hf DIR --out CKPT for the reverse)."""
    if from_hf is not None:
        if out is None:
            fail("--from-hf needs --out (the checkpoint directory to write)", 2)
        from pipeline.stages.convert import convert_from_hf

        model_cfg = convert_from_hf(from_hf, out)
        console.print(f"wrote {out}/step_00000000; train from it with checkpoint.init_from={out} and this model section:")
        import yaml

        written = {k: v for k, v in model_cfg.to_dict().items() if k not in ("preset", "preset_overrides")}
        print(yaml.safe_dump({"model": written}, sort_keys=False))
        return
    cfg = load_config(params, set_)  # a config error answers before torch loads
    from pipeline.model_card import card_writer
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer

    with StageRun(stage_tracker(cfg, "convert", params, not no_mlflow)) as tracker:
        prov = convert_to_hf(
            checkpoint or cfg.checkpoint.dir,
            out or cfg.convert.output,
            load_tokens_tokenizer(cfg.tokenize.output),
            dtype=cfg.convert.dtype,
            max_shard_bytes=cfg.convert.max_shard_bytes,
            tokenizer_file=Path(cfg.tokenize.output) / "tokenizer.json",
            card=card_writer(cfg, out or cfg.convert.output),
        )
        if tracker:
            tracker.set_tags({"convert.checkpoint": prov["checkpoint"], "convert.step": prov["step"]})
            if cfg.convert.log_model:  # the converted Hugging Face model, loadable from the run's artifacts
                tracker.log_artifacts(out or cfg.convert.output, "hf_model")
            log_converted_model(tracker, Path(out or cfg.convert.output), prov)
    console.print(f"converted {prov['checkpoint']} -> {out or cfg.convert.output}")


def log_converted_model(tracker, directory: Path, prov: dict) -> None:
    """The conversion as an MLflow 3 logged model (its files are the run's hf_model/ artifacts);
    the evaluate stage links its scores to it (pipeline.stages.evaluate.converted_model_identity)."""
    from pipeline.stages.evaluate import converted_model_identity

    cfg = read_json_file_quiet(directory / "config.json")
    params = {"checkpoint": prov["checkpoint"], "step": prov["step"], "artifacts": f"runs:/{tracker.run_id}/hf_model"}
    params.update({k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "vocab_size") if k in cfg})
    tracker.log_model(f"moe-olmoe-step{prov['step']}", directory, converted_model_identity(directory), params, upload=False)


def read_json_file_quiet(path: Path) -> dict:
    """An HF config.json's settings (pipeline.hub.HF_CONFIG_SCHEMA), or {} where it is not one:
    the logged model's params are a courtesy, never a failed stage."""
    from moe.reader import FileFormatError, read_json
    from pipeline.hub import HF_CONFIG_SCHEMA, MAX_HF_CONFIG_BYTES

    try:
        return read_json(path, HF_CONFIG_SCHEMA, MAX_HF_CONFIG_BYTES)
    except FileFormatError:
        return {}
