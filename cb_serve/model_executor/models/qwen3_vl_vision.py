"""Qwen3-VL's vision tower (``Qwen3VLVisionModel``), for images of any size: each image is a ``(t, h, w)`` grid
of 16 x 16 patches (``t`` = 1 for an image: the processor repeats its frame over the temporal patch of 2), the
rows of ``pixel_values`` in merge-block order (each 2 x 2 block's four patches together, blocks in raster order).

1. Patches by a ``Conv3d`` whose kernel is the patch (HF's op); a learned position table of ``side x side``
   entries resampled bilinearly (align_corners) to each image's grid, added;
2. pre-norm blocks whose attention is bidirectional within each image (not across images), with a fused
   ``qkv`` and an axial 2-D rotary embedding of each patch's (row, column), in float32;
3. after the blocks named by ``deepstack_visual_indexes``, a DeepStack merger of their hidden states; at the
   end the merger: each 2 x 2 block's four rows concatenated (a LayerNorm before, or after for DeepStack's),
   then ``fc2(GELU(fc1))`` to the text model's width.

``forward`` returns the merged tokens and the DeepStack features, ``[patches / 4, out_hidden]`` each. Follows
``transformers.models.qwen3_vl.modeling_qwen3_vl`` and ``transformers.vision_utils``, op for op, so float32
outputs are HF's on the same device."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve.model_executor.layers.rotary import rotate_half
from cb_serve.model_executor.layers.vision import activation, load_module

Grid = tuple[int, int, int]  # (t, h, w) in patches


def merge_block_coords(grids: Sequence[Grid], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in its image, in the rows' merge-block order."""
    rows, cols = [], []
    for t, h, w in grids:
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows.append(r.reshape(shape).transpose(1, 2).flatten().repeat(t))
        cols.append(c.reshape(shape).transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows), torch.cat(cols)


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps into a ``side``-long table, and their weights, per target index."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grids: Sequence[Grid], merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[patches, 4]`` indices into the flattened ``side x side`` position table and their weights."""
    rows, cols = merge_block_coords(grids, merge)
    heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids])
    widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids])
    h_taps, h_weights = _axis_taps(rows, heights, side)
    w_taps, w_weights = _axis_taps(cols, widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    return indices, (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)


class Qwen3VLVisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, patches, head_dim]
        outs = [
            F.scaled_dot_product_attention(qi, ki, vi, scale=self.scale).transpose(1, 2)
            for qi, ki, vi in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
        ]  # each image's patches attend to each other only
        return self.proj(torch.cat(outs, dim=1).reshape(n, -1).contiguous())


class Qwen3VLVisionBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Qwen3VLVisionAttention(dim, config.num_heads)
        self.act = activation(config.hidden_act)
        self.mlp = nn.ModuleDict(
            {
                "linear_fc1": nn.Linear(dim, config.intermediate_size),
                "linear_fc2": nn.Linear(config.intermediate_size, dim),
            }
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        h = self.norm2(x)
        return x + self.mlp["linear_fc2"](self.act(self.mlp["linear_fc1"](h)))


class Qwen3VLPatchMerger(nn.Module):
    """Four rows (one 2 x 2 block) to one token of the text model's width; ``postshuffle``: the LayerNorm
    over the concatenated rows (DeepStack's mergers) rather than over each."""

    def __init__(self, config, postshuffle: bool) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width) if self.postshuffle else x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVisionTower(nn.Module):
    """``forward(pixel_values [patches, C * T * P * P], grids) -> (tokens, [DeepStack features])``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.side = int(config.num_position_embeddings**0.5)
        self.patch_shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        kernel = self.patch_shape[1:]
        self.patch_embed = nn.ModuleDict(
            {"proj": nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel)}
        )
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.head_dim = config.hidden_size // config.num_heads
        self.theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.blocks = nn.ModuleList(Qwen3VLVisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3VLPatchMerger(config, postshuffle=False)
        self.deepstack_indexes = list(getattr(config, "deepstack_visual_indexes", None) or ())  # (none: Qwen3.5)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLPatchMerger(config, postshuffle=True) for _ in self.deepstack_indexes
        )

    def rotary(self, grids: Sequence[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        spatial = self.head_dim // 2  # (made here: the loader allocates buffers uninitialized)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        rows, cols = merge_block_coords(grids, self.merge)
        positions = torch.stack([rows, cols], dim=-1)
        device = self.pos_embed.weight.device
        freqs = (positions[..., None].float() * inv_freq).to(device)  # [patches, 2, head_dim / 4]
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = (torch.cat([t[:, 0], t[:, 1]], dim=-1) for t in (cos, sin))
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        proj = self.patch_embed["proj"]
        x = proj(pixel_values.view(-1, *self.patch_shape).to(proj.weight.dtype)).view(-1, proj.weight.shape[0])
        indices, weights = position_taps(grids, self.merge, self.side)
        pos = (self.pos_embed(indices.to(x.device)) * weights.to(x.device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = self.rotary(grids)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return self.merger(x), deepstack

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping, prefix: str) -> None:
        """From HF's names under ``prefix`` (``model.visual.``)."""
        load_module(self, state, prefix)
