"""The frozen base of a fine-tune through adapters (--lora), on the GPU: a part of the bf16 model that holds the
base's weights and nothing to train them with (no fp32 master, gradient or moments).

LoRA: every weight as bf16 (the copy the GEMMs read), the RMSNorms' in fp32.
QLoRA (--qlora): the seven linear weights of every block in NF4 (llama/ops/nf4.py, bitsandbytes' codes, each Meta
tensor quantized on its own as bitsandbytes quantizes each nn.Linear), dequantized into one bf16 scratch just before
each GEMM that reads them (the fused qkv and w1/w3 a member at a time into their rows); the embedding and an untied
head in bf16, the norms in fp32, as QLoRA keeps them.

The weights come from flat fp32 params on the host (one tensor at a time through a device staging buffer), or are
drawn on the GPU from the seed (llama/ops/init.py: the values init_parameters draws), so that 8B's base never
exists whole in fp32 on the device. Buffers are model/shapes.py's frozen_base."""

from __future__ import annotations

import numpy as np

from .. import ops
from ..params import ParameterLayout
from ..runtime.cuda import DeviceArray, allocate
from ..runtime.progress import phase
from .shapes import frozen_base, linear_members

STAGING = "staging"


class FrozenBase:
    def __init__(self, config, qlora: bool, params: np.ndarray | None, seed: int):
        self.config, self.qlora = config, qlora
        self.layout = layout = ParameterLayout(config)
        buffers = allocate(frozen_base(config, qlora))
        self.staging = buffers.pop(STAGING)  # fp32, a tensor (or a chunk of one) at a time
        self.buffers = buffers
        self.norms = {name: buffers[name] for name in layout.norm_names()}
        self.quantized = {}  # Meta name -> (codes, absmax_codes, absmax_scales, offset)
        if qlora:
            self.tables = buffers["nf4 tables"]
            self.tables.upload(ops.nf4_tables())
            for i in range(config.n_layers):
                for member in linear_members(layout, i):
                    self.quantized[member.name] = tuple(buffers[f"{member.name} {part}"]
                                                        for part in ("codes", "absmax_codes", "absmax_scales", "offset"))
        with phase("the frozen base on the GPU", total=layout.size, unit="param") as progress:
            for tensor in layout.tensors.values():
                self._fill(tensor, params, seed)
                progress.update(tensor.size)
        del self.staging  # the staging buffer goes: the accounting counts it only while the base is built

    def _values(self, tensor, start: int, n: int, params: np.ndarray | None, seed: int) -> DeviceArray:
        """n values of the flat parameters from offset start (within tensor) in the staging buffer, fp32."""
        out = self.staging.prefix(n)
        if params is None:
            ops.fill_parameters(out, self.layout, seed, start)
        else:
            out.upload(np.ascontiguousarray(params[start:start + n], np.float32))
        return out

    def _fill(self, tensor, params: np.ndarray | None, seed: int) -> None:
        """A tensor's values into its frozen form: fp32 (a norm), NF4 (a block's linear, QLoRA), else bf16, a chunk
        of the staging buffer's size at a time."""
        if tensor.name in self.norms:
            self.norms[tensor.name].copy_from(self._values(tensor, tensor.offset, tensor.size, params, seed)
                                              .reshape(tensor.shape))
        elif tensor.name in self.quantized:
            codes, absmax_codes, scales, offset = self.quantized[tensor.name]
            weights = self._values(tensor, tensor.offset, tensor.size, params, seed).reshape(tensor.shape)
            ops.nf4_quantize(codes, self.buffers["nf4 absmax"].prefix(absmax_codes.size), absmax_codes, scales, offset,
                             weights, self.tables)
        else:
            dense = self._dense(tensor).reshape(tensor.size)
            for at in range(0, tensor.size, self.staging.size):
                n = min(self.staging.size, tensor.size - at)
                ops.round_to_bf16(dense.view(at, (n,)), self._values(tensor, tensor.offset + at, n, params, seed))

    def _dense(self, tensor) -> DeviceArray:
        """A tensor kept in bf16: its view of the flat bf16 weights (LoRA) or its own buffer (QLoRA)."""
        if not self.qlora:
            return self.buffers["bf16 weights"].view(tensor.offset, tensor.shape)
        return self.buffers[tensor.name]

    def matrix(self, tensor) -> DeviceArray:
        """A weight as the GEMMs read it, bf16 (a Tensor of the layout, a block's fused qkv or w1/w3 too): QLoRA's
        dequantized now into the scratch, member by member."""
        if not self.qlora:
            return self.buffers["bf16 weights"].view(tensor.offset, tensor.shape)
        if tensor.name in self.buffers:
            return self.buffers[tensor.name]
        members = [t for t in self.layout.tensors.values()
                   if t.name in self.quantized and tensor.offset <= t.offset < tensor.offset + tensor.size]
        if not members or sum(t.size for t in members) != tensor.size:
            raise ValueError(f"{tensor.name}: not a weight of the frozen base")
        scratch, at = self.buffers["dequantized"], 0
        for member in members:
            ops.nf4_dequantize_bf16(scratch.view(at, member.shape), *self.quantized[member.name], self.tables)
            at += member.size
        return scratch.view(0, tensor.shape)

    def norm(self, name: str) -> DeviceArray:
        """An RMSNorm's fp32 weights."""
        return self.norms[name]
