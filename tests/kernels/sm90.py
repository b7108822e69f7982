"""Compile a Triton kernel for sm90 (H100/H200) on a machine without a GPU: Triton's own ptxas
builds the cubin, cuobjdump reads its registers, spill stack and shared memory, and the PTX says
whether the tensor-core path is Hopper's wgmma. What the GPU would run, checked before it runs."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for_sm90(kernel, types: dict[str, str], constexprs: dict[str, object], return_ptx: bool = False, **options) -> dict:
    """``types``: Triton type per runtime argument ("*bf16", "i32", ...); every other argument of
    the kernel must be in ``constexprs``. Integer and pointer arguments get the divisibility-by-16
    hint a real launch gives them when their values allow (what makes loads vectorise and the
    loop pipeline); ``G`` (expert counts) does not."""
    signature = {}
    for name in kernel.arg_names:
        if name in types:
            signature[name] = types[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        else:
            raise KeyError(f"{kernel.__name__}: no type or constexpr for argument {name!r}")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if signature[name] != "constexpr" and name != "G"}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=options
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    stats = {
        "registers": int(fields["REG"]),
        "spill_stack_bytes": int(fields["STACK"]),
        "local_bytes": int(fields["LOCAL"]),
        "shared_bytes": compiled.metadata.shared,
        "wgmma": "wgmma" in compiled.asm["ptx"],
    }
    return stats | {"ptx": compiled.asm["ptx"]} if return_ptx else stats
