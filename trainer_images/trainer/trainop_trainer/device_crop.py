"""The GPU path's crop, antialiased resize, flip and normalisation of a decoded batch in one
kernel launch (Triton), where the per-image path (torch_data.decode_batch's fallback) launches a
slice, a conversion and a resize per image from the rank's own process.

Why: the device half runs in the process that also launches the training step, under its GIL;
per image, the per-image path cost that process tens of microseconds of Python and launch work
(docs/benchmarks.md, issue 27). Here the whole batch is one table of per-image parameters (data
pointer, strides, crop box, flip), one host-to-device copy and one launch.

The filter is ATen's `_upsample_bilinear2d_aa` with align_corners=False, the one the CPU path's
workers and the per-image path use: for output column j of a crop w pixels wide, scale = w / size,
support = max(scale, 1), centre = scale (j + 0.5), taps s in [int(centre - support + 0.5),
int(centre + support + 0.5)) clipped to the crop, weight max(0, 1 - |s - centre + 0.5| / support),
normalised to sum 1; the same down the rows. Both axes are applied here in one 2-D sum per
output pixel, in float32, so the result is the per-image path's to float rounding (tested on the
GPU: tests/trainer/test_pipeline.py). The flip mirrors the output (column j samples the crop as
output column size - 1 - j would). The output is written through its strides, so channels_last
costs no extra copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainop_trainer import data

BLOCK = 256  # output pixels per program
_MEAN255 = [float(v) * 255.0 for v in data.MEAN]
_STD255 = [float(v) * 255.0 for v in data.STD]


@triton.jit
def _crop_resize_kernel(out_ptr, params_ptr, so_n, so_c, so_y, so_x, m0, m1, m2, d0, d1, d2,
                        SIZE: tl.constexpr, BLOCK: tl.constexpr):
    k = tl.program_id(0)
    p = params_ptr + k * 9  # one row of the table: pointer, strides (c, y, x), x, y, w, h, flip
    src = tl.load(p).to(tl.pointer_type(tl.uint8))
    sc = tl.load(p + 1)
    sy = tl.load(p + 2)
    sx = tl.load(p + 3)
    x0 = tl.load(p + 4)
    y0 = tl.load(p + 5)
    w = tl.load(p + 6).to(tl.int32)
    h = tl.load(p + 7).to(tl.int32)
    flip = tl.load(p + 8)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < SIZE * SIZE
    i = offs // SIZE
    j = offs % SIZE
    js = tl.where(flip != 0, SIZE - 1 - j, j)

    scale_x = w.to(tl.float32) / SIZE
    scale_y = h.to(tl.float32) / SIZE
    support_x = tl.maximum(scale_x, 1.0)
    support_y = tl.maximum(scale_y, 1.0)
    inv_x = 1.0 / support_x
    inv_y = 1.0 / support_y
    centre_x = scale_x * (js.to(tl.float32) + 0.5)
    centre_y = scale_y * (i.to(tl.float32) + 0.5)
    xmin = tl.maximum((centre_x - support_x + 0.5).to(tl.int32), 0)
    xmax = tl.minimum((centre_x + support_x + 0.5).to(tl.int32), w)
    ymin = tl.maximum((centre_y - support_y + 0.5).to(tl.int32), 0)
    ymax = tl.minimum((centre_y + support_y + 0.5).to(tl.int32), h)
    taps_x = (2.0 * support_x).to(tl.int32) + 2  # at least every tap's span
    taps_y = (2.0 * support_y).to(tl.int32) + 2

    total_x = tl.zeros([BLOCK], dtype=tl.float32)
    for t in range(0, taps_x):
        s = xmin + t
        wx = tl.maximum(1.0 - tl.abs((s.to(tl.float32) - centre_x + 0.5) * inv_x), 0.0)
        total_x += tl.where(s < xmax, wx, 0.0)
    total_y = tl.zeros([BLOCK], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK], dtype=tl.float32)
    for t in range(0, taps_y):
        r = ymin + t
        wy = tl.where(r < ymax, tl.maximum(1.0 - tl.abs((r.to(tl.float32) - centre_y + 0.5) * inv_y), 0.0), 0.0)
        total_y += wy
        row = src + (y0 + r.to(tl.int64)) * sy
        for u in range(0, taps_x):
            s = xmin + u
            ok = inside & (r < ymax) & (s < xmax)
            wgt = wy * tl.where(s < xmax, tl.maximum(1.0 - tl.abs((s.to(tl.float32) - centre_x + 0.5) * inv_x), 0.0),
                                0.0)
            q = row + (x0 + s.to(tl.int64)) * sx
            acc0 += wgt * tl.load(q, mask=ok, other=0).to(tl.float32)
            acc1 += wgt * tl.load(q + sc, mask=ok, other=0).to(tl.float32)
            acc2 += wgt * tl.load(q + 2 * sc, mask=ok, other=0).to(tl.float32)
    norm = 1.0 / (total_x * total_y)
    o = out_ptr + k.to(tl.int64) * so_n + i.to(tl.int64) * so_y + j.to(tl.int64) * so_x
    tl.store(o, (acc0 * norm - m0) / d0, mask=inside)
    tl.store(o + so_c, (acc1 * norm - m1) / d1, mask=inside)
    tl.store(o + 2 * so_c, (acc2 * norm - m2) / d2, mask=inside)


def crop_resize(images: list[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, out: torch.Tensor) -> None:
    """Write into `out` ((N, 3, size, size) float32 on a CUDA device, any memory format) each
    image's crop `boxes[k]` (x, y, w, h, on the CPU), resized to size² (bilinear, antialiased),
    mirrored where `flips[k]`, normalised. `images`: N uint8 (3, H, W) tensors on that device,
    any strides (torchvision's are contiguous, nvImageCodec's are HWC). One launch, on the
    current stream: the images may be freed after it (the caching allocator orders reuse on it)."""
    n, size = len(images), out.shape[-1]
    table = torch.tensor([(im.data_ptr(), *im.stride()) for im in images], dtype=torch.int64).reshape(n, 4)
    params = torch.cat((table, boxes.to(torch.int64), flips.to(torch.int64)[:, None]), dim=1)
    with torch.cuda.device(out.device):  # Triton launches on the current device
        _crop_resize_kernel[(n, triton.cdiv(size * size, BLOCK))](
            out, params.to(out.device, non_blocking=True), *out.stride(), *_MEAN255, *_STD255,
            SIZE=size, BLOCK=BLOCK)
