"""Facts of the GPUs we plan for, and what each precision recipe needs of them: one table,
imported everywhere (the planner, MFU, the paper pipeline, the recipes' device checks).

Torch-free and device-free, so a CPU machine can plan a GPU job and check its recipe.
"""

from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    key: str  # h100, h200, ...
    name: str  # what the plan prints
    match: str  # the substring of torch.cuda.get_device_name() that identifies it
    memory_gib: float  # what torch.cuda reports as total memory
    peak_bf16_tflops: float  # dense bf16 tensor-core peak, without sparsity (vendor datasheets)
    capability: tuple[int, int]


# Capacity: the total memory CUDA reports (H200: measured by bench/memory.py; the others from
# their nvidia-smi totals, B300 from the datasheet's 288 GB).
GPUS = {
    "h100": GpuSpec("h100", "H100 80GB", "H100", 79.2, 989.0, (9, 0)),
    "h200": GpuSpec("h200", "H200 141GB", "H200", 139.8, 989.0, (9, 0)),
    "b200": GpuSpec("b200", "B200 180GB", "B200", 178.4, 2250.0, (10, 0)),
    "b300": GpuSpec("b300", "B300 288GB", "B300", 288e9 / GIB, 2250.0, (10, 0)),
}


def gpu_by_device_name(device_name: str) -> GpuSpec | None:
    """The spec of a CUDA device from its name (None for one not in the table)."""
    return next((g for g in GPUS.values() if g.match in device_name), None)


@dataclasses.dataclass(frozen=True)
class RecipeFacts:
    """What a precision recipe stores, computes and needs, known without a device (the one table
    of recipe facts: moe.precision builds its recipes from it)."""

    param_dtype: str  # "float32" | "bfloat16": how the model's weights are stored
    min_capability: tuple[int, int] | None = None  # its kernels' compute capability (None: any)
    autocast_dtype: str | None = None  # the autocast around forward and backward (None: none)
    expert_gemm: str = "grouped_mm"  # the experts' GEMM: grouped_mm (bf16), fp8_rowwise or mxfp8

    @property
    def master_weights(self) -> bool:
        return self.param_dtype != "float32"

    @property
    def fp8(self) -> bool:
        """Whether its expert GEMMs run in FP8 (or MXFP8)."""
        return self.expert_gemm != "grouped_mm"


RECIPES = {
    "fp32": RecipeFacts("float32"),
    "bf16": RecipeFacts("bfloat16", autocast_dtype="bfloat16"),
    "amp_bf16": RecipeFacts("float32", autocast_dtype="bfloat16"),
    # torch._scaled_grouped_mm rowwise: sm90+
    "fp8_rowwise": RecipeFacts("bfloat16", (9, 0), autocast_dtype="bfloat16", expert_gemm="fp8_rowwise"),
    # an MX kernel launched on sm90 once broke the CUDA context
    "mxfp8": RecipeFacts("bfloat16", (10, 0), autocast_dtype="bfloat16", expert_gemm="mxfp8"),
}


def recipe_on(name: str, gpu: bool) -> str:
    """The recipe ``auto`` stands for: bf16 on a GPU, fp32 on a CPU."""
    return ("bf16" if gpu else "fp32") if name == "auto" else name


def capability_problem(recipe: str, capability: tuple[int, int], device_name: str) -> str | None:
    """Why ``recipe`` cannot run on a device of ``capability`` (None: it can)."""
    need = RECIPES[recipe].min_capability if recipe in RECIPES else None
    if need is None or tuple(capability) >= need:
        return None
    hint = " (use fp8_rowwise on Hopper)" if recipe == "mxfp8" else ""
    return f"precision.recipe: {recipe} needs compute capability >= {need[0]}.{need[1]}, but {device_name} is sm{capability[0]}{capability[1]}{hint}"


def configure_cuda_allocator() -> None:
    """Expandable segments for torch's CUDA allocator unless the user configured it: without them
    FP8 with FP8 dense projections ran out of memory at paper width on an H200 with 9.4 GiB
    reserved but unallocated (fragmentation), where bf16 fits; with them it peaks at 132.5 GiB
    against bf16's 134.2, and bf16's speed is unchanged (bench/NOTES.md, issue 39). Read when CUDA
    first allocates, so this runs before that."""
    import os

    if not any(os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
