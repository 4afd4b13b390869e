"""The matmul kernels a sampling model's Linear layers run on the CPU: `eval.linear_kernels` (every evaluation) and
`grpo.rollout_linear_kernels` (the GRPO rollouts' merged copy of the policy).

    aten    torch's own F.linear (MKL's sgemm): what training computes with
    onednn  each weight reordered once into oneDNN's blocked layout for the batch it will see, then
            torch.ops.mkldnn._linear_pointwise: the kernel torch.compile's CPU freezing pass puts in place of a
            Linear, called here without compiling anything

Why: decoding multiplies a handful of rows (the batch) by every weight matrix. MKL's sgemm on a transposed weight
runs such skinny products at a fraction of the GEMM peak, and its lm_head product at batch 16 at a third of what
oneDNN's packed kernel does (measured on SmolLM2-135M's shapes, AMD EPYC Zen 4, 2 cores). `make bench-real`
measures both on SmolLM2-135M-Instruct against the machine's roofline, and checks the greedy tokens are the same
(BENCHMARKS-real.md). On the 0.85M default model the layers are too small for it to pay (its batch-16 decode was
slower with it in the same measurement), hence the default `aten`.

The weights are the same fp32 numbers; oneDNN sums the products in another order, so a logit can differ from
aten's in its last bits (a greedy token only where two logits tie that closely). It is inference only (no
gradient flows through the packed weight) and CPU only; `reproducibility.mode: portable` refuses it, since
oneDNN picks its code per CPU and portable pins ATen, MKL and FBGEMM only.
"""

from __future__ import annotations

import torch
from torch import nn

KERNELS = ("aten", "onednn")


class LinearKernelsError(ValueError):
    """A model the onednn kernels cannot run; the message names the knob and what was expected."""


class OneDNNLinear(nn.Module):
    """A Linear layer for inference whose weight is also held in oneDNN's blocked layout (reordered for
    `batch_hint` rows). `weight` stays the dense parameter it was: PEFT and generate read its dtype and device, and
    a caller that changes it (grpo.merged_policy refreshing the merged weights) calls `repack()`."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.batch_hint = batch_hint
        self.repack()

    def repack(self) -> None:
        """Reorder the dense weight into oneDNN's layout again (after it changed)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, batch_hint={self.batch_hint}"


def use_linear_kernels(model: nn.Module, kernels: str, batch_hint: int, knob: str) -> int:
    """Put `kernels` in place in `model` (in place): with "onednn" every nn.Linear becomes a OneDNNLinear, with
    "aten" nothing changes. Refuses, naming `knob`, what oneDNN's fp32 kernel cannot run: a model off the CPU, a
    weight that is not fp32, a torch built without oneDNN.

    Returns:
        How many layers were replaced (0 with "aten").
    """
    if kernels not in KERNELS:
        raise LinearKernelsError(f"{knob}: expected one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "aten":
        return 0
    if not torch.backends.mkldnn.is_available():
        raise LinearKernelsError(f"{knob}: onednn needs a torch built with oneDNN (mkldnn); set {knob}: aten")
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    linears = [(parent, name, child) for parent, name, child in linears if type(child) is nn.Linear]
    for _, name, child in linears:
        if child.weight.device.type != "cpu" or child.weight.dtype != torch.float32:
            raise LinearKernelsError(
                f"{knob}: onednn runs fp32 weights on the CPU; layer {name} is {child.weight.dtype} on "
                f"{child.weight.device.type} (set {knob}: aten, or model.precision: fp32 on a CPU machine)"
            )
    for parent, name, child in linears:
        setattr(parent, name, OneDNNLinear(child, batch_hint))
    return len(linears)
